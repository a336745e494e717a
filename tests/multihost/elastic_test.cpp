// An elastic job across the two hosts of the test bed (tests/support/hosts.h): `accelerate launch
// --nnodes 1:2 --rdzv_backend c10d` on each host, FSDP with sharded checkpoints. A host is lost,
// the job goes on on the other from its newest checkpoint, and the host comes back and joins; the
// run must equal one run with the same schedule of world sizes, loss by loss and weight by weight.
// And the elastic rendezvous's errors: too few machines, a checkpoint unreadable at the rejoin.
#include "accelerate/utils/safetensors.h"
#include "support/hosts.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <regex>

namespace accelerate::testing {
namespace elastic_test {  // not anonymous: its names must not meet another file's in a unity batch

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;
using Env = std::map<std::string, std::string>;

const Env kSecret = {{"ACCELERATE_RDZV_SECRET", "a-secret-both-hosts-know"}};
constexpr int kSteps = 24;

// The flags every launcher of these jobs has: 2 processes per machine, FSDP with sharded state.
std::vector<std::string> launcher(const std::vector<std::string>& machines) {
  std::vector<std::string> argv = {accelerate_bin(), "launch"};
  argv.insert(argv.end(), machines.begin(), machines.end());
  argv.insert(argv.end(), {"--main_process_ip", HostPair::address(0), "--main_process_port", "29500",
                           "--rdzv_timeout", "60", "--num_cpu_threads_per_process", "1", "--grace_period", "2",
                           "--backend", "gloo", "--use_fsdp", "--fsdp_state_dict_type", "SHARDED_STATE_DICT"});
  return argv;
}

// The elastic launcher of `host`: 1 to 2 machines, restarts as given.
std::vector<std::string> elastic_on(const HostPair& hosts, int host, const std::string& dir, double pace,
                                    int max_restarts = 3) {
  auto argv = launcher({"--nnodes", "1:2", "--rdzv_backend", "c10d", "--num_processes", "4", "--rdzv_conf",
                        "last_call_timeout=2", "--max_restarts", std::to_string(max_restarts)});
  argv.insert(argv.end(), {built("tests/mp_elastic"), "--dir", dir, "--steps", std::to_string(kSteps), "--pace",
                           std::to_string(pace)});
  return hosts.in(host, argv);
}

// The "<round> <step>" the main process wrote last; {-1, -1} before.
std::pair<int, int> progress(const std::string& dir) {
  std::ifstream in(dir + "/progress");
  int round = -1, step = -1;
  in >> round >> step;
  return {round, step};
}

// Waits up to a minute for the progress to reach `round` and `step`.
bool wait_for_progress(const std::string& dir, int round, int step) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    const auto [r, s] = progress(dir);
    if (r >= round && s >= step) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << "no progress to round " << round << " step " << step << " within 60 s: at " << progress(dir).first
                << " " << progress(dir).second;
  return false;
}

// Each step's loss, as the main process printed it last (a step run again after a restart
// replaces the lost one).
std::map<int, std::string> losses(const std::string& out) {
  static const std::regex line(R"(step (\d+) world \d+ accumulation \d+ loss (\S+))");
  std::map<int, std::string> by_step;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator(); ++it) {
    by_step[std::stoi((*it)[1])] = (*it)[2];
  }
  return by_step;
}

// The (step, processes) each round resumed at.
std::vector<std::pair<int, int>> resumes(const std::string& out) {
  static const std::regex line(R"(resumed at step (\d+) with (\d+) processes)");
  std::vector<std::pair<int, int>> found;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator(); ++it) {
    found.emplace_back(std::stoi((*it)[1]), std::stoi((*it)[2]));
  }
  return found;
}

