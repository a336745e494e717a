// An MPI job across two hosts of the test bed (tests/support/hosts.h): one `accelerate launch`
// on the first host, `mpirun` starting the second host's ranks from a host file over ssh, to a
// real OpenSSH server on each host (tests/support/cluster.h). The second host's server has its
// own folder at the launcher's scratch path: none of the launcher's files, as separate machines.
#include "accelerate/utils/environment.h"
#include "accelerate/utils/safetensors.h"
#include "support/cluster.h"
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

// Two hosts, each with an ssh server, and a folder for the test. The launcher's scratch folder
// (TMPDIR) is one the second host has a folder of its own at.
struct MpiBed {
  HostPair hosts;
  TempDir dir;
  std::string launcher_tmp = dir.str() + "/launcher-tmp";
  SshServers ssh{hosts, dir.str(), launcher_tmp};
};

#define ACCELERATE_REQUIRE_MPI_BED(bed)                          \
  if (!is_mpi_available()) GTEST_SKIP() << "built without MPI"; \
  ACCELERATE_REQUIRE_HOSTS((bed).hosts);                         \
  ACCELERATE_REQUIRE_DAEMONS((bed).ssh)

// `accelerate launch` of a 4-process MPI job on the two hosts, from the first, with `agent` as
// mpirun's ssh; waited for.
std::unique_ptr<Running> launch_mpi_job(const MpiBed& bed, const std::vector<std::string>& program,
                                        std::map<std::string, std::string> env = {}, std::string agent = "") {
  const std::string hostfile = bed.dir.str() + "/hosts";
  std::ofstream(hostfile) << HostPair::address(0) << " slots=2\n" << HostPair::address(1) << " slots=2\n";
  std::vector<std::string> argv = {accelerate_bin(), "launch", "--mpirun_hostfile", hostfile, "-n", "4",
                                   "--num_machines", "2", "--main_process_ip", HostPair::address(0),
                                   "--main_process_port", "29500", "--rdzv_timeout", "60",
                                   "--num_cpu_threads_per_process", "1"};
  argv.insert(argv.end(), program.begin(), program.end());
  // Open MPI 4 reads its ssh command from plm_rsh_agent; Open MPI 5 (PRRTE) from plm_ssh_agent.
  std::filesystem::create_directories(bed.launcher_tmp);
  if (agent.empty()) agent = bed.ssh.agent();
  env["OMPI_MCA_plm_rsh_agent"] = agent;
  env["PRTE_MCA_plm_ssh_agent"] = agent;
  env["TMPDIR"] = bed.launcher_tmp;
  auto r = std::make_unique<Running>(bed.hosts.in(0, argv), env);
  r->wait(240);
  return r;
}

TEST(MultiHostMpi, AHostFileStartsTheOtherHostsRanksOverSshAndTheyTrainLikeOneProcess) {
  MpiBed bed;
  ACCELERATE_REQUIRE_MPI_BED(bed);
  auto r = launch_mpi_job(bed, {built("tests/mp_training"), "plain"});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("[rank0]: plain: OK"));
  // The network settings the launcher passes are the ones this Open MPI knows (Note [The
  // network MPI uses]): no warning about a deprecated one reaches the job's output.
  EXPECT_THAT(r->out + r->err, Not(HasSubstr("Deprecated variable")));
}

TEST(MultiHostMpi, EveryRankKnowsItsHostAndPlace) {
  MpiBed bed;
  ACCELERATE_REQUIRE_MPI_BED(bed);
  auto r = launch_mpi_job(bed, {worker_bin(), "state"});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  // The first host's ranks come through the launcher's pipes, the second's through mpirun.
  EXPECT_THAT(r->out, HasSubstr("[rank0]: process 0 of 4 local 0 type MULTI_CPU backend mpi"));
  EXPECT_THAT(r->out, HasSubstr("[rank1]: process 1 of 4 local 1 type MULTI_CPU backend mpi"));
  EXPECT_THAT(r->out, HasSubstr("[mpirun]: process 2 of 4 local 0 type MULTI_CPU backend mpi"));
  EXPECT_THAT(r->out, HasSubstr("[mpirun]: process 3 of 4 local 1 type MULTI_CPU backend mpi"));
}

