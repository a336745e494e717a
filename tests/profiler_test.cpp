// Profiling with LibTorch's profiler and the Chrome traces it leaves (upstream: the profiler
// tests of test_accelerator.py).
#include "accelerate/utils/profiler.h"
#include "accelerate/accelerator.h"
#include "accelerate/utils/environment.h"
#include "support/accelerators.h"
#include "support/test_support.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/jit.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
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
                     "[profile] schedule_option needs a function that takes the profiler (accelerate::Profiler&)");
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

TEST(ProfileKwargsToKwargs, NamesASetTraceHandlerWithoutCallingIt) {
  EXPECT_EQ(ProfileKwargs{}.to_dict().at("on_trace_ready"), nullptr);
  const auto kwargs = ProfileKwargs{.schedule_option = {{"active", 1}},
                                    .on_trace_ready = [](const ProfilerTrace&) { FAIL(); }}.to_kwargs();
  EXPECT_EQ(kwargs.dump(), R"({"schedule_option":{"active":1},"on_trace_ready":"<function>"})");
}

// A step whose operators tell it apart in a trace: a sum over `step + 1` ones, whose input shape
// ("Input Dims", with `record_shapes`) is [step + 1].
void distinct_step(int64_t step) { (void)at::ones({step + 1}).sum(); }

// The steps whose `distinct_step` operators a trace holds (from its "aten::sum" events).
std::set<int64_t> steps_in(const nlohmann::json& trace) {
  std::set<int64_t> steps;
  for (const auto& sum : events_named(trace, "aten::sum")) {
    steps.insert(sum.at("args").at("Input Dims").at(0).at(0).get<int64_t>() - 1);
  }
  return steps;
}

// wait 1, warm-up 1, active 2, two cycles, after skipping 1: steps 0 and 1 wait, 2 warms up,
// 3 and 4 are recorded; 5 waits, 6 warms up, 7 and 8 are recorded; 9 and later are not.
const std::map<std::string, int> kTwoWindows = {
    {"wait", 1}, {"warmup", 1}, {"active", 2}, {"repeat", 2}, {"skip_first", 1}};

void run_ten_steps(Profiler& prof) {
  for (int64_t step = 0; step < 10; ++step) {
    EXPECT_EQ(prof.step_num(), step);
    distinct_step(step);
    prof.step();
  }
}

TEST(ProfileSchedule, HandsOverEachActiveWindowHoldingExactlyTheOperatorsOfItsSteps) {
  std::vector<ProfilerTrace> windows;
  const ProfileKwargs kwargs{.schedule_option = kTwoWindows,
                             .on_trace_ready = [&](const ProfilerTrace& window) { windows.push_back(window); },
                             .record_shapes = true};
  int64_t steps = -1;
  profile(kwargs, /*process_index=*/2, [&](Profiler& prof) {
    run_ten_steps(prof);
    steps = prof.step_num();
  });
  EXPECT_EQ(steps, 10);
  ASSERT_EQ(windows.size(), 2u);
  EXPECT_EQ(windows[0].first_step, 3);
  EXPECT_EQ(windows[0].end_step, 5);
  EXPECT_EQ(windows[1].first_step, 7);
  EXPECT_EQ(windows[1].end_step, 9);
  EXPECT_EQ(steps_in(windows[0].trace), (std::set<int64_t>{3, 4}));
  EXPECT_EQ(steps_in(windows[1].trace), (std::set<int64_t>{7, 8}));
  for (const auto& window : windows) {
    EXPECT_EQ(window.process_index, 2);
    EXPECT_EQ(events_named(window.trace, "aten::ones").size(), 2u);
  }
}

TEST(ProfileSchedule, WithoutRepeatTheCyclesGoOnAndBackToBackWindowsAreSeparate) {
  std::vector<std::pair<int64_t, std::set<int64_t>>> windows;
  const ProfileKwargs kwargs{.schedule_option = {{"active", 1}},
                             .on_trace_ready = [&](const ProfilerTrace& w) { windows.emplace_back(w.end_step, steps_in(w.trace)); },
                             .record_shapes = true};
  profile(kwargs, 0, [](Profiler& prof) {
    for (int64_t step = 0; step < 3; ++step) {
      distinct_step(step);
      prof.step();
    }
  });
  ASSERT_EQ(windows.size(), 3u);
  for (int64_t step = 0; step < 3; ++step) {
    EXPECT_EQ(windows[step].first, step + 1);
    EXPECT_EQ(windows[step].second, std::set<int64_t>{step});
  }
}