// The launchers of a job run by `argv_on(host)` on both hosts, whose second host is lost (every
// process of it killed) after step 4 of round 0 and started again once `before_back` returns;
// both launchers have ended: the first host's, and the second host's started again.
struct LostAndBack {
  std::unique_ptr<Running> first, back;
};
LostAndBack lose_second_host_and_bring_it_back(const HostPair& hosts, const std::string& run,
                                               const std::function<std::vector<std::string>(int)>& argv_on,
                                               const std::function<void()>& before_back) {
  LostAndBack job;
  job.first = std::make_unique<Running>(argv_on(0), kSecret);
  auto second = std::make_unique<Running>(argv_on(1), kSecret);
  if (wait_for_progress(run, 0, 4)) {
    hosts.kill_host(1);
    second->wait(30);
    before_back();
    job.back = std::make_unique<Running>(argv_on(1), kSecret);
    job.back->wait(240);
  }
  job.first->wait(240);
  return job;
}

// An ordinary job of 2 processes on each of the first `machines` hosts, to step `steps`, in `dir`
// (resuming from its newest checkpoint); the output of machine 0's launcher.
std::string run_on_machines(const HostPair& hosts, int machines, const std::string& dir, int steps) {
  std::vector<std::unique_ptr<Running>> launchers;
  for (int host = 0; host < machines; ++host) {
    auto argv = launcher({"--num_processes", std::to_string(2 * machines), "--num_machines", std::to_string(machines),
                          "--machine_rank", std::to_string(host)});
    argv.insert(argv.end(), {built("tests/mp_elastic"), "--dir", dir, "--steps", std::to_string(steps)});
    launchers.push_back(std::make_unique<Running>(hosts.in(host, argv), kSecret));
  }
  for (auto& l : launchers) {
    l->wait(240);
    EXPECT_EQ(l->exit_code(), 0) << l->out << l->err;
  }
  return launchers[0]->out;
}

// A run of `kSteps` steps of 4 processes on the first host, never interrupted, into `dir`; its
// output.
std::string uninterrupted_run(const HostPair& hosts, const std::string& dir) {
  fs::create_directories(dir);
  auto argv = launcher({"--num_processes", "4"});
  argv.insert(argv.end(), {built("tests/mp_elastic"), "--dir", dir, "--steps", std::to_string(kSteps)});
  auto run = testing::run(hosts.in(0, argv), 240, kSecret);
  EXPECT_EQ(run->exit_code(), 0) << run->err;
  return run->out;
}

// The final weights two runs wrote into their folders are equal, bit for bit.
void expect_equal_final_weights(const std::string& dir, const std::string& other) {
  SafetensorsFile got(dir + "/final.safetensors");
  SafetensorsFile want(other + "/final.safetensors");
  ASSERT_EQ(got.keys(), want.keys());
  for (const auto& key : got.keys()) EXPECT_TRUE(at::equal(got.get_tensor(key), want.get_tensor(key))) << key;
}

// The job a launcher too many tried to join goes on undisturbed (its workers all run), and its two
// launchers end as stopped when asked to.
void expect_undisturbed_until_stopped(const std::vector<pid_t>& workers, Running& first, Running& second) {
  for (pid_t pid : workers) EXPECT_FALSE(process_gone(pid)) << "worker " << pid;
  first.signal(SIGTERM);
  second.signal(SIGTERM);
  first.wait(60);
  second.wait(60);
  EXPECT_EQ(first.exit_code(), 128 + SIGTERM) << first.err;
  EXPECT_EQ(second.exit_code(), 128 + SIGTERM) << second.err;
}

