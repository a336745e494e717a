// An MPI job across two hosts of the test bed (tests/support/hosts.h): one `accelerate launch`
// on the first host, `mpirun` starting the second host's ranks from a host file through an agent
// that stands in for ssh (the second host without the launcher's files, as separate machines are).
#include "accelerate/utils/environment.h"
#include "accelerate/utils/safetensors.h"
#include "support/hosts.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// The launcher's scratch folder, which the second host has a folder of its own at (write_rsh_agent).
std::string launcher_tmp_of(const TempDir& dir) { return dir.str() + "/launcher-tmp"; }

std::unique_ptr<Running> launch_mpi_job(const HostPair& hosts, const TempDir& dir,
                                        const std::vector<std::string>& program,
                                        std::map<std::string, std::string> env = {}) {
  const std::string hostfile = dir.str() + "/hosts";
  std::ofstream(hostfile) << HostPair::address(0) << " slots=2\n" << HostPair::address(1) << " slots=2\n";
  std::vector<std::string> argv = {accelerate_bin(), "launch", "--mpirun_hostfile", hostfile, "-n", "4",
                                   "--num_machines", "2", "--main_process_ip", HostPair::address(0),
                                   "--main_process_port", "29500", "--rdzv_timeout", "60",
                                   "--num_cpu_threads_per_process", "1"};
  argv.insert(argv.end(), program.begin(), program.end());
  // The launcher's files go to a folder the second host does not see. Open MPI 4 reads its
  // agent from plm_rsh_agent; Open MPI 5 (PRRTE) from plm_ssh_agent.
  const std::string launcher_tmp = launcher_tmp_of(dir);
  std::filesystem::create_directories(launcher_tmp);
  const std::string agent = hosts.write_rsh_agent(launcher_tmp);
  env["OMPI_MCA_plm_rsh_agent"] = agent;
  env["PRTE_MCA_plm_ssh_agent"] = agent;
  env["TMPDIR"] = launcher_tmp;
  auto r = std::make_unique<Running>(hosts.in(0, argv), env);
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
  // The network settings the launcher passes are the ones this Open MPI knows (Note [The
  // network MPI uses]): no warning about a deprecated one reaches the job's output.
  EXPECT_THAT(r->out + r->err, Not(HasSubstr("Deprecated variable")));
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

// Checkpoints across the hosts of an MPI job: (shared folder?, save_on_each_node?). An unshared
// folder is one under the launcher's scratch folder, which the second host has one of its own at.
class MultiHostMpiCheckpoint : public ::testing::TestWithParam<std::pair<bool, bool>> {};

TEST_P(MultiHostMpiCheckpoint, ResumesBitForBitOnEveryRank) {
  if (!is_mpi_available()) GTEST_SKIP() << "built without MPI";
  const bool shared = GetParam().first;
  const bool each_node = GetParam().second;
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  const std::string base = shared ? dir.str() + "/shared" : launcher_tmp_of(dir) + "/project";
  std::map<std::string, std::string> env;
  if (each_node) env["MP_CHECKPOINT_SAVE_ON_EACH_NODE"] = "1";
  auto job = [&](const std::vector<std::string>& args) {
    std::vector<std::string> program = {built("tests/mp_checkpoint")};
    program.insert(program.end(), args.begin(), args.end());
    auto r = launch_mpi_job(hosts, dir, program, env);
    EXPECT_EQ(r->exit_code(), 0) << r->out << r->err;
    return r->exit_code() == 0;
  };
  ASSERT_TRUE(job({"full", base + "/a", dir.str() + "/full"}));
  ASSERT_TRUE(job({"first", base + "/b"}));
  EXPECT_TRUE(std::filesystem::is_regular_file(base + "/b/checkpoints/checkpoint_0/model.safetensors"));
  if (!shared) {  // the second host's own copy
    const std::string other = launcher_tmp_of(dir) + "-" + hosts.name(1) + "/project/b/checkpoints/checkpoint_0";
    EXPECT_TRUE(std::filesystem::is_regular_file(other + "/model.safetensors")) << other;
  }
  ASSERT_TRUE(job({"second", base + "/b", dir.str() + "/resumed"}));
  expect_resumed_like_full(dir.str(), 4);
}

INSTANTIATE_TEST_SUITE_P(Folders, MultiHostMpiCheckpoint,
                         ::testing::Values(std::pair{true, false}, std::pair{true, true}, std::pair{false, true}),
                         [](const auto& info) {
                           return std::string(info.param.first ? "Shared" : "Unshared") +
                                  (info.param.second ? "SaveOnEachNode" : "SaveOnMainProcess");
                         });

}  // namespace
}  // namespace accelerate::testing
