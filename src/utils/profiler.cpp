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
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

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

nlohmann::json chrome_trace(const prof::ProfilerResult& result) {
  const int64_t pid = ::getpid();
  nlohmann::json events = nlohmann::json::array();
  for (const auto& event : result.events()) events.push_back(trace_event(event, pid));
  return {{"schemaVersion", 1}, {"displayTimeUnit", "ms"}, {"traceEvents", std::move(events)}};
}

void write_trace(nlohmann::json trace, const std::filesystem::path& path) {
  if (path.has_parent_path()) {
    std::error_code error;
    std::filesystem::create_directories(path.parent_path(), error);
    TORCH_CHECK(!error, "[", kApi, "] could not create the trace folder ", path.parent_path().string(), ": ",
                error.message());
  }
  trace["traceName"] = path.string();
  std::ofstream out(path);
  out << trace.dump() << '\n';
  out.close();
  TORCH_CHECK(out.good(), "[", kApi, "] could not write the trace to ", path.string());
}

std::string trace_hostname() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

std::string trace_run_timestamp() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  ::gmtime_r(&now, &utc);
  char text[32] = {};
  std::strftime(text, sizeof text, "%Y_%m_%d_%H_%M_%S", &utc);
  return text;
}

// torch.profiler.schedule's numbers, checked once.
struct ProfileSchedule {
  bool set = false;
  int wait = 0;
  int warmup = 0;
  int active = 0;
  int repeat = 0;
  int skip_first = 0;
};

ProfileSchedule parse_profile_schedule(const std::map<std::string, int>& option) {
  ProfileSchedule schedule;
  if (option.empty()) return schedule;
  schedule.set = true;
  for (const auto& [key, value] : option) {
    int* field = key == "wait"         ? &schedule.wait
                 : key == "warmup"     ? &schedule.warmup
                 : key == "active"     ? &schedule.active
                 : key == "repeat"     ? &schedule.repeat
                 : key == "skip_first" ? &schedule.skip_first
                                       : nullptr;
    TORCH_CHECK_VALUE(field != nullptr, "[", kApi, "] unknown schedule_option key \"", key,
                      "\"; expected \"wait\", \"warmup\", \"active\", \"repeat\" or \"skip_first\"");
    TORCH_CHECK_VALUE(value >= 0, "[", kApi, "] schedule_option \"", key, "\" must not be negative, got ", value);
    *field = value;
  }
  TORCH_CHECK_VALUE(schedule.active >= 1, "[", kApi, "] schedule_option \"active\" must be at least 1, got ",
                    schedule.active);
  return schedule;
}

}  // namespace

nlohmann::ordered_json ProfileKwargs::to_dict() const {
  return {{"activities", activities},
          {"schedule_option", schedule_option},
          {"on_trace_ready", on_trace_ready ? nlohmann::ordered_json("<function>") : nlohmann::ordered_json(nullptr)},
          {"record_shapes", record_shapes},
          {"profile_memory", profile_memory},
          {"with_stack", with_stack},
          {"with_flops", with_flops},
          {"with_modules", with_modules},
          {"output_trace_dir", output_trace_dir}};
}
nlohmann::ordered_json ProfileKwargs::to_kwargs() const {
  return detail::changed_fields(to_dict(), ProfileKwargs{}.to_dict());
}
static_assert(KwargsHandler<ProfileKwargs>);

void ProfilerTrace::export_chrome_trace(const std::string& path) const { write_trace(trace, path); }

TraceHandler tensorboard_trace_handler(const std::string& dir_name, const std::string& worker_name,
                                       const std::string& run_name) {
  TORCH_CHECK_VALUE(!dir_name.empty(), "[tensorboard_trace_handler] dir_name must not be empty");
  const auto folder = std::filesystem::path(dir_name) / "plugins" / "profile" /
                      (run_name.empty() ? trace_run_timestamp() : run_name);
  const auto worker = worker_name.empty() ? trace_hostname() + "_" + std::to_string(::getpid()) : worker_name;
  return [folder, worker](const ProfilerTrace& window) {
    window.export_chrome_trace((folder / (worker + "." + std::to_string(window.end_step) + ".pt.trace.json")).string());
  };
}

