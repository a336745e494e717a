// Checkpoints in real processes: a run interrupted by save_state and resumed by load_state in a
// new process ends bit for bit where the uninterrupted run ends (1 and 2 processes, at an epoch
// boundary and in the middle of an epoch); a process killed with SIGKILL in the middle of a save
// leaves the previous checkpoint loadable and the next save cleans up; a write that fails on one
// process fails the save on every process without committing anything.
#include "accelerate/utils/safetensors.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <csignal>
#include <filesystem>

namespace accelerate::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::vector<std::string> command(int processes, const std::vector<std::string>& args) {
  std::vector<std::string> argv;
  if (processes > 1) {
    argv = {accelerate_bin(), "launch", "-n", std::to_string(processes), "--main_process_port", "0"};
  }
  argv.push_back(built("tests/mp_checkpoint"));
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

void run_ok(int processes, const std::vector<std::string>& args, const std::map<std::string, std::string>& env = {}) {
  auto r = run(command(processes, args), 180, env);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
}

void resume_is_exact(int processes, bool stateful) {
  TempDir dir;
  const auto full = dir.str() + "/full", resumed = dir.str() + "/resumed";
  run_ok(processes, {"full", dir.str() + "/a", full});
  run_ok(processes, {stateful ? "stateful-first" : "first", dir.str() + "/b"});
  ASSERT_TRUE(fs::is_directory(dir.path() / "b/checkpoints/checkpoint_0"));
  run_ok(processes, {stateful ? "stateful-second" : "second", dir.str() + "/b", resumed});
  for (int rank = 0; rank < processes; ++rank) {
    const auto suffix = "." + std::to_string(rank) + ".safetensors";
    SCOPED_TRACE("process " + std::to_string(rank));
    // The resumed run continues numbering after the checkpoint it loaded; the full run never saved.
    SafetensorsFile r(resumed + suffix);
    EXPECT_EQ(r.metadata().at("iteration"), "1");
    SafetensorsFile f(full + suffix);
    EXPECT_EQ(f.metadata().at("iteration"), "0");
    auto expected = f.metadata();
    expected["iteration"] = "1";
    EXPECT_EQ(expected, r.metadata());
    for (const auto& key : f.keys()) {
      ASSERT_TRUE(r.contains(key)) << key;
      EXPECT_TRUE(at::equal(f.get_tensor(key), r.get_tensor(key))) << key << " differs";
    }
    EXPECT_EQ(f.keys(), r.keys());
  }
}

TEST(CheckpointResume, OneProcessAtAnEpochBoundaryIsBitExact) { resume_is_exact(1, false); }
TEST(CheckpointResume, TwoProcessesAtAnEpochBoundaryIsBitExact) { resume_is_exact(2, false); }
TEST(CheckpointResume, TwoProcessesInTheMiddleOfAnEpochWithAStatefulLoaderIsBitExact) { resume_is_exact(2, true); }
// Three or more processes sum in an order that depends on the gradients' place in their bucket
// (Note [First buckets as the rebuild makes them] in src/distributed.cpp).
TEST(CheckpointResume, FourProcessesAtAnEpochBoundaryIsBitExact) { resume_is_exact(4, false); }

TEST(CheckpointCrash, SigkillInTheMiddleOfASaveLeavesThePreviousCheckpointLoadable) {
  TempDir dir;
  const auto project = dir.str() + "/p";
  run_ok(2, {"full", dir.str() + "/a", dir.str() + "/full"});
  run_ok(2, {"first", project});
  const auto checkpoints = fs::path(project) / "checkpoints";
  const auto first_files = [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(checkpoints / "checkpoint_0")) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
  }();

  // Resume, finish training, and save again; the save stops after its first file and is killed.
  const auto marker = dir.str() + "/paused";
  Running crashed(command(2, {"second", project, dir.str() + "/ignored", "save"}),
                  {{"ACCELERATE_TEST_PAUSE_SAVE_AFTER_FIRST_FILE", marker}});
  const int pid = wait_for_int_file(marker + ".0", 120);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGKILL), 0);
  crashed.wait(60);
  EXPECT_NE(crashed.exit_code(), 0);
  EXPECT_THAT(crashed.err, HasSubstr("SIGKILL")) << crashed.err;
  // The interrupted save left only its hidden staging folder, with the first file in it.
  EXPECT_FALSE(fs::exists(checkpoints / "checkpoint_1"));
  EXPECT_TRUE(fs::exists(checkpoints / ".checkpoint_1.partial/model.safetensors"));
  std::vector<std::string> after;
  for (const auto& e : fs::directory_iterator(checkpoints / "checkpoint_0")) after.push_back(e.path().filename());
  std::sort(after.begin(), after.end());
  EXPECT_EQ(after, first_files);

  // The previous checkpoint resumes exactly, and the next save replaces the leftover.
  run_ok(2, {"second", project, dir.str() + "/resumed", "save"});
  for (int rank = 0; rank < 2; ++rank) {
    SafetensorsFile f(dir.str() + "/full." + std::to_string(rank) + ".safetensors");
    SafetensorsFile r(dir.str() + "/resumed." + std::to_string(rank) + ".safetensors");
    for (const auto& key : f.keys()) EXPECT_TRUE(at::equal(f.get_tensor(key), r.get_tensor(key))) << key;
  }
  EXPECT_FALSE(fs::exists(checkpoints / ".checkpoint_1.partial"));
  EXPECT_TRUE(fs::is_regular_file(checkpoints / "checkpoint_1/random_states_1.safetensors"));
}

TEST(CheckpointCrash, AWriteThatFailsOnOneProcessFailsTheSaveOnBothWithNothingCommitted) {
  TempDir dir;
  auto r = run(command(2, {"failwrite", dir.str()}), 180);
  EXPECT_EQ(r->exit_code(), 0) << r->out << r->err;
  // Both processes report the failure of process 1 and its cause.
  EXPECT_THAT(r->out, HasSubstr("[rank0]: save failed: saving the checkpoint")) << r->out;
  EXPECT_THAT(r->out, HasSubstr("[rank1]: save failed: saving the checkpoint")) << r->out;
  EXPECT_THAT(r->out, HasSubstr("failed on process 1: ")) << r->out;
  EXPECT_THAT(r->out, HasSubstr("File too large")) << r->out;
  EXPECT_FALSE(fs::exists(dir.path() / "checkpoints/checkpoint_0"));
  EXPECT_FALSE(fs::exists(dir.path() / "checkpoints/.checkpoint_0.partial"));
}

}  // namespace
}  // namespace accelerate::testing
