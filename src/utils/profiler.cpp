// Profiling with LibTorch's profiler; see include/accelerate/utils/profiler.h.
#include "accelerate/utils/profiler.h"

#include "accelerate/utils/environment.h"
#include "detail/text.h"
#include "detail/torch_compat.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>

namespace accelerate {
namespace {

namespace prof = torch::autograd::profiler;

constexpr const char* kApi = "profile";

std::set<prof::ActivityType> parse_activities(const std::vector<std::string>& names) {
  std::set<prof::ActivityType> activities;
  if (names.empty()) {
    activities.insert(prof::ActivityType::CPU);
    if (is_cuda_available()) activities.insert(prof::ActivityType::CUDA);
    return activities;
  }
  for (const auto& name : names) {
    if (name == "cpu") {
      activities.insert(prof::ActivityType::CPU);
    } else if (name == "cuda") {
      TORCH_CHECK(is_cuda_available(), "[", kApi, "] activity \"cuda\" needs CUDA, which this process does not have");
      activities.insert(prof::ActivityType::CUDA);
    } else {
      C10_THROW_ERROR(ValueError, c10::str("[", kApi, "] invalid profiler activity \"", name,
                                           "\"; expected one of \"cpu\", \"cuda\""));
    }
  }
  return activities;
}

// One profiler event in the Chrome trace format, with the argument names Kineto's export uses.
nlohmann::json trace_event(const prof::KinetoEvent& event, int64_t pid) {
  nlohmann::json out = {{"name", event.name()}, {"pid", pid}, {"tid", event.startThreadId()}, {"ts", detail::compat::event_start_us(event)}};
  nlohmann::json args = nlohmann::json::object();
  if (event.name() == "[memory]") {
    out["ph"] = "i";
    out["s"] = "t";
    out["cat"] = "cpu_instant_event";
    args["Device Type"] = static_cast<int>(event.deviceType());
    args["Device Id"] = static_cast<int>(event.deviceIndex());
    args["Bytes"] = event.nBytes();
  } else {
    out["ph"] = "X";
    out["dur"] = detail::compat::event_duration_us(event);
    out["cat"] = event.deviceType() == c10::kCPU ? "cpu_op" : "kernel";
    args["External id"] = event.correlationId();
    if (event.sequenceNr() >= 0) args["Sequence number"] = event.sequenceNr();
    if (event.hasShapes()) args["Input Dims"] = event.shapes().vec();
    if (event.hasTypes()) args["Input type"] = event.dtypes().vec();
    if (event.flops() > 0) args["flops"] = event.flops();
    if (event.hasStack() && !event.stack().empty()) args["Call stack"] = detail::join(event.stack(), ";");
    if (event.hasModuleHierarchy() && !event.moduleHierarchy().empty()) {
      args["Module Hierarchy"] = detail::join(event.moduleHierarchy(), ".");
    }
  }
  out["args"] = std::move(args);
  return out;
}

void write_trace(const prof::ProfilerResult& result, const std::string& folder, int process_index) {
  std::error_code error;
  std::filesystem::create_directories(folder, error);
  TORCH_CHECK(!error, "[", kApi, "] could not create the trace folder ", folder, ": ", error.message());
  const auto path = std::filesystem::path(folder) / ("profile_" + std::to_string(process_index) + ".json");

  const int64_t pid = ::getpid();
  nlohmann::json events = nlohmann::json::array();
  for (const auto& event : result.events()) events.push_back(trace_event(event, pid));
  const nlohmann::json trace = {{"schemaVersion", 1},
                                {"displayTimeUnit", "ms"},
                                {"traceName", path.string()},
                                {"traceEvents", std::move(events)}};
  std::ofstream out(path);
  out << trace.dump() << '\n';
  out.close();
  TORCH_CHECK(out.good(), "[", kApi, "] could not write the trace to ", path.string());
}

}  // namespace

nlohmann::ordered_json ProfileKwargs::to_dict() const {
  return {{"activities", activities},       {"schedule_option", schedule_option},
          {"record_shapes", record_shapes}, {"profile_memory", profile_memory},
          {"with_stack", with_stack},       {"with_flops", with_flops},
          {"with_modules", with_modules},   {"output_trace_dir", output_trace_dir}};
}
nlohmann::ordered_json ProfileKwargs::to_kwargs() const {
  return detail::changed_fields(to_dict(), ProfileKwargs{}.to_dict());
}
static_assert(KwargsHandler<ProfileKwargs>);

namespace detail {

// Note [One profile per process]
// LibTorch's profiler keeps one state per process; from 2.x (Kineto) two threads profiling at
// once crash inside it. Threads of one process (ranks as threads) therefore take turns, with a
// bounded wait so that a profiled call blocked on another thread fails instead of hanging.
std::timed_mutex& profile_turn() {
  static std::timed_mutex turn;
  return turn;
}
constexpr auto kProfileTurnWait = std::chrono::seconds(60);

ProfileRun::ProfileRun(const ProfileKwargs& kwargs, int process_index) : kwargs_(kwargs), process_index_(process_index) {
  TORCH_CHECK_VALUE(process_index >= 0, "[", kApi, "] process_index must not be negative, got ", process_index);
  TORCH_CHECK_VALUE(kwargs.schedule_option.empty(), "[", kApi, "] schedule_option is not supported: the profiler "
                    "records the whole call; profile only the steps you want instead");
  const auto activities = parse_activities(kwargs.activities);
  TORCH_CHECK(!torch::profiler::impl::profilerEnabled(), "[", kApi,
              "] a profiler is already running on this thread; profiles do not nest");
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO, kwargs.record_shapes,
                                                     kwargs.profile_memory, kwargs.with_stack, kwargs.with_flops,
                                                     kwargs.with_modules);
  TORCH_CHECK(profile_turn().try_lock_for(kProfileTurnWait), "[", kApi, "] another thread of this process has been profiling for ",
              kProfileTurnWait.count(), " s; LibTorch's profiler is process-wide, so threads profile one at a time");
  try {
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
  } catch (...) {
    profile_turn().unlock();
    throw;
  }
  running_ = true;
}

ProfileRun::~ProfileRun() noexcept {
  if (!running_) return;
  try {
    (void)prof::disableProfiler();
  } catch (...) {  // NOLINT(bugprone-empty-catch): already unwinding from the profiled code's error
  }
  profile_turn().unlock();
}

void ProfileRun::finish() {
  running_ = false;
  std::unique_lock<std::timed_mutex> turn(profile_turn(), std::adopt_lock);  // released on every path
  const auto result = prof::disableProfiler();
  turn.unlock();
  if (!kwargs_.output_trace_dir.empty()) write_trace(*result, kwargs_.output_trace_dir, process_index_);
}

}  // namespace detail
}  // namespace accelerate
