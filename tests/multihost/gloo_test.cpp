// Jobs across two hosts (network namespaces joined by a veth pair, tests/support/hosts.h), two
// processes on each, on Gloo: one `accelerate launch` per host, and processes started by hand
// with other launchers' variables. Each job must reproduce the one-process result, and a
// checkpoint saved across the hosts must resume bit for bit, whether the hosts share the
// checkpoint folder or not.
#include "accelerate/utils/safetensors.h"
#include "support/hosts.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>

namespace accelerate::testing {
namespace gloo_test {  // not anonymous: its names must not meet another file's in a unity batch

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using Env = std::map<std::string, std::string>;

constexpr const char* kPort = "29500";

// `accelerate launch` for machine `host` of a 2-host job of 4 processes.
std::vector<std::string> launch_on(const HostPair& hosts, int host, const std::vector<std::string>& program) {
  std::vector<std::string> argv = {accelerate_bin(), "launch", "--num_processes", "4", "--num_machines", "2",
                                   "--machine_rank", std::to_string(host), "--main_process_ip", HostPair::address(0),
                                   "--main_process_port", kPort, "--rdzv_timeout", "60",
                                   "--num_cpu_threads_per_process", "1", "--grace_period", "2"};
  argv.insert(argv.end(), program.begin(), program.end());
  return hosts.in(host, argv);
}

struct Outcome {
  std::string out[2];
  std::string err[2];
  int code[2] = {-1, -1};
};

// One launcher per host, `program(host)` on each; both must succeed.
Outcome run_on_both(const HostPair& hosts, const std::function<std::vector<std::string>(int)>& program,
                    Env env = {}) {
  env["ACCELERATE_RDZV_SECRET"] = "a-secret-both-hosts-know";
  Running first(launch_on(hosts, 0, program(0)), env);
  Running second(launch_on(hosts, 1, program(1)), env);
  first.wait(240);
  second.wait(240);
  Outcome o;
  o.out[0] = first.out, o.out[1] = second.out;
  o.err[0] = first.err, o.err[1] = second.err;
  o.code[0] = first.exit_code(), o.code[1] = second.exit_code();
  return o;
}

#define EXPECT_BOTH_SUCCEED(o)                                                          \
  for (int host : {0, 1}) {                                                             \
    ASSERT_EQ((o).code[host], 0) << "host " << host << ":\n" << (o).out[host] << (o).err[host]; \
  }

// How the processes of a job are started: one `accelerate launch` per host, or by hand with
// torchrun's variables, the way it starts them (Slurm's own srun: tests/multihost/slurm_test.cpp).
enum class Style { kLaunchers, kTorchrun };

std::string style_name(Style style) {
  switch (style) {
    case Style::kLaunchers: return "Launchers";
    case Style::kTorchrun: return "TorchrunVariables";
  }
  return "?";
}

// The variables torchrun gives process `rank` of a 2-host job of 4 processes.
Env foreign_env(int rank) {
  return Env{{"RANK", std::to_string(rank)},
             {"WORLD_SIZE", "4"},
             {"LOCAL_RANK", std::to_string(rank % 2)},
             {"LOCAL_WORLD_SIZE", "2"},
             {"GROUP_RANK", std::to_string(rank / 2)},
             {"MASTER_ADDR", HostPair::address(0)},
             {"MASTER_PORT", kPort}};
}

// Runs `program(host)` as a job of 4 processes on the two hosts, started as `style` starts them;
// each host's output (by hand: its processes' output, rank by rank) and exit code (the first
// failure among its processes).
Outcome run_job(const HostPair& hosts, Style style, const std::function<std::vector<std::string>(int)>& program,
                Env env = {}) {
  if (style == Style::kLaunchers) return run_on_both(hosts, program, env);
  env["ACCELERATE_RDZV_SECRET"] = "a-secret-both-hosts-know";
  env["ACCELERATE_RDZV_TIMEOUT"] = "60";
  env["OMP_NUM_THREADS"] = "1";
  std::vector<std::unique_ptr<Running>> processes;
  for (int rank = 0; rank < 4; ++rank) {
    Env own = env;
    for (auto& [key, value] : foreign_env(rank)) own[key] = value;
    processes.push_back(std::make_unique<Running>(hosts.in(rank / 2, program(rank / 2)), own));
  }
  Outcome o;
  o.code[0] = o.code[1] = 0;
  for (int rank = 0; rank < 4; ++rank) {
    auto& p = *processes[rank];
    p.wait(240);
    o.out[rank / 2] += p.out;
    o.err[rank / 2] += p.err;
    if (o.code[rank / 2] == 0) o.code[rank / 2] = p.exit_code();
  }
  return o;
}

class MultiHostTraining : public ::testing::TestWithParam<Style> {};

TEST_P(MultiHostTraining, TrainsLikeOneProcess) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  auto o = run_job(hosts, GetParam(), [](int) {
    return std::vector<std::string>{built("tests/mp_training"), "plain", "split_batches"};
  });
  EXPECT_BOTH_SUCCEED(o);
  EXPECT_THAT(o.out[0], HasSubstr("plain: OK"));
  EXPECT_THAT(o.out[0], HasSubstr("split_batches: OK"));
}

INSTANTIATE_TEST_SUITE_P(Styles, MultiHostTraining,
                         ::testing::Values(Style::kLaunchers, Style::kTorchrun),
                         [](const auto& info) { return style_name(info.param); });

TEST(MultiHost, EachHostsLauncherStartsItsOwnRanks) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  auto o = run_on_both(hosts, [](int) { return std::vector<std::string>{worker_bin(), "state"}; });
  EXPECT_BOTH_SUCCEED(o);
  EXPECT_THAT(o.out[0], HasSubstr("[rank0]: process 0 of 4 local 0 type MULTI_CPU backend gloo"));
  EXPECT_THAT(o.out[0], HasSubstr("[rank1]: process 1 of 4 local 1 type MULTI_CPU backend gloo"));
  EXPECT_THAT(o.out[1], HasSubstr("[rank2]: process 2 of 4 local 0 type MULTI_CPU backend gloo"));
  EXPECT_THAT(o.out[1], HasSubstr("[rank3]: process 3 of 4 local 1 type MULTI_CPU backend gloo"));
  for (int host : {0, 1}) EXPECT_THAT(o.out[host], HasSubstr("trigger seen"));
}