namespace {

// Note [One profile per process]
// LibTorch's profiler keeps one state per process; from 2.x (Kineto) two threads profiling at
// once crash inside it. Threads of one process (ranks as threads) therefore take turns, with a
// bounded wait so that a profiled call blocked on another thread fails instead of hanging. A
// thread keeps its turn for its whole `profile` call, also between the windows of a schedule.
std::timed_mutex& profile_turn() {
  static std::timed_mutex turn;
  return turn;
}
constexpr auto kProfileTurnWait = std::chrono::seconds(60);

// Whether this thread is inside a `profile` call: between a schedule's windows LibTorch's
// profiler is off, yet a nested `profile` would wait for this thread's own turn.
thread_local bool profiling_this_thread = false;

}  // namespace

struct Profiler::Impl {
  Impl(const ProfileKwargs& kwargs, int process_index, ProfileSchedule schedule, std::set<prof::ActivityType> activities)
      : kwargs(kwargs),
        process_index(process_index),
        schedule(schedule),
        activities(std::move(activities)),
        config(torch::profiler::impl::ProfilerState::KINETO, kwargs.record_shapes, kwargs.profile_memory,
               kwargs.with_stack, kwargs.with_flops, kwargs.with_modules) {}

  // torch.profiler.schedule: what to do during step `step`.
  Action action_at(int64_t step) const {
    if (!schedule.set) return Action::kRecord;
    if (step < schedule.skip_first) return Action::kNone;
    step -= schedule.skip_first;
    const int64_t cycle = int64_t{schedule.wait} + schedule.warmup + schedule.active;
    if (schedule.repeat > 0 && step / cycle >= schedule.repeat) return Action::kNone;
    const int64_t at = step % cycle;
    if (at < schedule.wait) return Action::kNone;
    if (at < schedule.wait + schedule.warmup) return Action::kWarmup;
    return at < cycle - 1 ? Action::kRecord : Action::kRecordAndSave;
  }

  void prepare() {
    if (prepared) return;
    prof::prepareProfiler(config, activities);
    prepared = true;
  }
  void start(int64_t step) {
    prepare();
    prof::enableProfiler(config, activities);
    enabled = true;
    window_first = step;
  }
  std::unique_ptr<prof::ProfilerResult> stop() {
    prepared = enabled = false;
    return prof::disableProfiler();
  }
  // A warm-up that no window follows: the prepared profiler is started and stopped, as PyTorch
  // does, and what it saw dropped.
  void discard() {
    if (!prepared || enabled) return;
    prof::enableProfiler(config, activities);
    enabled = true;
    (void)stop();
  }
  void hand_over(const nlohmann::json& trace, int64_t end_step) const {
    if (handler) handler(ProfilerTrace{window_first, end_step, process_index, trace});
  }
  // Leaves this thread's `profile` call: gives the turn back.
  void leave() noexcept {
    if (!holds_turn) return;
    holds_turn = false;
    profiling_this_thread = false;
    profile_turn().unlock();
  }

  ProfileKwargs kwargs;
  int process_index;
  ProfileSchedule schedule;
  std::set<prof::ActivityType> activities;
  torch::profiler::impl::ProfilerConfig config;
  TraceHandler handler;
  bool holds_turn = false;
  bool prepared = false;  // prepareProfiler called (a warm-up), enableProfiler not yet
  bool enabled = false;
  int64_t window_first = 0;
};

