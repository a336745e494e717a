// Preemption that saves (AcceleratorOptions::preemption), with real signals sent to a real
// `accelerate launch` and its workers: the launcher passes SIGUSR1 on and forwards SIGTERM, every
// worker finishes its step, saves the state and ends with kPreemptedExitCode, the launcher's last
// line says the job was preempted, and the run resumed from that checkpoint ends equal to one that
// was never interrupted.
#include "accelerate/utils/safetensors.h"
#include "support/process.h"
#include "support/test_support.h"

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace accelerate::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr int kPreempted = 75;  // accelerate::kPreemptedExitCode

std::vector<std::string> launch(const std::string& dir, const std::vector<std::string>& args,
                                const std::vector<std::string>& launcher_args = {}) {
  std::vector<std::string> command = {accelerate_bin(), "launch", "-n", "2", "--main_process_port", "0",
                                      "--num_cpu_threads_per_process", "1"};
  command.insert(command.end(), launcher_args.begin(), launcher_args.end());
  command.push_back(built("tests/mp_preemption"));
  command.insert(command.end(), {"--dir", dir, "--steps", "12"});
  command.insert(command.end(), args.begin(), args.end());
  return command;
}

// Waits for every process's mark file (written after step 3) and returns the pids in them.
std::vector<pid_t> wait_for_marks(const fs::path& dir, Running& job) {
  std::vector<pid_t> pids;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline) {
    pids.clear();
    for (int rank = 0; rank < 2; ++rank) {
      std::ifstream in(dir / ("mark_" + std::to_string(rank)));
      pid_t pid = 0;
      if (in >> pid) pids.push_back(pid);
    }
    if (pids.size() == 2) return pids;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  job.wait(1);
  ADD_FAILURE() << "the workers never reached step 3\n" << job.out << job.err;
  return pids;
}

std::map<std::string, torch::Tensor> final_weights(const fs::path& dir) {
  SafetensorsFile file((dir / "final.safetensors").string());
  return {{"weight", file.get_tensor("weight")}, {"bias", file.get_tensor("bias")}};
}

// The same 12 steps, never interrupted.
std::map<std::string, torch::Tensor> uninterrupted(const TempDir& dir) {
  const auto ref = dir.path() / "reference";
  fs::create_directories(ref);
  auto r = run(launch(ref.string(), {}), 120);
  EXPECT_EQ(r->exit_code(), 0) << r->out << r->err;
  return final_weights(ref);
}

void expect_equal(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want) {
  for (const auto& [name, value] : want) {
    EXPECT_TRUE(torch::equal(got.at(name), value)) << name << "\n" << got.at(name) << "\n" << value;
  }
}

// The number in the step the run was saved at: "step <k>" is the last the main process printed.
int64_t last_step(const std::string& out) {
  const auto at = out.rfind("step ");
  return at == std::string::npos ? -1 : std::stoll(out.substr(at + 5));
}

TEST(Preemption, SigusrToTheLauncherSavesAtTheNextStepAndTheResumedRunEqualsAnUninterruptedOne) {
  TempDir dir;
  const auto want = uninterrupted(dir);
  const auto run_dir = dir.path() / "run";
  fs::create_directories(run_dir);
  Running job(launch(run_dir.string(), {"--mark", "3"}));
  wait_for_marks(run_dir, job);
  job.signal(SIGUSR1);
  job.wait(60);
  ASSERT_EQ(job.exit_code(), kPreempted) << job.out << job.err;
  EXPECT_THAT(job.err, HasSubstr("received SIGUSR1, passing it on to 2 worker(s)"));
  EXPECT_THAT(job.err, HasSubstr("the job was asked to stop (SIGUSR1): every process saves the state at this step"));
  EXPECT_THAT(job.err, HasSubstr("the job was preempted: 2 of 2 worker(s) saved the state and ended with exit status "
                                 "75; launch it again to resume"));
  const int64_t saved_at = last_step(job.out);
  EXPECT_GE(saved_at, 3);
  EXPECT_LT(saved_at, 12) << job.out;  // stopped early, at a step boundary
  EXPECT_TRUE(fs::is_directory(run_dir / "checkpoints/checkpoint_0")) << job.err;
  EXPECT_FALSE(fs::exists(run_dir / "final.safetensors"));

  auto resumed = run(launch(run_dir.string(), {"--resume"}), 120);
  ASSERT_EQ(resumed->exit_code(), 0) << resumed->out << resumed->err;
  EXPECT_THAT(resumed->out, HasSubstr("step " + std::to_string(saved_at + 1) + "\n"));
  EXPECT_THAT(resumed->out, ::testing::Not(HasSubstr("step " + std::to_string(saved_at) + "\n")));
  EXPECT_THAT(resumed->out, HasSubstr("finished at step 12"));
  expect_equal(final_weights(run_dir), want);
}

