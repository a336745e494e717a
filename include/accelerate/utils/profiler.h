// Profiling a piece of code with LibTorch's profiler (upstream: `ProfileKwargs` in
// accelerate/utils/dataclasses.py and `Accelerator.profile`). `profile` runs a function under the
// profiler; a function that takes an `accelerate::Profiler&` gets the profiler, whose `step()` it
// calls after each step of its loop, as upstream's `prof.step()`. Without `schedule_option` the
// whole call is recorded and, when `output_trace_dir` is set, written as the Chrome trace
// `profile_<process index>.json` (open it in chrome://tracing or Perfetto). With a schedule, only
// its active windows are recorded, and each finished window goes to `on_trace_ready` (by default,
// with `output_trace_dir`, `tensorboard_trace_handler(output_trace_dir)`). Traces are written by
// this library from the profiler's events, so they work with LibTorch builds without Kineto
// (Debian's), whose own trace export is missing. Left out: the rest of torch.profiler's profile
// object (`key_averages`, `export_stacks`; a handler gets the window's events instead) and the
// "ProfilerStep#N" range it records around each step.
//
// LibTorch's profiler is per thread: it records the operators that the calling thread runs, so
// ranks running as threads each profile their own work.
//
// Example:
//   accelerate::ProfileKwargs kwargs{.record_shapes = true, .output_trace_dir = "traces"};
//   auto loss = accelerate::profile(state, kwargs, [&] { return train_step(batch); });
//
//   accelerate::ProfileKwargs scheduled{.schedule_option = {{"wait", 1}, {"warmup", 1}, {"active", 2}},
//                                       .on_trace_ready = accelerate::tensorboard_trace_handler("runs/prof")};
//   accelerate::profile(state, scheduled, [&](accelerate::Profiler& prof) {
//     for (int step = 0; step < 8; ++step) {
//       (void)train_step(batch);
//       prof.step();
//     }
//   });
#pragma once

#include "accelerate/state.h"
#include "accelerate/utils/dataclasses.h"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace accelerate {

/// One finished recording window of the profiler, handed to `ProfileKwargs::on_trace_ready`
/// (upstream hands over the profiler itself).
struct ProfilerTrace {
  /// The first step recorded (`Profiler::step_num()` when recording started).
  int64_t first_step = 0;
  /// `Profiler::step_num()` when the window ended: one past its last recorded step, the value
  /// PyTorch's `prof.step_num` has inside `on_trace_ready`.
  int64_t end_step = 0;
  /// The process index that `profile` was given.
  int process_index = 0;
  /// The window as a Chrome trace: {"schemaVersion", "displayTimeUnit", "traceEvents": [...]},
  /// one event per operator (and per allocation with `profile_memory`), in the format of
  /// `profile_<process index>.json`.
  nlohmann::json trace{};

  /// Writes `trace` to `path` (its folder created if missing), naming it there as "traceName"
  /// (upstream: `prof.export_chrome_trace(path)`).
  void export_chrome_trace(const std::string& path) const;
};

/// What `on_trace_ready` is: called on the profiling thread with each finished window.
using TraceHandler = std::function<void(const ProfilerTrace&)>;

/// How `profile` records (upstream: `ProfileKwargs`, torch.profiler.profile's arguments).
struct ProfileKwargs {
  /// Activity groups to record: "cpu" (operators) and "cuda" (needs CUDA; kernels appear when
  /// LibTorch was built with Kineto, as the official CUDA builds are). Empty: "cpu", plus
  /// "cuda" when CUDA is available, like torch.profiler's default.
  std::vector<std::string> activities{};
  /// The step schedule of torch.profiler.schedule, which `Profiler::step()` advances: the first
  /// "skip_first" steps are skipped, then each cycle waits "wait" steps, warms up for "warmup"
  /// (the profiler prepared, nothing recorded) and records "active" steps, the window handed to
  /// `on_trace_ready` after its last; after "repeat" cycles (0: no limit) nothing more is recorded.
  /// Missing keys are 0; "active" must be at least 1. Empty: the whole call is one window.
  /// Needs a function taking `Profiler&` (one that can call `step()`).
  std::map<std::string, int> schedule_option{};
  /// Called with each finished window: at the end of each active window of the schedule, and for
  /// the window open when the function returns if one of its steps ended (without a schedule, the
  /// whole call). Empty with a schedule and `output_trace_dir`: `tensorboard_trace_handler(output_trace_dir)`.
  TraceHandler on_trace_ready{};
  /// Record each operator's input shapes and dtypes ("Input Dims", "Input type").
  bool record_shapes = false;
  /// Record tensor allocations and frees ("[memory]" instant events with their byte counts).
  bool profile_memory = false;
  /// Record the source frames of each operator ("Call stack"). LibTorch keeps frames for
  /// TorchScript code only; operators called from C++ directly have none.
  bool with_stack = false;
  /// Estimate the floating-point operations of matrix products and convolutions ("flops").
  bool with_flops = false;
  /// Record the module hierarchy of each operator ("Module Hierarchy"); TorchScript modules only.
  bool with_modules = false;
  /// Folder for the traces (created if missing); empty writes none. Without a schedule it gets
  /// `profile_<process index>.json`; with one and no `on_trace_ready`, TensorBoard's layout (see
  /// `tensorboard_trace_handler`).
  std::string output_trace_dir{};