// Processes started by hand in each host, the way another launcher would start them.
void expect_foreign_job_runs(const HostPair& hosts, const std::function<Env(int rank)>& env_of) {
  std::vector<std::unique_ptr<Running>> workers;
  for (int rank = 0; rank < 4; ++rank) {
    Env env = env_of(rank);
    env["ACCELERATE_RDZV_TIMEOUT"] = "60";
    env["OMP_NUM_THREADS"] = "1";
    workers.push_back(std::make_unique<Running>(hosts.in(rank / 2, {worker_bin(), "state"}), env));
  }
  for (int rank = 0; rank < 4; ++rank) {
    auto& w = *workers[rank];
    w.wait(120);
    EXPECT_EQ(w.exit_code(), 0) << "rank " << rank << ": " << w.err;
    EXPECT_THAT(w.out, HasSubstr("process " + std::to_string(rank) + " of 4 local " + std::to_string(rank % 2) +
                                 " type MULTI_CPU backend gloo"));
    EXPECT_THAT(w.out, HasSubstr("trigger seen"));
  }
}

TEST(MultiHost, TorchrunStyleVariablesFormAJobAcrossHosts) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  expect_foreign_job_runs(hosts, [](int rank) {
    return Env{{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", std::to_string(rank % 2)},
               {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", std::to_string(rank / 2)},
               {"MASTER_ADDR", HostPair::address(0)}, {"MASTER_PORT", kPort}};
  });
}

// Checkpoints across hosts: (shared folder?, save_on_each_node?).
// Note [The job's store]: a job on one machine serves its rendezvous on loopback only.
TEST(MultiHost, AOneMachineJobsStoreCannotBeReachedFromAnotherHost) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  const std::string port = "29511";
  Running job(hosts.in(0, {accelerate_bin(), "launch", "-n", "2", "--backend", "gloo", "--main_process_port", port,
                           "--grace_period", "1", worker_bin(), "barriers", dir.str(), "60"}));
  for (int rank : {0, 1}) ASSERT_GT(wait_for_int_file(dir.str() + "/pid_" + std::to_string(rank), 60), 0);
  auto connect_from = [&](int host, const std::string& address) {
    return run(hosts.in(host, {"bash", "-c", "exec 3<>/dev/tcp/" + address + "/" + port + " && echo connected"}), 30);
  };
  auto other_host = connect_from(1, HostPair::address(0));
  EXPECT_NE(other_host->exit_code(), 0);
  EXPECT_THAT(other_host->err, HasSubstr("Connection refused"));
  auto same_host_address = connect_from(0, HostPair::address(0));
  EXPECT_NE(same_host_address->exit_code(), 0) << "the store answers on the host's network address";
  auto loopback = connect_from(0, "127.0.0.1");  // where the store is
  EXPECT_EQ(loopback->exit_code(), 0) << loopback->err;
  EXPECT_THAT(loopback->out, HasSubstr("connected"));
  job.signal(SIGTERM);
  job.wait(30);
  EXPECT_TRUE(hosts.pids(0).empty()) << "processes of the job still run on host 0";
}

