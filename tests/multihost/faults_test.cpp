// Faults across hosts (tests/support/hosts.h): a host that dies, or whose link is cut, in the
// middle of a job. The surviving launcher must end within the process group's timeout with the
// lost host in its root cause, and leave nothing of the job running on its host.
#include "accelerate/utils/safetensors.h"
#include "support/hosts.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <functional>

namespace accelerate::testing {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

const std::map<std::string, std::string> kSecret = {{"ACCELERATE_RDZV_SECRET", "a-secret-both-hosts-know"}};

// `accelerate launch` of machine `host` of a 2-host job of 4 processes: the shared flags, then
// `flags`, then the program and its arguments.
std::vector<std::string> launch_on(const HostPair& hosts, int host, const std::vector<std::string>& flags,
                                   const std::vector<std::string>& program) {
  std::vector<std::string> argv = {accelerate_bin(),
                                   "launch",
                                   "--num_processes",
                                   "4",
                                   "--num_machines",
                                   "2",
                                   "--machine_rank",
                                   std::to_string(host),
                                   "--main_process_ip",
                                   HostPair::address(0),
                                   "--main_process_port",
                                   "29500",
                                   "--rdzv_timeout",
                                   "60",
                                   "--num_cpu_threads_per_process",
                                   "1",
                                   "--grace_period",
                                   "2"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.insert(argv.end(), program.begin(), program.end());
  return hosts.in(host, argv);
}

// Machine `host` of a job meeting in barriers.
std::vector<std::string> barriers_on(const HostPair& hosts, int host, const std::string& dir,
                                     const std::string& timeout) {
  return launch_on(hosts, host, {}, {worker_bin(), "barriers", dir, timeout});
}

// Machine `host` of a job running tests/mp_checkpoint with `args`.
std::vector<std::string> checkpoint_on(const HostPair& hosts, int host, const std::vector<std::string>& args) {
  std::vector<std::string> program = {built("tests/mp_checkpoint")};
  program.insert(program.end(), args.begin(), args.end());
  return launch_on(hosts, host, {}, program);
}

// Runs tests/mp_checkpoint on both hosts, with `args(host)`; both launchers must succeed.
void checkpoint_on_both(const HostPair& hosts, const std::function<std::vector<std::string>(int)>& args,
                        const std::map<std::string, std::string>& env) {
  Running first(checkpoint_on(hosts, 0, args(0)), env);
  Running second(checkpoint_on(hosts, 1, args(1)), env);
  first.wait(240);
  second.wait(240);
  ASSERT_EQ(first.exit_code(), 0) << first.out << first.err;
  ASSERT_EQ(second.exit_code(), 0) << second.out << second.err;
}

// Waits until every rank of the job wrote its pid, that is, is past the rendezvous.
bool all_ranks_running(const std::string& dir) {
  for (int rank = 0; rank < 4; ++rank) {
    if (wait_for_int_file(dir + "/pid_" + std::to_string(rank), 60) <= 0) return false;
  }
  return true;
}

TEST(MultiHostFaults, AHostThatDiesEndsTheOtherHostsLauncherNamingTheLostHost) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  Running survivor(barriers_on(hosts, 0, dir.str(), "60"), kSecret);
  Running lost(barriers_on(hosts, 1, dir.str(), "60"), kSecret);
  ASSERT_TRUE(all_ranks_running(dir.str()));
  hosts.kill_host(1);  // every process of host 1, its launcher included
  lost.wait(30);
  survivor.wait(30);  // far below the 60 s timeout: the peers' connections were reset
  EXPECT_NE(survivor.exit_code(), 0);
  EXPECT_THAT(survivor.err, HasSubstr("accelerate launch: worker rank "));
  EXPECT_THAT(survivor.err, HasSubstr("error: [wait_for_everyone] process "));
  EXPECT_THAT(survivor.err, HasSubstr("[" + HostPair::address(1) + "]"));
  // The processes that ran there (Note [Naming the lost machine]).
  EXPECT_THAT(survivor.err, HasSubstr("; " + HostPair::address(1) + " is the machine of processes 2 and 3"));
  EXPECT_TRUE(hosts.pids(0).empty()) << "processes of the job still run on the surviving host";
}

class MultiHostSaveFault : public ::testing::TestWithParam<bool> {};

TEST_P(MultiHostSaveFault, LeavesThePreviousCheckpointToResumeFrom) {
  // Each host saves into a folder of its own (save_on_each_node); host 1's first process, 2,
  // stops after the first file of the second save, and then host 1 dies (every process killed)
  // or its link is cut (the others wait for the process group's timeout, 5 s here).
  const bool cut = GetParam();
  namespace fs = std::filesystem;
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  auto project = [&](int host) { return dir.str() + "/host" + std::to_string(host); };
  auto checkpoints = [&](int host) { return fs::path(project(host)) / "checkpoints"; };
  auto env = kSecret;
  env["MP_CHECKPOINT_SAVE_ON_EACH_NODE"] = "1";
  checkpoint_on_both(
      hosts,
      [&](int) {
        return std::vector<std::string>{"full", dir.str() + "/a", dir.str() + "/full"};
      },
      env);
  checkpoint_on_both(
      hosts,
      [&](int host) {
        return std::vector<std::string>{"first", project(host)};
      },
      env);
  for (int host : {0, 1}) ASSERT_TRUE(fs::is_regular_file(checkpoints(host) / "checkpoint_0" / "model.safetensors"));

  auto paused = env;
  // Only a cut link needs the short timeout to end the survivors' wait; a killed host resets
  // their connections at once, and a 5 s limit on every collective of the run would race a
  // slow start.
  if (cut) paused["MP_CHECKPOINT_TIMEOUT"] = "5";
  const std::string marker = dir.str() + "/paused";
  paused["ACCELERATE_TEST_PAUSE_SAVE_AFTER_FIRST_FILE"] = marker;
  paused["ACCELERATE_TEST_PAUSE_SAVE_PROCESS"] = "2";
  {
    Running survivor(checkpoint_on(hosts, 0, {"second", project(0), dir.str() + "/ignored", "save"}), paused);
    Running lost(checkpoint_on(hosts, 1, {"second", project(1), dir.str() + "/ignored", "save"}), paused);
    ASSERT_GT(wait_for_int_file(marker + ".2", 120), 0) << survivor.err << lost.err;
    if (cut) {
      ASSERT_TRUE(hosts.cut_link(1)) << hosts.unavailable();
    } else {
      hosts.kill_host(1);
    }
    lost.wait(60);
    survivor.wait(60);  // killed: at once, the connections were reset; cut: the 5 s timeout
    EXPECT_NE(survivor.exit_code(), 0);
    if (cut) {
      EXPECT_NE(lost.exit_code(), 0);
      EXPECT_THAT(survivor.err, AnyOf(HasSubstr("within 5s"), HasSubstr("Timed out"), HasSubstr("timed out")));
    } else {
      EXPECT_THAT(survivor.err, HasSubstr("; " + HostPair::address(1) + " is the machine of process"));
    }
    EXPECT_TRUE(hosts.pids(0).empty()) << "processes of the job still run on host 0";
    EXPECT_TRUE(hosts.pids(1).empty()) << "processes of the job still run on host 1";
  }
  // Nothing of the interrupted save was committed on either host.
  for (int host : {0, 1}) {
    EXPECT_FALSE(fs::exists(checkpoints(host) / "checkpoint_1")) << "host " << host;
    EXPECT_TRUE(fs::exists(checkpoints(host) / "checkpoint_0" / "model.safetensors")) << "host " << host;
  }

  // With the host (or its link) back, the job resumes from the previous checkpoint exactly.
  if (cut) {
    ASSERT_TRUE(hosts.restore_link(1)) << hosts.unavailable();
  }
  checkpoint_on_both(
      hosts,
      [&](int host) {
        return std::vector<std::string>{"second", project(host), dir.str() + "/resumed", "save"};
      },
      env);
  expect_resumed_like_full(dir.str(), 4);
  for (int host : {0, 1}) {
    EXPECT_TRUE(fs::is_directory(checkpoints(host) / "checkpoint_1")) << "host " << host;
    EXPECT_FALSE(fs::exists(checkpoints(host) / ".checkpoint_1.partial")) << "host " << host;
  }
}

INSTANTIATE_TEST_SUITE_P(InTheMiddleOfASave, MultiHostSaveFault, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "LinkCut" : "HostKilled"); });