  /// The fields by name, in declaration order; `on_trace_ready` is "<function>" when set, else null.
  nlohmann::ordered_json to_dict() const;
  /// The fields that differ from the defaults (see `KwargsHandler`).
  nlohmann::ordered_json to_kwargs() const;
};

/// A handler for `on_trace_ready` that writes each window as
/// `<dir_name>/plugins/profile/<run_name>/<worker_name>.<end_step>.pt.trace.json`, the layout
/// TensorBoard's profile plugin opens (PyTorch's `torch.profiler.tensorboard_trace_handler`).
/// `worker_name` defaults to `<host>_<pid>`; `run_name` defaults to the time the handler is made,
/// "YYYY_MM_DD_HH_MM_SS" in UTC. Processes that make their own handler can start in different
/// seconds; give them one `run_name` to see them as one run.
TraceHandler tensorboard_trace_handler(const std::string& dir_name, const std::string& worker_name = "",
                                       const std::string& run_name = "");

namespace detail {
class ProfileRun;
}  // namespace detail

/// The running profiler of one `profile` call, which the profiled function takes by reference
/// (upstream: the `torch.profiler.profile` that `Accelerator.profile` yields). Lives on the thread
/// that called `profile` and must be stepped there.
class Profiler {
 public:
  ~Profiler() noexcept;
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;
  Profiler(Profiler&&) = delete;
  Profiler& operator=(Profiler&&) = delete;

  /// Ends the current step: the schedule moves on to the next one, starting or stopping the
  /// recording and handing a finished window to `on_trace_ready` where it says so.
  void step();
  /// The steps ended so far (upstream: `prof.step_num`).
  int64_t step_num() const { return step_num_; }

 private:
  friend class detail::ProfileRun;
  struct Impl;
  enum class Action { kNone, kWarmup, kRecord, kRecordAndSave };

  Profiler(const ProfileKwargs& kwargs, int process_index, bool takes_profiler);
  void finish();
  void move_to(Action next);

  std::unique_ptr<Impl> impl_;
  int64_t step_num_ = 0;
  Action action_ = Action::kNone;
  std::thread::id thread_;
};

namespace detail {
/// One `profile` call on the calling thread: the constructor checks the kwargs and starts the
/// profiler, `finish` stops it and hands over the last window; destroyed unfinished (the profiled
/// code threw), it stops without writing.
class ProfileRun {
 public:
  ProfileRun(const ProfileKwargs& kwargs, int process_index, bool takes_profiler)
      : profiler_(kwargs, process_index, takes_profiler) {}
  Profiler& profiler() { return profiler_; }
  void finish() { profiler_.finish(); }

 private:
  Profiler profiler_;
};

/// Calls `fn(profiler)` when `fn` takes the profiler, else `fn()`.
template <typename Fn>
decltype(auto) invoke_profiled(Fn&& fn, Profiler& profiler) {
  if constexpr (std::is_invocable_v<Fn, Profiler&>) {
    return std::invoke(std::forward<Fn>(fn), profiler);
  } else {
    return std::invoke(std::forward<Fn>(fn));
  }
}
template <typename Fn>
using profiled_result_t = decltype(invoke_profiled(std::declval<Fn>(), std::declval<Profiler&>()));
}  // namespace detail

/// Runs `fn(profiler)` (or `fn()`) under LibTorch's profiler configured by `kwargs` and returns
/// its result. Without a schedule, when `kwargs.output_trace_dir` is set and `fn` succeeds, writes
/// the Chrome trace `<output_trace_dir>/profile_<process_index>.json` (upstream's file name); with
/// one, the windows go to `on_trace_ready`. When `fn` throws, the profiler stops, nothing is
/// written and the exception propagates. Options this profiler cannot honour (an invalid schedule,
/// or one for a function without the profiler, unknown activities, "cuda" without CUDA) are
/// refused before `fn` runs, and so is profiling inside a profiled call (profiles do not nest).
template <typename Fn>
decltype(auto) profile(const ProfileKwargs& kwargs, int process_index, Fn&& fn) {
  detail::ProfileRun run(kwargs, process_index, /*takes_profiler=*/std::is_invocable_v<Fn, Profiler&>);
  if constexpr (std::is_void_v<detail::profiled_result_t<Fn>>) {
    detail::invoke_profiled(std::forward<Fn>(fn), run.profiler());
    run.finish();
  } else {
    decltype(auto) result = detail::invoke_profiled(std::forward<Fn>(fn), run.profiler());
    run.finish();
    return result;
  }
}

/// `profile` named by the process index of `state`; after writing traces (`output_trace_dir`
/// set), waits for every process, as upstream's `Accelerator.profile` does (so every process must
/// call it).
template <typename Fn>
decltype(auto) profile(const PartialState& state, const ProfileKwargs& kwargs, Fn&& fn) {
  if constexpr (std::is_void_v<detail::profiled_result_t<Fn>>) {
    profile(kwargs, state.process_index(), std::forward<Fn>(fn));
    if (!kwargs.output_trace_dir.empty()) state.wait_for_everyone();
  } else {
    decltype(auto) result = profile(kwargs, state.process_index(), std::forward<Fn>(fn));
    if (!kwargs.output_trace_dir.empty()) state.wait_for_everyone();
    return result;
  }
}

}  // namespace accelerate