TEST(Elastic, AJobGoesOnSmallerWhenAHostIsLostAndGrowsWhenItComesBackEqualToTheSameSchedule) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  const std::string run = dir.str() + "/elastic";
  fs::create_directories(run);
  // 2 hosts x 2 processes, until the second host is lost; then 1 host x 2 processes, resumed,
  // until the second host comes back.
  auto job = lose_second_host_and_bring_it_back(
      hosts, run, [&](int host) { return elastic_on(hosts, host, run, 0.3); },
      [&] { wait_for_progress(run, 1, progress(run).second + 3); });
  ASSERT_TRUE(job.back) << job.first->err;
  const Running& first = *job.first;
  const Running& back = *job.back;
  ASSERT_EQ(first.exit_code(), 0) << first.out << first.err;
  ASSERT_EQ(back.exit_code(), 0) << back.out << back.err;

  // What the launchers said, and the schedule of world sizes the program went through.
  EXPECT_THAT(first.err, HasSubstr("round 0 of the rendezvous: this is machine 0 of 2 (4 processes)"));
  EXPECT_THAT(first.err, HasSubstr("restarting with the machines that remain (restart 1 of 3)"));
  EXPECT_THAT(first.err, HasSubstr("round 1 of the rendezvous: this is machine 0 of 1 (2 processes)"));
  EXPECT_THAT(first.err, HasSubstr("a machine is waiting to join: forming the group again"));
  EXPECT_THAT(first.err, HasSubstr("round 2 of the rendezvous: this is machine 0 of 2 (4 processes)"));
  EXPECT_THAT(back.err, HasSubstr("round 2 of the rendezvous: this is machine 1 of 2 (4 processes)"));
  const auto schedule = resumes(first.out);
  ASSERT_EQ(schedule.size(), 2u) << first.out;
  EXPECT_EQ(schedule[0].second, 2);
  EXPECT_EQ(schedule[1].second, 4);
  EXPECT_GE(schedule[0].first, 3);
  EXPECT_GT(schedule[1].first, schedule[0].first);
  EXPECT_THAT(first.out, HasSubstr("finished at step " + std::to_string(kSteps)));

  // The same schedule, each part a job of its own: 4 processes to the first resume's step, 2 to
  // the second's, 4 to the end.
  const std::string ref = dir.str() + "/reference";
  fs::create_directories(ref);
  std::string ref_out;
  ref_out += run_on_machines(hosts, 2, ref, schedule[0].first);
  ref_out += run_on_machines(hosts, 1, ref, schedule[1].first);
  ref_out += run_on_machines(hosts, 2, ref, kSteps);
  const auto got = losses(first.out);
  const auto want = losses(ref_out);
  ASSERT_EQ(want.size(), static_cast<size_t>(kSteps)) << ref_out;
  EXPECT_EQ(got, want) << "the elastic run's losses against the same schedule's";
  // And the curve continues that of a run that never changed size: each step's global batch holds
  // the same samples at any size (the loader's position carries over), so the losses differ only by
  // the rounding of sums taken in another order.
  const auto never_changed = losses(uninterrupted_run(hosts, dir.str() + "/uninterrupted"));
  ASSERT_EQ(never_changed.size(), static_cast<size_t>(kSteps));
  for (const auto& [step, loss] : got) {
    EXPECT_NEAR(std::stod(loss), std::stod(never_changed.at(step)), 1e-4 * std::stod(never_changed.at(step)))
        << "step " << step;
  }
  expect_equal_final_weights(run, ref);
}

TEST(Elastic, FewerMachinesThanTheMinimumWithinTheRendezvousTimeoutAreNamed) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  auto argv = launcher({"--nnodes", "2:3", "--rdzv_backend", "c10d", "--num_processes", "6"});
  argv[std::find(argv.begin(), argv.end(), "--rdzv_timeout") - argv.begin() + 1] = "3";
  argv.insert(argv.end(), {built("tests/mp_elastic"), "--dir", dir.str(), "--steps", "2"});
  auto r = run(hosts.in(0, argv), 60, kSecret);
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_LT(r->elapsed, 30);
  EXPECT_THAT(r->err, HasSubstr("the elastic job needs at least 2 machine(s) (--nnodes 2:3), but only 1 joined "
                                "round 0 of the rendezvous at " + HostPair::address(0) + " within --rdzv_timeout (3s)"));
  EXPECT_FALSE(fs::exists(dir.path() / "progress")) << "workers ran without the minimum of machines";
}

// Note [Machine ranks from the rendezvous]: a third launcher for a job of two machines.
TEST(C10dRendezvous, ALauncherMoreThanTheMachinesOfTheJobIsToldSo) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  auto argv = launcher({"--num_machines", "2", "--rdzv_backend", "c10d", "--num_processes", "4"});
  argv.insert(argv.end(), {worker_bin(), "barriers", dir.str(), "30"});
  Running first(hosts.in(0, argv), kSecret);
  Running second(hosts.in(1, argv), kSecret);
  std::vector<pid_t> workers;
  for (int rank = 0; rank < 4; ++rank) workers.push_back(wait_for_int_file(dir.str() + "/pid_" + std::to_string(rank), 60));
  auto extra = testing::run(hosts.in(1, argv), 60, kSecret);
  EXPECT_EQ(extra->exit_code(), 2);
  EXPECT_LT(extra->elapsed, 30);
  EXPECT_THAT(extra->err, HasSubstr("this launcher joined the rendezvous at " + HostPair::address(0) +
                                    ":29500 as machine 2, but the job has --num_machines 2: more launchers than "
                                    "machines joined it"));
  expect_undisturbed_until_stopped(workers, first, second);
}