class MultiHostCheckpoint : public ::testing::TestWithParam<std::tuple<Style, std::pair<bool, bool>>> {};

TEST_P(MultiHostCheckpoint, ResumesBitForBitOnEveryRank) {
  const Style style = std::get<0>(GetParam());
  const bool shared = std::get<1>(GetParam()).first;
  const bool each_node = std::get<1>(GetParam()).second;
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  auto project = [&](const std::string& run, int host) {
    return dir.str() + "/" + (shared ? std::string("shared") : "host" + std::to_string(host)) + "/" + run;
  };
  Env env;
  if (each_node) env["MP_CHECKPOINT_SAVE_ON_EACH_NODE"] = "1";
  auto checkpoint = [&](std::vector<std::string> args) {
    return [args](int) {
      std::vector<std::string> argv = {built("tests/mp_checkpoint")};
      argv.insert(argv.end(), args.begin(), args.end());
      return argv;
    };
  };
  auto full = run_job(
      hosts, style,
      [&](int host) {
        return checkpoint({"full", project("a", host), dir.str() + "/full"})(host);
      },
      env);
  EXPECT_BOTH_SUCCEED(full);
  auto first = run_job(
      hosts, style,
      [&](int host) {
        return checkpoint({"first", project("b", host)})(host);
      },
      env);
  EXPECT_BOTH_SUCCEED(first);
  // Where the checkpoint was written: by rank 0, or by each host's first process.
  EXPECT_TRUE(fs::is_regular_file(project("b", 0) + "/checkpoints/checkpoint_0/model.safetensors"));
  if (!shared) {
    EXPECT_TRUE(fs::is_regular_file(project("b", 1) + "/checkpoints/checkpoint_0/model.safetensors"));
  }
  auto second = run_job(
      hosts, style,
      [&](int host) {
        return checkpoint({"second", project("b", host), dir.str() + "/resumed"})(host);
      },
      env);
  EXPECT_BOTH_SUCCEED(second);
  expect_resumed_like_full(dir.str(), 4);
}

INSTANTIATE_TEST_SUITE_P(Folders, MultiHostCheckpoint,
                         ::testing::Combine(::testing::Values(Style::kLaunchers, Style::kTorchrun),
                                            ::testing::Values(std::pair{true, false}, std::pair{true, true},
                                                              std::pair{false, true})),
                         [](const auto& info) {
                           const auto& folder = std::get<1>(info.param);
                           return style_name(std::get<0>(info.param)) + (folder.first ? "Shared" : "Unshared") +
                                  (folder.second ? "SaveOnEachNode" : "SaveOnMainProcess");
                         });

}  // namespace gloo_test
}  // namespace accelerate::testing