Profiler::Profiler(const ProfileKwargs& kwargs, int process_index, bool takes_profiler)
    : thread_(std::this_thread::get_id()) {
  TORCH_CHECK_VALUE(process_index >= 0, "[", kApi, "] process_index must not be negative, got ", process_index);
  const ProfileSchedule schedule = parse_profile_schedule(kwargs.schedule_option);
  TORCH_CHECK_VALUE(!schedule.set || takes_profiler, "[", kApi, "] schedule_option needs a function that takes the "
                    "profiler (accelerate::Profiler&) and calls its step() after each step");
  auto activities = parse_activities(kwargs.activities);
  TORCH_CHECK(!profiling_this_thread && !torch::profiler::impl::profilerEnabled(), "[", kApi,
              "] a profiler is already running on this thread; profiles do not nest");
  impl_ = std::make_unique<Impl>(kwargs, process_index, schedule, std::move(activities));
  if (kwargs.on_trace_ready) {
    impl_->handler = kwargs.on_trace_ready;
  } else if (schedule.set && !kwargs.output_trace_dir.empty()) {
    impl_->handler = tensorboard_trace_handler(kwargs.output_trace_dir);
  }
  TORCH_CHECK(profile_turn().try_lock_for(kProfileTurnWait), "[", kApi, "] another thread of this process has been profiling for ",
              kProfileTurnWait.count(), " s; LibTorch's profiler is process-wide, so threads profile one at a time");
  impl_->holds_turn = true;
  profiling_this_thread = true;
  try {
    move_to(impl_->action_at(0));
  } catch (...) {
    impl_->leave();
    throw;
  }
}

Profiler::~Profiler() noexcept {
  if (!impl_) return;
  try {
    if (impl_->enabled) {
      (void)impl_->stop();
    } else {
      impl_->discard();
    }
  } catch (...) {  // NOLINT(bugprone-empty-catch): already unwinding from the profiled code's error
  }
  impl_->leave();
}

void Profiler::step() {
  TORCH_CHECK(std::this_thread::get_id() == thread_,
              "[Profiler::step] called from another thread than the one running profile; LibTorch's profiler "
              "records the thread that started it");
  ++step_num_;
  const Action next = impl_->action_at(step_num_);
  if (next != action_ || action_ == Action::kRecordAndSave) move_to(next);
}

void Profiler::move_to(Action next) {
  auto& impl = *impl_;
  const bool recording = action_ == Action::kRecord || action_ == Action::kRecordAndSave;
  const bool will_record = next == Action::kRecord || next == Action::kRecordAndSave;
  if (recording && (action_ == Action::kRecordAndSave || !will_record)) {
    // The window is handed over before the next one starts, so the handler's own work is not in
    // it; should the handler throw, the profiler is simply off.
    action_ = Action::kNone;
    const auto result = impl.stop();
    impl.hand_over(chrome_trace(*result), step_num_);
  } else if (action_ == Action::kWarmup && next == Action::kNone) {
    impl.discard();
  }
  if (next == Action::kWarmup) {
    impl.prepare();
  } else if (will_record && !impl.enabled) {
    impl.start(step_num_);
  }
  action_ = next;
}

void Profiler::finish() {
  auto& impl = *impl_;
  std::unique_ptr<prof::ProfilerResult> result;
  try {
    if (impl.enabled) {
      result = impl.stop();
    } else {
      impl.discard();
    }
  } catch (...) {
    impl.leave();
    throw;
  }
  action_ = Action::kNone;
  impl.leave();
  // A scheduled window that opened at the last step() holds no step; PyTorch hands it over anyway.
  if (!result || (impl.schedule.set && impl.window_first == step_num_)) return;
  const auto trace = chrome_trace(*result);
  if (!impl.schedule.set && !impl.kwargs.output_trace_dir.empty()) {
    write_trace(trace, std::filesystem::path(impl.kwargs.output_trace_dir) /
                           ("profile_" + std::to_string(impl.process_index) + ".json"));
  }
  impl.hand_over(trace, step_num_);
}

}  // namespace accelerate