// SIGTERM (what Slurm sends on preemption and at the time limit) is forwarded as a stop: the
// workers save within the launcher's grace period instead of being killed.
TEST(Preemption, SigtermToTheLauncherSavesWithinTheGracePeriod) {
  TempDir dir;
  Running job(launch(dir.str(), {"--mark", "3"}, {"--grace_period", "60"}));
  wait_for_marks(dir.path(), job);
  job.signal(SIGTERM);
  job.wait(60);
  ASSERT_EQ(job.exit_code(), kPreempted) << job.out << job.err;
  EXPECT_THAT(job.err, HasSubstr("received SIGTERM, forwarding it to 2 worker(s)"));
  EXPECT_THAT(job.err, HasSubstr("the job was preempted: 2 of 2 worker(s) saved the state"));
  EXPECT_THAT(job.err, ::testing::Not(HasSubstr("SIGKILL")));
  EXPECT_TRUE(fs::is_directory(dir.path() / "checkpoints/checkpoint_0")) << job.err;
}

// A signal that reaches one process only (the other machine's launcher was not signalled yet):
// the question is asked of the whole job, so both processes stop after the same step. Here the
// loop asks itself (save_on_preemption off) and saves; the resumed run again ends equal.
TEST(Preemption, ASignalReachingOneWorkerStopsEveryWorkerAfterTheSameStep) {
  TempDir dir;
  const auto want = uninterrupted(dir);
  const auto run_dir = dir.path() / "run";
  fs::create_directories(run_dir);
  Running job(launch(run_dir.string(), {"--mark", "3", "--manual", "--signals", "USR2"}));
  const auto pids = wait_for_marks(run_dir, job);
  ASSERT_EQ(pids.size(), 2u);
  ::kill(pids[1], SIGUSR2);
  job.wait(60);
  ASSERT_EQ(job.exit_code(), kPreempted) << job.out << job.err;
  const auto stop = [&](int rank) {
    const std::string tag = "rank " + std::to_string(rank) + ": asked to stop after step ";
    const auto at = job.out.find(tag);
    return at == std::string::npos ? -1 : std::stoll(job.out.substr(at + tag.size()));
  };
  EXPECT_GE(stop(0), 3) << job.out;
  EXPECT_EQ(stop(0), stop(1)) << job.out;
  EXPECT_THAT(job.err, HasSubstr("the job was preempted: 2 of 2 worker(s) saved the state"));
  auto resumed = run(launch(run_dir.string(), {"--resume", "--manual"}), 120);
  ASSERT_EQ(resumed->exit_code(), 0) << resumed->out << resumed->err;
  expect_equal(final_weights(run_dir), want);
}

// A stop that comes right after a periodic save, or while load_state resumes, finds the newest
// checkpoint already holding this step: nothing new is saved, so total_limit keeps that
// checkpoint instead of pruning it for a copy, and the resumed run still ends equal.
TEST(Preemption, AStopWhenTheNewestCheckpointHoldsThisStepSavesNothingNew) {
  TempDir dir;
  const auto want = uninterrupted(dir);
  const auto run_dir = dir.path() / "run";
  fs::create_directories(run_dir);
  auto job = run(launch(run_dir.string(), {"--save_at", "4", "--raise_after_save", "--total_limit", "1"}), 120);
  ASSERT_EQ(job->exit_code(), kPreempted) << job->out << job->err;
  EXPECT_THAT(job->err, HasSubstr("the newest checkpoint, " + (run_dir / "checkpoints/checkpoint_0").string() +
                                  ", already holds this step: nothing new is saved"));
  EXPECT_EQ(last_step(job->out), 4) << job->out;
  EXPECT_TRUE(fs::is_directory(run_dir / "checkpoints/checkpoint_0")) << job->err;
  EXPECT_FALSE(fs::exists(run_dir / "checkpoints/checkpoint_1")) << job->err;

  // Asked to stop while resuming: the checkpoint just loaded holds the state.
  auto again = run(launch(run_dir.string(), {"--resume", "--raise_before_load", "--total_limit", "1"}), 120);
  ASSERT_EQ(again->exit_code(), kPreempted) << again->out << again->err;
  EXPECT_THAT(again->err, HasSubstr("the newest checkpoint, " + (run_dir / "checkpoints/checkpoint_0").string() +
                                    ", already holds this step: nothing new is saved"));
  EXPECT_TRUE(fs::is_directory(run_dir / "checkpoints/checkpoint_0"));
  EXPECT_FALSE(fs::exists(run_dir / "checkpoints/checkpoint_1"));

  auto resumed = run(launch(run_dir.string(), {"--resume", "--total_limit", "1"}), 120);
  ASSERT_EQ(resumed->exit_code(), 0) << resumed->out << resumed->err;
  EXPECT_THAT(resumed->out, HasSubstr("step 5\n"));
  EXPECT_THAT(resumed->out, HasSubstr("finished at step 12"));
  expect_equal(final_weights(run_dir), want);
}

}  // namespace
}  // namespace accelerate::testing
