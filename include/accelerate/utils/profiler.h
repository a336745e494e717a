// Profiling a piece of code with LibTorch's profiler (upstream: `ProfileKwargs` in
// accelerate/utils/dataclasses.py and `Accelerator.profile`). `profile` runs a function under the
// profiler and, when `output_trace_dir` is set, writes the recorded operators as a Chrome trace
// `profile_<process index>.json` (open it in chrome://tracing or Perfetto). The trace is written
// by this library from the profiler's events, so it works with LibTorch builds without Kineto
// (Debian's), whose own trace export is missing. Left out: upstream's `schedule_option` (refused
// when set) and `on_trace_ready`, and the profiler object upstream yields; read the trace file
// instead.
//
// LibTorch's profiler is per thread: it records the operators that the calling thread runs, so
// ranks running as threads each profile their own work.
//
// Example:
//   accelerate::ProfileKwargs kwargs{.record_shapes = true, .output_trace_dir = "traces"};
//   auto loss = accelerate::profile(state, kwargs, [&] { return train_step(batch); });
#pragma once

#include "accelerate/state.h"
#include "accelerate/utils/dataclasses.h"

#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace accelerate {

/// How `profile` records (upstream: `ProfileKwargs`, torch.profiler.profile's arguments).
struct ProfileKwargs {
  /// Activity groups to record: "cpu" (operators) and "cuda" (needs CUDA; kernels appear when
  /// LibTorch was built with Kineto, as the official CUDA builds are). Empty: "cpu", plus
  /// "cuda" when CUDA is available, like torch.profiler's default.
  std::vector<std::string> activities{};
  /// Upstream's step schedule (wait, warmup, active, repeat, skip_first). Not supported: `profile`
  /// records the whole call, and a non-empty schedule is refused.
  std::map<std::string, int> schedule_option{};
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
  /// Folder for the Chrome trace (created if missing); empty writes no trace.
  std::string output_trace_dir{};

  /// The fields by name, in declaration order.
  nlohmann::ordered_json to_dict() const;
  /// The fields that differ from the defaults (see `KwargsHandler`).
  nlohmann::ordered_json to_kwargs() const;
};

namespace detail {
/// One run of the profiler on the calling thread: the constructor checks `kwargs` and starts it,
/// `finish` stops it and writes the trace; destroyed unfinished (the profiled code threw), it
/// stops without writing.
class ProfileRun {
 public:
  ProfileRun(const ProfileKwargs& kwargs, int process_index);
  ~ProfileRun() noexcept;
  ProfileRun(const ProfileRun&) = delete;
  ProfileRun& operator=(const ProfileRun&) = delete;
  ProfileRun(ProfileRun&&) = delete;
  ProfileRun& operator=(ProfileRun&&) = delete;
  void finish();

 private:
  ProfileKwargs kwargs_;
  int process_index_;
  bool running_ = false;
};
}  // namespace detail

/// Runs `fn()` under LibTorch's profiler configured by `kwargs` and returns its result. When
/// `kwargs.output_trace_dir` is set and `fn` succeeds, writes the Chrome trace
/// `<output_trace_dir>/profile_<process_index>.json` (upstream's file name); when `fn` throws, the
/// profiler stops, nothing is written and the exception propagates. Options this profiler cannot
/// honour (a schedule, unknown activities, "cuda" without CUDA) are refused before `fn` runs, and
/// so is profiling inside a profiled call (profiles do not nest).
template <typename Fn>
decltype(auto) profile(const ProfileKwargs& kwargs, int process_index, Fn&& fn) {
  detail::ProfileRun run(kwargs, process_index);
  if constexpr (std::is_void_v<std::invoke_result_t<Fn>>) {
    std::forward<Fn>(fn)();
    run.finish();
  } else {
    decltype(auto) result = std::forward<Fn>(fn)();
    run.finish();
    return result;
  }
}

/// `profile` named by the process index of `state`; after writing a trace, waits for every
/// process, as upstream's `Accelerator.profile` does (so every process must call it).
template <typename Fn>
decltype(auto) profile(const PartialState& state, const ProfileKwargs& kwargs, Fn&& fn) {
  if constexpr (std::is_void_v<std::invoke_result_t<Fn>>) {
    profile(kwargs, state.process_index(), std::forward<Fn>(fn));
    if (!kwargs.output_trace_dir.empty()) state.wait_for_everyone();
  } else {
    decltype(auto) result = profile(kwargs, state.process_index(), std::forward<Fn>(fn));
    if (!kwargs.output_trace_dir.empty()) state.wait_for_everyone();
    return result;
  }
}

}  // namespace accelerate
