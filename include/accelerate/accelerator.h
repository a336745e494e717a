// The `Accelerator`: the object a training or inference loop talks to (upstream:
// accelerate/accelerator.py). This first part holds the process state, the process-control
// helpers and the collectives over nested data (gather, gather_for_metrics, reduce,
// pad_across_processes); preparing models, optimizers, schedulers and data loaders, gradient
// accumulation and mixed-precision training are not part of it yet.
//
// Example:
//   accelerate::Accelerator accelerator({.mixed_precision = "bf16"});
//   auto all_predictions = accelerator.gather_for_metrics(predictions);
#pragma once

#include "accelerate/state.h"
#include "accelerate/utils/dataclasses.h"
#include "accelerate/utils/operations.h"

#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace accelerate {

/// Options of an `Accelerator`, upstream's constructor arguments as one aggregate.
struct AcceleratorOptions {
  /// "no", "fp16" or "bf16"; empty reads `ACCELERATE_MIXED_PRECISION`, else "no".
  std::string mixed_precision;
  /// Force the CPU even when CUDA is available.
  bool cpu = false;
  /// Process-group settings (upstream passes an `InitProcessGroupKwargs` in `kwargs_handlers`).
  InitProcessGroupKwargs init_process_group_kwargs;
  /// Run on a state of its own built from these settings instead of the process-wide one (for
  /// several ranks as threads of one process, or several jobs in one program).
  std::optional<PartialStateOptions> standalone_state;
};

namespace accelerator_detail {
template <typename T> struct is_object_list : std::false_type {};
template <typename X, typename A>
struct is_object_list<std::vector<X, A>>
    : std::bool_constant<std::is_arithmetic_v<X> || std::is_same_v<X, std::string> || std::is_same_v<X, at::Tensor> ||
                         std::is_same_v<X, c10::IValue>> {};
template <typename T> struct is_value_list : std::false_type {};
template <typename X, typename A>
struct is_value_list<std::vector<X, A>> : std::bool_constant<std::is_arithmetic_v<X> || std::is_same_v<X, std::string>> {};
}  // namespace accelerator_detail

/// Runs a loop on one or many processes with upstream Accelerate's API. A cheap handle.
class Accelerator {
 public:
  /// An accelerator over the process-wide state (initialised from the environment on first use).
  explicit Accelerator(const AcceleratorOptions& options = {});

  /// The process state.
  const AcceleratorState& state() const { return state_; }
  /// The gradient-accumulation and data-loader state shared with prepared objects.
  const GradientState& gradient_state() const { return gradient_state_; }

  // Topology, forwarded from `state()`; see `PartialState` for each one.
  c10::Device device() const { return state_.device(); }
  DistributedType distributed_type() const { return state_.distributed_type(); }
  int num_processes() const { return state_.num_processes(); }
  int process_index() const { return state_.process_index(); }
  int local_process_index() const { return state_.local_process_index(); }
  bool is_main_process() const { return state_.is_main_process(); }
  bool is_local_main_process() const { return state_.is_local_main_process(); }
  bool is_last_process() const { return state_.is_last_process(); }
  bool use_distributed() const { return state_.use_distributed(); }
  /// The mixed-precision mode, upstream's spelling ("no", "fp16", "bf16").
  std::string mixed_precision() const { return to_string(state_.mixed_precision()); }
  /// Whether gradients are synchronised on this step.
  bool sync_gradients() const { return gradient_state_.sync_gradients(); }

  /// Blocks until every process reaches this point.
  void wait_for_everyone() const { partial().wait_for_everyone(); }
  /// Prints once per machine.
  template <typename... Args>
  void print(const Args&... args) const {
    partial().print(args...);
  }
  /// Runs `fn` on the main process first, then on the others.
  template <typename Fn>
  decltype(auto) main_process_first(Fn&& fn) const {
    return partial().main_process_first(std::forward<Fn>(fn));
  }
  /// Runs `fn` on each machine's local main process first, then on the others.
  template <typename Fn>
  decltype(auto) local_main_process_first(Fn&& fn) const {
    return partial().local_main_process_first(std::forward<Fn>(fn));
  }
  /// Wraps `fn` to run on the main process only (see `PartialState::on_main_process`).
  template <typename Fn>
  auto on_main_process(Fn fn) const {
    return partial().on_main_process(std::move(fn));
  }
  /// Wraps `fn` to run on each machine's local main process only.
  template <typename Fn>
  auto on_local_main_process(Fn fn) const {
    return partial().on_local_main_process(std::move(fn));
  }
  /// Wraps `fn` to run on the last process only.
  template <typename Fn>
  auto on_last_process(Fn fn) const {
    return partial().on_last_process(std::move(fn));
  }
  /// Wraps `fn` to run on process `process_index` only.
  template <typename Fn>
  auto on_process(Fn fn, int process_index) const {
    return partial().on_process(std::move(fn), process_index);
  }
  /// Wraps `fn` to run on local process `local_process_index` of each machine only.
  template <typename Fn>
  auto on_local_process(Fn fn, int local_process_index) const {
    return partial().on_local_process(std::move(fn), local_process_index);
  }
  /// This process's share of `inputs` (see `PartialState::split_between_processes`).
  template <typename T>
  auto split_between_processes(const T& inputs, bool apply_padding = false) const {
    return partial().split_between_processes(inputs, apply_padding);
  }
  /// Raises this process's trigger flag.
  void set_trigger() const { partial().set_trigger(); }
  /// Whether any process raised its trigger; a collective.
  bool check_trigger() const { return partial().check_trigger(); }

  /// Every process's tensors concatenated along the first dimension (see `accelerate::gather`).
  template <typename T>
  T gather(const T& data) const {
    return accelerate::gather(partial(), data);
  }

  /// Gathers for metric computation: like `gather`, but on the last batch of a data loader the
  /// samples added to even out the processes' batches are dropped, so every sample counts once.
  /// A `std::vector` of numbers or strings goes through `gather_object`, as upstream does for
  /// non-tensor data; `use_gather_object` forces that path for a vector of tensors or `IValue`s.
  template <typename T>
  T gather_for_metrics(const T& data, bool use_gather_object = false) const {
    if constexpr (accelerator_detail::is_value_list<T>::value) {
      return gather_object_for_metrics(partial(), gradient_state_, data);
    } else if constexpr (accelerator_detail::is_object_list<T>::value) {
      if (use_gather_object) return gather_object_for_metrics(partial(), gradient_state_, data);
      return accelerate::gather_for_metrics(partial(), gradient_state_, data);
    } else {
      TORCH_CHECK_VALUE(!use_gather_object, "[gather_for_metrics] use_gather_object needs a std::vector of numbers, "
                                            "strings, tensors or IValues");
      return accelerate::gather_for_metrics(partial(), gradient_state_, data);
    }
  }

  /// Every tensor reduced across processes; the default here is "sum" (as upstream's
  /// `Accelerator.reduce`; the free function's default is "mean").
  template <typename T>
  T reduce(const T& data, const std::string& reduction = "sum", double scale = 1.0) const {
    return accelerate::reduce(partial(), data, reduction, scale);
  }

  /// Pads every tensor along `dim` to the largest size of any process (see
  /// `accelerate::pad_across_processes`).
  template <typename T>
  T pad_across_processes(const T& data, int64_t dim = 0, double pad_index = 0, bool pad_first = false) const {
    return accelerate::pad_across_processes(partial(), data, dim, pad_index, pad_first);
  }

 private:
  const PartialState& partial() const { return state_.partial_state(); }

  AcceleratorState state_;
  GradientState gradient_state_;
};

}  // namespace accelerate
