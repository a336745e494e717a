// Profiling with LibTorch's profiler and the Chrome traces it leaves (upstream: the profiler
// tests of test_accelerator.py).
#include "accelerate/utils/profiler.h"
#include "accelerate/utils/environment.h"
#include "support/test_support.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/jit.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace accelerate::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "no trace at " << path;
  return nlohmann::json::parse(in);
}

// The trace's events named `name`.
std::vector<nlohmann::json> events_named(const nlohmann::json& trace, const std::string& name) {
  std::vector<nlohmann::json> out;
  for (const auto& event : trace.at("traceEvents")) {
    if (event.at("name") == name) out.push_back(event);
  }
  return out;
}

float matmuls() {
  const auto a = at::ones({8, 8});
  return at::matmul(at::mm(a, a), a).sum().item<float>();
}

TEST(Profile, WritesAChromeTraceHoldingTheCallsMatrixProducts) {
  TempDir dir;
  const float result = profile({.output_trace_dir = dir.str()}, /*process_index=*/3, matmuls);
  EXPECT_EQ(result, 8.0f * 8 * 8 * 8);
  const auto trace = read_json(dir.path() / "profile_3.json");
  const auto mm = events_named(trace, "aten::mm");
  ASSERT_EQ(mm.size(), 2u);  // at::mm, and at::matmul's own
  EXPECT_EQ(mm[0].at("ph"), "X");
  EXPECT_EQ(mm[0].at("cat"), "cpu_op");
  EXPECT_GE(mm[0].at("dur").get<int64_t>(), 0);
  EXPECT_GT(mm[0].at("ts").get<int64_t>(), 0);
  EXPECT_EQ(events_named(trace, "aten::matmul").size(), 1u);
  EXPECT_FALSE(mm[0].at("args").contains("Input Dims"));
  EXPECT_FALSE(mm[0].at("args").contains("flops"));
}

TEST(Profile, RecordShapesAndWithFlopsFillTheEventArguments) {
  TempDir dir;
  profile({.record_shapes = true, .with_flops = true, .output_trace_dir = dir.str()}, 0, [] { (void)matmuls(); });
  const auto mm = events_named(read_json(dir.path() / "profile_0.json"), "aten::mm");
  ASSERT_FALSE(mm.empty());
  const auto& args = mm[0].at("args");
  EXPECT_EQ(args.at("Input Dims"), nlohmann::json::parse("[[8, 8], [8, 8]]"));
  EXPECT_EQ(args.at("Input type"), nlohmann::json::parse(R"(["float", "float"])"));
  EXPECT_EQ(args.at("flops").get<int64_t>(), 2 * 8 * 8 * 8);
}

TEST(Profile, ProfileMemoryRecordsEachAllocation) {
  TempDir dir;
  profile({.profile_memory = true, .output_trace_dir = dir.str()}, 0, [] { (void)at::empty({1000}); });
  const auto memory = events_named(read_json(dir.path() / "profile_0.json"), "[memory]");
  ASSERT_FALSE(memory.empty());
  EXPECT_EQ(memory[0].at("ph"), "i");
  EXPECT_EQ(memory[0].at("args").at("Bytes").get<int64_t>(), 4000);
}

TEST(Profile, WithStackAndWithModulesRecordTorchScriptFrames) {
  const auto unit = torch::jit::compile(R"JIT(
def inner(x):
    return torch.mm(x, x)

def outer(x):
    return inner(x) + 1
)JIT");
  TempDir dir;
  profile({.with_stack = true, .with_modules = true, .output_trace_dir = dir.str()}, 0,
          [&] { (void)unit->get_function("outer")({at::ones({4, 4})}); });
  const auto mm = events_named(read_json(dir.path() / "profile_0.json"), "aten::mm");
  ASSERT_EQ(mm.size(), 1u);
  EXPECT_THAT(mm[0].at("args").at("Call stack").get<std::string>(), HasSubstr("inner"));
  EXPECT_THAT(mm[0].at("args").at("Module Hierarchy").get<std::string>(), HasSubstr("outer"));
}