TEST(C10dRendezvous, AMachineLostAndLaunchedAgainRejoinsAndTheJobEndsAsAnUninterruptedRun) {
  // A job of a fixed size numbered at the rendezvous, with restarts: the lost machine's launcher,
  // started again, is not one launcher too many but joins the round the other opens.
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  const std::string run = dir.str() + "/fixed";
  fs::create_directories(run);
  auto on = [&](int host) {
    auto argv = launcher({"--num_machines", "2", "--rdzv_backend", "c10d", "--num_processes", "4", "--max_restarts",
                          "2"});
    argv.insert(argv.end(), {built("tests/mp_elastic"), "--dir", run, "--steps", std::to_string(kSteps), "--pace",
                             "0.3"});
    return hosts.in(host, argv);
  };
  auto job = lose_second_host_and_bring_it_back(hosts, run, on, [] {});
  ASSERT_TRUE(job.back) << job.first->err;
  const Running& first = *job.first;
  const Running& back = *job.back;
  ASSERT_EQ(first.exit_code(), 0) << first.out << first.err;
  ASSERT_EQ(back.exit_code(), 0) << back.out << back.err;
  EXPECT_THAT(first.err, HasSubstr("round 0 of the rendezvous: this is machine 0 of 2 (4 processes)"));
  EXPECT_THAT(first.err, HasSubstr("restarting; a lost machine rejoins when launched again (restart 1 of 2)"));
  EXPECT_THAT(first.err, HasSubstr("round 1 of the rendezvous: this is machine 0 of 2 (4 processes)"));
  EXPECT_THAT(back.err, HasSubstr("round 1 of the rendezvous: this is machine 1 of 2 (4 processes)"));
  EXPECT_THAT(back.err, Not(HasSubstr("more launchers than machines")));
  const auto schedule = resumes(first.out);
  ASSERT_EQ(schedule.size(), 1u) << first.out;
  EXPECT_EQ(schedule[0].second, 4);
  EXPECT_GE(schedule[0].first, 3);

  // Resumed at the same size, the run is the one that was never interrupted (on the same two
  // hosts), loss by loss and weight by weight.
  const std::string whole = dir.str() + "/uninterrupted";
  fs::create_directories(whole);
  const auto want = losses(run_on_machines(hosts, 2, whole, kSteps));
  ASSERT_EQ(want.size(), static_cast<size_t>(kSteps));
  EXPECT_EQ(losses(first.out), want);
  expect_equal_final_weights(run, whole);
}

TEST(C10dRendezvous, ALauncherMoreThanTheMachinesOfARestartingJobIsToldSoAfterTheRendezvousTimeout) {
  // With restarts, a launcher beyond the job's machines might be a lost machine's, launched again:
  // it waits for a round to open; when none does within its --rdzv_timeout, it is told why.
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  auto on = [&](int host, const char* rdzv_timeout) {
    auto argv = launcher({"--num_machines", "2", "--rdzv_backend", "c10d", "--num_processes", "4", "--max_restarts",
                          "1"});
    argv[std::find(argv.begin(), argv.end(), "--rdzv_timeout") - argv.begin() + 1] = rdzv_timeout;
    argv.insert(argv.end(), {worker_bin(), "barriers", dir.str(), "30"});
    return hosts.in(host, argv);
  };
  Running first(on(0, "60"), kSecret);
  Running second(on(1, "60"), kSecret);
  std::vector<pid_t> workers;
  for (int rank = 0; rank < 4; ++rank) workers.push_back(wait_for_int_file(dir.str() + "/pid_" + std::to_string(rank), 60));
  auto extra = testing::run(on(1, "3"), 60, kSecret);
  EXPECT_EQ(extra->exit_code(), 2) << extra->err;
  EXPECT_LT(extra->elapsed, 30);
  EXPECT_THAT(extra->err, HasSubstr("waiting for the running group (round 0) to take this machine in"));
  EXPECT_THAT(extra->err, HasSubstr("round 0 of the rendezvous at " + HostPair::address(0) + " runs the job's 2 "
                                    "machines (--num_machines 2) without this launcher, and no machine was lost "
                                    "within --rdzv_timeout (3s): more launchers than machines joined it"));
  expect_undisturbed_until_stopped(workers, first, second);
}

