// Programs started by other launchers' conventions, without `accelerate launch`: rank 0 serves
// the store itself, and the topology comes from torchrun, Slurm or Open MPI variables.
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

using Env = std::map<std::string, std::string>;

// Starts one worker per environment, all running the "state" mode, and checks each reports its rank.
void expect_job_runs(const std::vector<Env>& envs) {
  std::vector<std::unique_ptr<Running>> workers;
  for (const auto& env : envs) {
    Env full = env;
    full["ACCELERATE_RDZV_TIMEOUT"] = "30";
    workers.push_back(std::make_unique<Running>(std::vector<std::string>{worker_bin(), "state"}, full));
  }
  const int n = static_cast<int>(envs.size());
  for (int rank = 0; rank < n; ++rank) {
    auto& w = *workers[rank];
    w.wait(60);
    EXPECT_EQ(w.exit_code(), 0) << w.err;
    EXPECT_THAT(w.out, HasSubstr("process " + std::to_string(rank) + " of " + std::to_string(n)));
    EXPECT_THAT(w.out, HasSubstr("type MULTI_CPU backend gloo"));
    EXPECT_THAT(w.out, HasSubstr("trigger seen"));
  }
}

TEST(ForeignLaunchers, TorchrunStyleVariablesFormAJob) {
  const std::string port = std::to_string(free_port());
  std::vector<Env> envs;
  for (int rank = 0; rank < 2; ++rank) {
    envs.push_back({{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", std::to_string(rank)},
                    {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}});
  }
  expect_job_runs(envs);
}

TEST(ForeignLaunchers, SlurmVariablesFormAJob) {
  const std::string port = std::to_string(free_port());
  std::vector<Env> envs;
  for (int rank = 0; rank < 2; ++rank) {
    envs.push_back({{"SLURM_PROCID", std::to_string(rank)}, {"SLURM_NTASKS", "2"},
                    {"SLURM_LOCALID", std::to_string(rank)}, {"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_NNODES", "1"},
                    {"SLURM_STEP_NODELIST", "localhost"}, {"MASTER_PORT", port}});
  }
  expect_job_runs(envs);
}

TEST(ForeignLaunchers, OpenMpiVariablesFormAJob) {
  const std::string port = std::to_string(free_port());
  std::vector<Env> envs;
  for (int rank = 0; rank < 2; ++rank) {
    envs.push_back({{"OMPI_COMM_WORLD_RANK", std::to_string(rank)}, {"OMPI_COMM_WORLD_SIZE", "2"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(rank)}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                    {"MASTER_PORT", port}});
  }
  expect_job_runs(envs);
}

TEST(ForeignLaunchers, AMalformedRankVariableIsNamedInTheError) {
  auto r = run({worker_bin(), "state"}, 30, {{"RANK", "one"}, {"WORLD_SIZE", "2"}});
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_THAT(r->err, HasSubstr("environment variable RANK must be an integer, got 'one'"));
}

TEST(ForeignLaunchers, APortAlreadyServedByAnotherJobIsNamed) {
  // A first job's rank 0 holds the port while waiting for its peer; a second rank 0 on the same
  // port must say so rather than join the wrong job.
  const std::string port = std::to_string(free_port());
  Env env = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port},
             {"ACCELERATE_RDZV_TIMEOUT", "20"}};
  Env holder = env;
  holder["ACCELERATE_RDZV_TIMEOUT"] = "300";  // holds the port however slowly the second starts
  Running first({worker_bin(), "state"}, holder);
  ASSERT_TRUE(wait_for_port(std::stoi(port), 30)) << "the first job never served its store";
  auto second = run({worker_bin(), "state"}, 30, env);
  EXPECT_NE(second->exit_code(), 0);
  EXPECT_THAT(second->err, HasSubstr("port " + port + " is already in use"));
}

}  // namespace
}  // namespace accelerate::testing