TEST(Profile, WithoutAnOutputFolderNothingIsWritten) {
  const auto before = fs::exists("profile_0.json");
  EXPECT_EQ(profile({}, 0, [] { return 5; }), 5);
  EXPECT_EQ(fs::exists("profile_0.json"), before);
}

TEST(Profile, MissingFoldersAreCreated) {
  TempDir dir;
  profile({.output_trace_dir = (dir.path() / "a" / "b").string()}, 1, [] { (void)matmuls(); });
  EXPECT_TRUE(fs::exists(dir.path() / "a" / "b" / "profile_1.json"));
}

TEST(Profile, AFailingCallWritesNoTraceAndStopsTheProfiler) {
  TempDir dir;
  const ProfileKwargs kwargs{.output_trace_dir = dir.str()};
  EXPECT_THROWS_WITH(profile(kwargs, 0, [] { throw std::runtime_error("loss is NaN"); }), "loss is NaN");
  EXPECT_FALSE(fs::exists(dir.path() / "profile_0.json"));
  profile(kwargs, 0, [] { (void)matmuls(); });  // not "already running"
  EXPECT_TRUE(fs::exists(dir.path() / "profile_0.json"));
}

TEST(Profile, OptionsItCannotHonourAreRefusedBeforeTheCallRuns) {
  int calls = 0;
  auto count = [&] { ++calls; };
  EXPECT_THROWS_WITH(profile({.schedule_option = {{"wait", 1}, {"active", 2}}}, 0, count),
                     "[profile] schedule_option is not supported");
  EXPECT_THROWS_WITH(profile({.activities = {"cpu", "xpu"}}, 0, count),
                     "[profile] invalid profiler activity \"xpu\"; expected one of \"cpu\", \"cuda\"");
  EXPECT_THROWS_WITH(profile({}, -1, count), "[profile] process_index must not be negative, got -1");
  if (!is_cuda_available()) {
    EXPECT_THROWS_WITH(profile({.activities = {"cuda"}}, 0, count),
                       "[profile] activity \"cuda\" needs CUDA, which this process does not have");
  }
  EXPECT_EQ(calls, 0);
}

TEST(Profile, ProfilesDoNotNest) {
  profile({.activities = {"cpu"}}, 0, [] {
    EXPECT_THROWS_WITH(profile({}, 0, [] {}), "[profile] a profiler is already running on this thread");
  });
}

TEST(Profile, EachRankAsAThreadWritesItsOwnTrace) {
  TempDir dir;
  std::vector<float> results(2);
  run_ranks(2, [&](const PartialState& state) {
    results[state.process_index()] = profile(state, {.output_trace_dir = dir.str()}, matmuls);
    // A trace exists for every rank once profile returns: it waits for everyone after writing.
    EXPECT_TRUE(fs::exists(dir.path() / "profile_0.json"));
    EXPECT_TRUE(fs::exists(dir.path() / "profile_1.json"));
    profile(state, {}, [] {});
  });
  EXPECT_EQ(results[0], results[1]);
  for (const char* name : {"profile_0.json", "profile_1.json"}) {
    EXPECT_EQ(events_named(read_json(dir.path() / name), "aten::mm").size(), 2u) << name;
  }
}

TEST(ProfileKwargsToKwargs, GivesTheFieldsThatDifferFromTheDefaults) {
  EXPECT_EQ(ProfileKwargs{}.to_kwargs(), nlohmann::ordered_json::object());
  const auto kwargs = ProfileKwargs{.activities = {"cpu"}, .with_flops = true, .output_trace_dir = "traces"}.to_kwargs();
  EXPECT_EQ(kwargs.dump(), R"({"activities":["cpu"],"with_flops":true,"output_trace_dir":"traces"})");
}

}  // namespace
}  // namespace accelerate::testing