// The launcher's last lines (its root cause).
std::string last_lines(const std::string& err, int count = 2) {
  auto end = err.size();
  while (end > 0 && err[end - 1] == '\n') --end;
  auto start = end;
  for (int i = 0; i < count && start != std::string::npos && start > 0; ++i) start = err.rfind('\n', start - 1);
  return err.substr(start == std::string::npos ? 0 : start + 1, end - (start == std::string::npos ? 0 : start + 1));
}

// ssh refusing the second host: the launcher's last line says which host and why.
TEST(MultiHostMpi, AHostKeyThatDoesNotMatchIsNamedInTheLastLine) {
  MpiBed bed;
  ACCELERATE_REQUIRE_MPI_BED(bed);
  auto r = launch_mpi_job(bed, {worker_bin(), "state"}, {}, bed.ssh.agent_with_wrong_host_keys());
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_LT(r->elapsed, 30);
  EXPECT_THAT(last_lines(r->err), HasSubstr("error: ssh refused to log in to " + HostPair::address(1) +
                                            ": its host key is not the one known_hosts holds for it"))
      << r->err;
  EXPECT_THAT(r->out, Not(HasSubstr("process 0 of 4")));
}

TEST(MultiHostMpi, ALoginThatIsRefusedIsNamedInTheLastLine) {
  MpiBed bed;
  ACCELERATE_REQUIRE_MPI_BED(bed);
  auto r = launch_mpi_job(bed, {worker_bin(), "state"}, {}, bed.ssh.agent_with_unknown_login_key());
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_LT(r->elapsed, 30);
  EXPECT_THAT(last_lines(r->err), HasSubstr("error: ssh could not log in: root@" + HostPair::address(1) +
                                            ": Permission denied (publickey)"))
      << r->err;
}

// Checkpoints across the hosts of an MPI job: (shared folder?, save_on_each_node?). An unshared
// folder is one under the launcher's scratch folder, which the second host has one of its own at.
class MultiHostMpiCheckpoint : public ::testing::TestWithParam<std::pair<bool, bool>> {};

TEST_P(MultiHostMpiCheckpoint, ResumesBitForBitOnEveryRank) {
  const bool shared = GetParam().first;
  const bool each_node = GetParam().second;
  MpiBed bed;
  ACCELERATE_REQUIRE_MPI_BED(bed);
  const TempDir& dir = bed.dir;
  const std::string base = shared ? dir.str() + "/shared" : bed.launcher_tmp + "/project";
  auto job = [&](const std::vector<std::string>& args) {
    // mpirun passes the other machine's ranks only the variables it is told to (-x), as ssh
    // starts them in a fresh environment: the setting goes in the command every rank runs.
    std::vector<std::string> program;
    if (each_node) program = {"/usr/bin/env", "MP_CHECKPOINT_SAVE_ON_EACH_NODE=1"};
    program.push_back(built("tests/mp_checkpoint"));
    program.insert(program.end(), args.begin(), args.end());
    auto r = launch_mpi_job(bed, program);
    EXPECT_EQ(r->exit_code(), 0) << r->out << r->err;
    return r->exit_code() == 0;
  };
  ASSERT_TRUE(job({"full", base + "/a", dir.str() + "/full"}));
  ASSERT_TRUE(job({"first", base + "/b"}));
  EXPECT_TRUE(std::filesystem::is_regular_file(base + "/b/checkpoints/checkpoint_0/model.safetensors"));
  if (!shared) {  // the second host's own copy
    const std::string other = bed.launcher_tmp + "-" + bed.hosts.name(1) + "/project/b/checkpoints/checkpoint_0";
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
