// Checkpoints that cross between Python and C++, against Debian's PyTorch: a folder written the
// way Python Accelerate's save_state writes it (tests/python/upstream_checkpoint.py) is resumed by
// load_state in C++ (tests/multiprocess/programs/python_interop.cpp), and a folder save_state
// writes in Python's layout is resumed by Python; either way the training ends where a run that
// never switched ends (AdamW, a linear warm-up schedule, 1 and 2 processes), and the global
// generator continues from the saved state. A folder holding a Python object is refused by name.
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace accelerate::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

constexpr const char* kPython = "/usr/bin/python3";
constexpr int kSwitch = 4, kEnd = 8;

// The C++ job; `launch` adds flags of `accelerate launch` (FSDP's).
std::vector<std::string> cpp(int processes, const std::vector<std::string>& args,
                             const std::vector<std::string>& launch = {}) {
  std::vector<std::string> argv;
  if (processes > 1) {
    argv = {accelerate_bin(), "launch", "-n", std::to_string(processes), "--main_process_port", "0"};
    argv.insert(argv.end(), launch.begin(), launch.end());
  }
  argv.push_back(built("tests/mp_python_interop"));
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

std::vector<std::string> python(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {kPython, built("tests/python/upstream_checkpoint.py")};
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

nlohmann::json run_for_result(const std::vector<std::string>& argv, const std::string& out) {
  auto r = run(argv, 240);
  EXPECT_EQ(r->exit_code(), 0) << r->out << r->err;
  std::ifstream in(out);
  EXPECT_TRUE(in.good()) << out << " was not written: " << r->err;
  return in.good() ? nlohmann::json::parse(in) : nlohmann::json();
}

// The two runs' parameters agree to float tolerance, the rates exactly, and the generator's draws
// after the switch exactly.
void expect_same_training(const nlohmann::json& a, const nlohmann::json& b) {
  ASSERT_TRUE(a.contains("params") && b.contains("params"));
  ASSERT_EQ(a["params"].size(), 4u);
  for (const auto& [name, values] : a["params"].items()) {
    ASSERT_TRUE(b["params"].contains(name)) << name;
    const auto& other = b["params"][name];
    ASSERT_EQ(values.size(), other.size()) << name;
    for (size_t i = 0; i < values.size(); ++i) {
      EXPECT_NEAR(values[i].get<double>(), other[i].get<double>(), 2e-6) << name << "[" << i << "]";
    }
  }
  EXPECT_DOUBLE_EQ(a["lr"].get<double>(), b["lr"].get<double>());
  ASSERT_EQ(a["draws"].size(), 4u);
  EXPECT_EQ(a["draws"], b["draws"]) << "the global generator did not continue from the saved state";
}

// Fully sharded (the model one unit: Sequential calls its children without their hooks), with
// whole states in the checkpoint (FULL_STATE_DICT).
const std::vector<std::string> kFsdp = {"--use_fsdp", "--fsdp_state_dict_type", "FULL_STATE_DICT",
                                        "--fsdp_auto_wrap_policy", "NO_WRAP"};

void python_to_cpp(int processes, const std::vector<std::string>& launch = {}) {
  TempDir dir;
  const auto folder = dir.str() + "/from_python";
  const auto never_switched = run_for_result(
      python({"--steps-to", std::to_string(kEnd), "--save-at", std::to_string(kSwitch), "--save", folder,
              "--processes", std::to_string(processes), "--out", dir.str() + "/python.json"}),
      dir.str() + "/python.json");
  ASSERT_TRUE(fs::is_regular_file(fs::path(folder) / "optimizer.bin"));
  ASSERT_TRUE(fs::is_regular_file(fs::path(folder) / ("random_states_" + std::to_string(processes - 1) + ".pkl")));
  const auto resumed = run_for_result(cpp(processes, {"--steps-from", std::to_string(kSwitch), "--steps-to",
                                                      std::to_string(kEnd), "--load", folder, "--out",
                                                      dir.str() + "/cpp.json"},
                                                  launch),
                                      dir.str() + "/cpp.json");
  expect_same_training(never_switched, resumed);
  EXPECT_EQ(resumed.value("step", -1), kEnd) << "the step of random_states_<p>.pkl was not restored";
}

void cpp_to_python(int processes, const std::vector<std::string>& launch = {}) {
  TempDir dir;
  const auto folder = dir.str() + "/from_cpp";
  const auto never_switched =
      run_for_result(cpp(processes, {"--steps-to", std::to_string(kEnd), "--save-at", std::to_string(kSwitch),
                                     "--save", folder, "--out", dir.str() + "/cpp.json"},
                         launch),
                     dir.str() + "/cpp.json");
  // A fully sharded job writes its model as upstream's FSDP does (FULL_STATE_DICT).
  const auto* model_file = launch.empty() ? "model.safetensors" : "pytorch_model_fsdp.bin";
  for (const auto* name : {model_file, "optimizer.bin", "scheduler.bin", "random_states_0.pkl"}) {
    EXPECT_TRUE(fs::is_regular_file(fs::path(folder) / name)) << name;
  }
  EXPECT_FALSE(fs::exists(fs::path(folder) / "optimizer.safetensors"));
  const auto resumed = run_for_result(
      python({"--steps-from", std::to_string(kSwitch), "--steps-to", std::to_string(kEnd), "--load", folder,
              "--processes", std::to_string(processes), "--out", dir.str() + "/python.json"}),
      dir.str() + "/python.json");
  expect_same_training(never_switched, resumed);
  EXPECT_EQ(resumed.value("loaded_step", -1), kSwitch) << "Python read another step from random_states_0.pkl";
}

TEST(PythonCheckpoint, FolderWrittenByPythonResumesInOneCppProcess) { python_to_cpp(1); }
TEST(PythonCheckpoint, FolderWrittenByPythonResumesInTwoCppProcesses) { python_to_cpp(2); }
TEST(PythonCheckpoint, FolderWrittenInPythonsLayoutResumesInPythonFromOneProcess) { cpp_to_python(1); }
TEST(PythonCheckpoint, FolderWrittenInPythonsLayoutResumesInPythonFromTwoProcesses) { cpp_to_python(2); }

TEST(PythonCheckpoint, FolderWrittenByPythonResumesFullyShardedInTwoCppProcesses) { python_to_cpp(2, kFsdp); }
TEST(PythonCheckpoint, FullyShardedJobsFolderInPythonsLayoutResumesInPython) { cpp_to_python(2, kFsdp); }

// A fully sharded job's SHARDED_STATE_DICT in Python's layout: torch.distributed.checkpoint
// folders (upstream's FSDP's), which the project reads back too, at 2 processes and at 1 without
// FSDP, at a fixed rate. (Upstream Accelerate itself reads them in
// tests/packages/checkpoint_check.py.)
TEST(PythonCheckpoint, FullyShardedJobsDcpFoldersResumeInCppAtTwoProcessesAndAtOneWithoutFsdp) {
  TempDir dir;
  const auto folder = dir.str() + "/from_cpp";
  auto flags = kFsdp;
  flags[2] = "SHARDED_STATE_DICT";
  const auto never_switched = run_for_result(
      cpp(2, {"--steps-to", std::to_string(kEnd), "--save-at", std::to_string(kSwitch), "--save", folder,
              "--scheduler", "none", "--out", dir.str() + "/cpp.json"},
          flags),
      dir.str() + "/cpp.json");
  for (const auto* sub : {"pytorch_model_fsdp_0", "optimizer_0"}) {
    EXPECT_TRUE(fs::is_regular_file(fs::path(folder) / sub / ".metadata")) << sub;
    EXPECT_TRUE(fs::is_regular_file(fs::path(folder) / sub / "__1_0.distcp")) << sub;
  }
  EXPECT_FALSE(fs::exists(fs::path(folder) / "model.safetensors"));
  for (const int processes : {2, 1}) {
    const auto out = dir.str() + "/resumed_" + std::to_string(processes) + ".json";
    const auto resumed = run_for_result(cpp(processes,
                                            {"--steps-from", std::to_string(kSwitch), "--steps-to",
                                             std::to_string(kEnd), "--load", folder, "--scheduler", "none",
                                             "--out", out},
                                            processes == 2 ? flags : std::vector<std::string>{}),
                                        out);
    expect_same_training(never_switched, resumed);  // at a fixed rate, any process count agrees
    EXPECT_EQ(resumed.value("step", -1), kEnd);
  }
}

TEST(PythonCheckpoint, LocalStatesAreRefusedForPythonsLayoutBeforeAnythingIsWritten) {
  TempDir dir;
  auto flags = kFsdp;
  flags[2] = "LOCAL_STATE_DICT";
  auto r = run(cpp(2, {"--steps-to", "2", "--save-at", "1", "--save", dir.str() + "/ckpt", "--out",
                       dir.str() + "/cpp.json"},
                   flags),
               240);
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_THAT(r->err, HasSubstr("saves LOCAL_STATE_DICT states, which Python's layout cannot hold"));
  EXPECT_FALSE(fs::exists(dir.path() / "ckpt"));
}

TEST(PythonCheckpoint, AFolderHoldingAPythonObjectIsRefusedByNameOnEveryProcess) {
  TempDir dir;
  const auto folder = dir.str() + "/from_python";
  run_for_result(python({"--steps-to", "2", "--save-at", "1", "--save", folder, "--processes", "2", "--out",
                         dir.str() + "/python.json"}),
                 dir.str() + "/python.json");
  // An optimizer.bin that unpickles to an object of a Python class (it would run its code).
  auto w = run({kPython, "-c",
                "import argparse, sys, torch; torch.save(argparse.Namespace(lr=1.0), sys.argv[1])",
                folder + "/optimizer.bin"});
  ASSERT_EQ(w->exit_code(), 0) << w->err;
  auto r = run(cpp(2, {"--steps-from", "1", "--steps-to", "2", "--load", folder, "--out", dir.str() + "/cpp.json"}),
               240);
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_THAT(r->err, HasSubstr("optimizer.bin"));
  EXPECT_THAT(r->err, HasSubstr("an object of argparse.Namespace, which is not read"));
  EXPECT_FALSE(fs::exists(dir.path() / "cpp.json"));
}

}  // namespace
}  // namespace accelerate::testing