TEST(ProfileSchedule, TheWindowOpenWhenTheFunctionReturnsIsHandedOver) {
  std::vector<ProfilerTrace> windows;
  const ProfileKwargs kwargs{.schedule_option = {{"wait", 1}, {"active", 5}},
                             .on_trace_ready = [&](const ProfilerTrace& window) { windows.push_back(window); },
                             .record_shapes = true};
  profile(kwargs, 0, [](Profiler& prof) {
    for (int64_t step = 0; step < 3; ++step) {
      distinct_step(step);
      prof.step();
    }
  });
  ASSERT_EQ(windows.size(), 1u);
  EXPECT_EQ(windows[0].first_step, 1);
  EXPECT_EQ(windows[0].end_step, 3);
  EXPECT_EQ(steps_in(windows[0].trace), (std::set<int64_t>{1, 2}));
}

TEST(ProfileSchedule, AFailingCallHandsNothingOverAndStopsTheProfiler) {
  int windows = 0;
  const ProfileKwargs kwargs{.schedule_option = {{"active", 3}},
                             .on_trace_ready = [&](const ProfilerTrace&) { ++windows; }};
  EXPECT_THROWS_WITH(profile(kwargs, 0, [](Profiler& prof) {
    prof.step();
    throw std::runtime_error("loss is NaN");
  }), "loss is NaN");
  EXPECT_EQ(windows, 0);
  profile(kwargs, 0, [](Profiler& prof) { prof.step(); });  // not "already running"
  EXPECT_EQ(windows, 1);
}

TEST(ProfileSchedule, ProfilesDoNotNestEvenBetweenWindows) {
  profile({.schedule_option = {{"wait", 5}, {"active", 1}}}, 0, [](Profiler& prof) {
    prof.step();  // waiting: LibTorch's profiler is off
    EXPECT_THROWS_WITH(profile({}, 0, [] {}), "[profile] a profiler is already running on this thread");
  });
}

TEST(ProfileSchedule, InvalidSchedulesAreRefusedNamingTheKey) {
  int calls = 0;
  auto count = [&](Profiler&) { ++calls; };
  EXPECT_THROWS_WITH(profile({.schedule_option = {{"active", 1}, {"warmpu", 1}}}, 0, count),
                     "[profile] unknown schedule_option key \"warmpu\"; expected \"wait\", \"warmup\", \"active\", "
                     "\"repeat\" or \"skip_first\"");
  for (const char* key : {"wait", "warmup", "repeat", "skip_first"}) {
    EXPECT_THROWS_WITH(profile({.schedule_option = {{"active", 1}, {key, -1}}}, 0, count),
                       std::string("[profile] schedule_option \"") + key + "\" must not be negative, got -1");
  }
  EXPECT_THROWS_WITH(profile({.schedule_option = {{"active", 0}}}, 0, count),
                     "[profile] schedule_option \"active\" must be at least 1, got 0");
  EXPECT_THROWS_WITH(profile({.schedule_option = {{"wait", 1}, {"warmup", 1}}}, 0, count),
                     "[profile] schedule_option \"active\" must be at least 1, got 0");
  EXPECT_EQ(calls, 0);
}

TEST(ProfileSchedule, WithoutAScheduleTheWholeCallIsOneWindowAndTheTraceIsWrittenAsBefore) {
  TempDir dir;
  std::vector<ProfilerTrace> windows;
  const ProfileKwargs kwargs{.on_trace_ready = [&](const ProfilerTrace& window) { windows.push_back(window); },
                             .record_shapes = true,
                             .output_trace_dir = dir.str()};
  profile(kwargs, 1, [](Profiler& prof) {
    for (int64_t step = 0; step < 4; ++step) {
      distinct_step(step);
      prof.step();
    }
  });
  ASSERT_EQ(windows.size(), 1u);
  EXPECT_EQ(windows[0].first_step, 0);
  EXPECT_EQ(windows[0].end_step, 4);
  EXPECT_EQ(steps_in(windows[0].trace), (std::set<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(steps_in(read_json(dir.path() / "profile_1.json")), (std::set<int64_t>{0, 1, 2, 3}));
  EXPECT_FALSE(fs::exists(dir.path() / "plugins"));
}

std::string host_and_pid() {
  char host[256] = {};
  EXPECT_EQ(::gethostname(host, sizeof(host) - 1), 0);
  return std::string(host) + "_" + std::to_string(::getpid());
}

// The names of the entries of `folder`.
std::set<std::string> names_in(const fs::path& folder) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(folder)) names.insert(entry.path().filename().string());
  return names;
}