// Note [A machine that comes back] in src/launch/restarts.cpp. The host comes back once machine 0
// has restarted its workers, or at once, while machine 0 may still be tearing the failed attempt
// down (its launcher must then wait for the next attempt rather than join the full one).
class MultiHostRejoin : public ::testing::TestWithParam<bool> {};

TEST_P(MultiHostRejoin, WithRestartsAHostThatDiesAndComesBackRejoinsTheJob) {
  const bool at_once = GetParam();
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  auto rejoin_on = [&](int host) {
    return launch_on(hosts, host, {"--max_restarts", "1"}, {worker_bin(), "rejoin", dir.str()});
  };
  Running survivor(rejoin_on(0), kSecret);
  {
    Running lost(rejoin_on(1), kSecret);
    ASSERT_TRUE(all_ranks_running(dir.str()));
    hosts.kill_host(1);  // every process of host 1, its launcher included
    lost.wait(30);
  }
  // Machine 0 restarts its workers, which wait for the others; host 1 comes back.
  for (int rank : {0, 1}) {
    if (at_once) break;
    ASSERT_GT(wait_for_int_file(dir.str() + "/started_1_" + std::to_string(rank), 60), 0) << "no restart on host 0";
  }
  Running back(rejoin_on(1), kSecret);
  survivor.wait(120);
  back.wait(120);
  ASSERT_EQ(survivor.exit_code(), 0) << survivor.out << survivor.err;
  ASSERT_EQ(back.exit_code(), 0) << back.out << back.err;
  EXPECT_THAT(survivor.err, HasSubstr("restarting all 2 worker(s) (restart 1 of 1)"));
  EXPECT_THAT(back.err, HasSubstr("joining the job at restart 1 of 1, where the launcher of machine 0 is"));
  for (int rank : {0, 1}) EXPECT_THAT(survivor.out, HasSubstr("[rank" + std::to_string(rank) + "]: attempt 1 done"));
  for (int rank : {2, 3}) EXPECT_THAT(back.out, HasSubstr("[rank" + std::to_string(rank) + "]: attempt 1 done"));
  EXPECT_TRUE(hosts.pids(0).empty());
  EXPECT_TRUE(hosts.pids(1).empty());
}

INSTANTIATE_TEST_SUITE_P(HostComesBack, MultiHostRejoin, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "AtOnce" : "AfterTheRestart"); });

TEST(MultiHostFaults, ACutLinkEndsBothLaunchersWithinTheCollectiveTimeout) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  Running first(barriers_on(hosts, 0, dir.str(), "5"), kSecret);
  Running second(barriers_on(hosts, 1, dir.str(), "5"), kSecret);
  ASSERT_TRUE(all_ranks_running(dir.str()));
  ASSERT_TRUE(hosts.cut_link(1)) << hosts.unavailable();
  first.wait(90);
  second.wait(90);
  for (Running* side : {&first, &second}) {
    EXPECT_NE(side->exit_code(), 0);
    EXPECT_THAT(side->err, HasSubstr("accelerate launch: worker rank "));
    EXPECT_THAT(side->err, AnyOf(HasSubstr("within 5s"), HasSubstr("Timed out"), HasSubstr("timed out")));
  }
  EXPECT_TRUE(hosts.pids(0).empty()) << "processes of the job still run on host 0";
  EXPECT_TRUE(hosts.pids(1).empty()) << "processes of the job still run on host 1";
}

}  // namespace
}  // namespace accelerate::testing
