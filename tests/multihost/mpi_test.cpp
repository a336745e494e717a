// An MPI job across two hosts of the test bed (tests/support/hosts.h): one `accelerate launch`
// on the first host, `mpirun` starting the second host's ranks from a host file through an agent
// that stands in for ssh (the second host without the launcher's files, as separate machines are).
#include "accelerate/utils/environment.h"
#include "support/hosts.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

std::unique_ptr<Running> launch_mpi_job(const HostPair& hosts, const TempDir& dir,
                                        const std::vector<std::string>& program) {
  const std::string hostfile = dir.str() + "/hosts";
  std::ofstream(hostfile) << HostPair::address(0) << " slots=2\n" << HostPair::address(1) << " slots=2\n";
  std::vector<std::string> argv = {accelerate_bin(), "launch", "--mpirun_hostfile", hostfile, "-n", "4",
                                   "--num_machines", "2", "--main_process_ip", HostPair::address(0),
                                   "--main_process_port", "29500", "--rdzv_timeout", "60",
                                   "--num_cpu_threads_per_process", "1"};
  argv.insert(argv.end(), program.begin(), program.end());
  // The launcher's files go to a folder the second host does not see. Open MPI 4 reads its
  // agent from plm_rsh_agent; Open MPI 5 (PRRTE) from plm_ssh_agent.
  const std::string launcher_tmp = dir.str() + "/launcher-tmp";
  std::filesystem::create_directories(launcher_tmp);
  const std::string agent = hosts.write_rsh_agent(launcher_tmp);
  auto r = std::make_unique<Running>(hosts.in(0, argv),
                                     std::map<std::string, std::string>{{"OMPI_MCA_plm_rsh_agent", agent},
                                                                        {"PRTE_MCA_plm_ssh_agent", agent},
                                                                        {"TMPDIR", launcher_tmp}});
  r->wait(240);
  return r;
}

TEST(MultiHostMpi, AHostFileStartsTheOtherHostsRanksAndTheyTrainLikeOneProcess) {
  if (!is_mpi_available()) GTEST_SKIP() << "built without MPI";
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  auto r = launch_mpi_job(hosts, dir, {built("tests/mp_training"), "plain"});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("[rank0]: plain: OK"));
}

TEST(MultiHostMpi, EveryRankKnowsItsHostAndPlace) {
  if (!is_mpi_available()) GTEST_SKIP() << "built without MPI";
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  auto r = launch_mpi_job(hosts, dir, {worker_bin(), "state"});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  // The first host's ranks come through the launcher's pipes, the second's through mpirun.
  EXPECT_THAT(r->out, HasSubstr("[rank0]: process 0 of 4 local 0 type MULTI_CPU backend mpi"));
  EXPECT_THAT(r->out, HasSubstr("[rank1]: process 1 of 4 local 1 type MULTI_CPU backend mpi"));
  EXPECT_THAT(r->out, HasSubstr("[mpirun]: process 2 of 4 local 0 type MULTI_CPU backend mpi"));
  EXPECT_THAT(r->out, HasSubstr("[mpirun]: process 3 of 4 local 1 type MULTI_CPU backend mpi"));
}

}  // namespace
}  // namespace accelerate::testing