TEST(TensorboardTraceHandler, WritesEachWindowWhereTensorBoardsProfilePluginLooks) {
  TempDir dir;
  profile({.schedule_option = kTwoWindows,
           .on_trace_ready = tensorboard_trace_handler(dir.str(), "", "run1"),
           .record_shapes = true},
          0, run_ten_steps);
  const auto run = dir.path() / "plugins" / "profile" / "run1";
  const auto worker = host_and_pid();
  EXPECT_EQ(names_in(run), (std::set<std::string>{worker + ".5.pt.trace.json", worker + ".9.pt.trace.json"}));
  EXPECT_EQ(steps_in(read_json(run / (worker + ".5.pt.trace.json"))), (std::set<int64_t>{3, 4}));
  EXPECT_EQ(steps_in(read_json(run / (worker + ".9.pt.trace.json"))), (std::set<int64_t>{7, 8}));
}

TEST(TensorboardTraceHandler, AnOutputFolderWithoutAHandlerGetsOneTimestampedRun) {
  TempDir dir;
  profile({.schedule_option = kTwoWindows, .record_shapes = true, .output_trace_dir = dir.str()}, 0, run_ten_steps);
  EXPECT_EQ(names_in(dir.path()), std::set<std::string>{"plugins"});  // no profile_0.json
  const auto runs = names_in(dir.path() / "plugins" / "profile");
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_TRUE(std::regex_match(*runs.begin(), std::regex(R"(\d{4}_\d{2}_\d{2}_\d{2}_\d{2}_\d{2})"))) << *runs.begin();
  const auto run = dir.path() / "plugins" / "profile" / *runs.begin();
  EXPECT_EQ(steps_in(read_json(run / (host_and_pid() + ".9.pt.trace.json"))), (std::set<int64_t>{7, 8}));
}

TEST(TensorboardTraceHandler, TakesAWorkerName) {
  TempDir dir;
  profile({.schedule_option = {{"active", 2}}, .on_trace_ready = tensorboard_trace_handler(dir.str(), "rank0", "r")}, 0,
          [](Profiler& prof) {
            distinct_step(0);
            prof.step();
          });
  EXPECT_EQ(names_in(dir.path() / "plugins" / "profile" / "r"), std::set<std::string>{"rank0.1.pt.trace.json"});
  EXPECT_THROWS_WITH(tensorboard_trace_handler(""), "[tensorboard_trace_handler] dir_name must not be empty");
}

TEST(ProfileSchedule, EachRankAsAThreadStepsItsOwnProfiler) {
  std::vector<std::vector<int64_t>> ends(2);
  run_ranks(2, [&](const PartialState& state) {
    const ProfileKwargs kwargs{.schedule_option = {{"wait", 1}, {"active", 1}},
                               .on_trace_ready = [&](const ProfilerTrace& w) { ends[w.process_index].push_back(w.end_step); }};
    profile(state, kwargs, [](Profiler& prof) {
      for (int step = 0; step < 4; ++step) prof.step();
    });
  });
  for (const auto& rank : ends) EXPECT_EQ(rank, (std::vector<int64_t>{2, 4}));
}

TEST(ProfileSchedule, AcceleratorProfilePassesTheProfiler) {
  AcceleratorOptions options;
  options.profile_kwargs.schedule_option = {{"active", 2}};
  std::vector<int64_t> ends;
  options.profile_kwargs.on_trace_ready = [&](const ProfilerTrace& window) { ends.push_back(window.end_step); };
  run_accelerators(1, [](const Accelerator& acc, int) {
    const auto steps = acc.profile([](Profiler& prof) {
      for (int step = 0; step < 3; ++step) prof.step();
      return prof.step_num();
    });
    EXPECT_EQ(steps, 3);
  }, options);
  EXPECT_EQ(ends, (std::vector<int64_t>{2, 3}));
}

}  // namespace
}  // namespace accelerate::testing