TEST(Elastic, ALauncherWaitingAtTheRendezvousStopsOnSigterm) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  auto argv = launcher({"--nnodes", "2:3", "--rdzv_backend", "c10d", "--num_processes", "6"});
  argv.insert(argv.end(), {built("tests/mp_elastic"), "--dir", dir.str(), "--steps", "2"});
  Running waiting(hosts.in(0, argv), kSecret);  // alone: below the minimum of 2 machines
  // `ip netns exec` runs the launcher in its own process; a SIGTERM before the launcher handles
  // it would end the process by default, with none of the launcher's words.
  ASSERT_TRUE(wait_until_catching(waiting.pid(), SIGTERM, 60)) << waiting.err;
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // on its way to the rendezvous
  const auto asked = std::chrono::steady_clock::now();
  waiting.signal(SIGTERM);
  waiting.wait(60);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - asked).count(), 5);
  EXPECT_EQ(waiting.exit_code(), 128 + SIGTERM) << waiting.err;
  EXPECT_THAT(waiting.err, HasSubstr("stopped: the launcher received SIGTERM while waiting at the elastic job's "
                                     "rendezvous"));
}

TEST(Elastic, ACheckpointUnreadableAtTheRejoinIsNamedInTheLastLine) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  const std::string run_dir = dir.str() + "/elastic";
  fs::create_directories(run_dir);
  // Slow steps: between two, the workers sleep, and save nothing more once the host is lost.
  Running first(elastic_on(hosts, 0, run_dir, 1.5, /*max_restarts=*/1), kSecret);
  Running second(elastic_on(hosts, 1, run_dir, 1.5, 1), kSecret);
  ASSERT_TRUE(wait_for_progress(run_dir, 0, 2));
  // The second host is lost, then every saved model shard loses its second half. In that order
  // no save can commit after the damage (a save needs both hosts), and the survivors rejoin
  // only after the rendezvous' last call (2 s), long after the damage.
  hosts.kill_host(1);
  int truncated = 0;
  std::error_code walk;
  for (fs::recursive_directory_iterator it(run_dir + "/checkpoints", walk), end; !walk && it != end; it.increment(walk)) {
    std::error_code ec;  // a save's scratch folder, removed as the save failed, is no shard
    if (it->is_regular_file(ec) && it->path().string().find("model") != std::string::npos &&
        it->path().string().find(".partial") == std::string::npos) {
      const auto size = fs::file_size(it->path(), ec);
      if (!ec) fs::resize_file(it->path(), size / 2, ec);
      if (!ec) ++truncated;
    }
  }
  ASSERT_GT(truncated, 0);
  first.wait(120);
  second.wait(30);
  EXPECT_NE(first.exit_code(), 0);
  // The restart the loss took used the budget; the rejoin that could not load ends the job, and
  // the launcher's last lines say which checkpoint and what is wrong with it.
  EXPECT_THAT(first.err, HasSubstr("round 1 of the rendezvous: this is machine 0 of 1 (2 processes)"));
  const auto end = first.err.rfind("\naccelerate launch: worker rank");
  ASSERT_NE(end, std::string::npos) << first.err;
  const auto last = first.err.substr(end);
  EXPECT_THAT(last, HasSubstr("error: [Accelerator::load_state] loading " + run_dir + "/checkpoints/checkpoint_"));
  EXPECT_THAT(last, HasSubstr("is not valid JSON"));
  EXPECT_THAT(first.err, Not(HasSubstr("round 2 of the rendezvous")));
}

}  // namespace elastic_test
}  // namespace accelerate::testing
