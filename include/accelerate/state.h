// Process state: which process this is, how the processes are connected, and process control
// (upstream: accelerate/state.py — PartialState, AcceleratorState, GradientState).
//
// The process-wide state (`PartialState()`) is initialised from the environment on first use, as
// upstream's singleton is. Independent states for running several ranks as threads of one
// process come from `PartialState::standalone(options)` with an explicit rank, world size and
// `Store`. Process groups (c10d) stay an implementation detail.
//
// Example:
//   accelerate::PartialState state;                 // reads RANK, WORLD_SIZE, … or runs alone
//   auto mine = state.split_between_processes(prompts);
//   state.main_process_first([&] { download_dataset(); });
//   state.wait_for_everyone();
#pragma once

#include "accelerate/utils/dataclasses.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <chrono>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace accelerate {

namespace detail {
struct PartialStateImpl;
struct StoreImpl;
struct GradientStateImpl;
}  // namespace detail

/// A key-value store through which processes find each other (a handle over a c10d store).
/// Copies share the same store, so threads holding copies form one rendezvous.
class Store {
 public:
  /// A store in this process's memory, for ranks running as threads.
  static Store in_memory();
  /// A store in a file that every process can open, e.g. on a shared file system.
  static Store file(const std::string& path, int num_processes);

  /// Implementation access for the library itself.
  const std::shared_ptr<detail::StoreImpl>& impl() const { return impl_; }

 private:
  explicit Store(std::shared_ptr<detail::StoreImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<detail::StoreImpl> impl_;
};

/// Explicit settings of a `PartialState`; whatever is left unset comes from the environment.
struct PartialStateOptions {
  /// Force the CPU even when CUDA is available (`ACCELERATE_USE_CPU` also sets it).
  bool cpu = false;
  /// Global rank of this process (else `RANK`, `SLURM_PROCID`, `OMPI_COMM_WORLD_RANK`).
  std::optional<int> process_index{};
  /// Number of processes of the job (else `WORLD_SIZE`, `SLURM_NTASKS`, `OMPI_COMM_WORLD_SIZE`).
  std::optional<int> num_processes{};
  /// Rank on this machine (else `LOCAL_RANK`, …); defaults to `process_index`.
  std::optional<int> local_process_index{};
  /// Processes on this machine (else `LOCAL_WORLD_SIZE`, …); defaults to `num_processes`.
  std::optional<int> local_num_processes{};
  /// Rendezvous store; without one a TCP store at `master_addr`:`master_port` is used.
  std::optional<Store> store{};
  /// Address of the main process's store (else `MASTER_ADDR`, else 127.0.0.1).
  std::string master_addr{};
  /// Port of the main process's store (else `MASTER_PORT`, else 29500).
  std::optional<int> master_port{};
  /// Process-group back-end and collective timeout.
  InitProcessGroupKwargs init_kwargs{};
  /// How long to wait for every process to join (else `ACCELERATE_RDZV_TIMEOUT` seconds, else 900 s).
  std::optional<std::chrono::milliseconds> rdzv_timeout{};
  /// Debug mode (else `ACCELERATE_DEBUG_MODE`).
  std::optional<bool> debug{};
};

/// Information on the current processes and the means to coordinate them, without the training
/// machinery of `Accelerator` (upstream: `PartialState`). A cheap handle: copies share the state.
class PartialState {
 public:
  /// The process-wide state, initialised from the environment on first use.
  PartialState();
  /// The process-wide state, initialised with `options` if it does not exist yet; throws when it
  /// exists already with a different topology or device choice.
  explicit PartialState(const PartialStateOptions& options);
  /// A state of its own, not shared with `PartialState()`: for running ranks as threads.
  static PartialState standalone(const PartialStateOptions& options);
  /// Whether the process-wide state has been initialised.
  static bool initialized();
  /// Forgets the process-wide state (destroying its process group); for tests (upstream: `_reset_state`).
  static void reset();

  /// How the processes are connected.
  DistributedType distributed_type() const;
  /// The device this process computes on.
  c10::Device device() const;
  /// The process-group back-end ("gloo", "nccl"), or empty with a single process.
  std::string backend() const;
  /// Number of processes in the job.
  int num_processes() const;
  /// Global index of this process.
  int process_index() const;
  /// Index of this process on its machine.
  int local_process_index() const;
  /// Number of processes on this machine.
  int local_num_processes() const;
  /// Whether this is the process of index 0.
  bool is_main_process() const;
  /// Whether this is the first process on its machine.
  bool is_local_main_process() const;
  /// Whether this is the process of the highest index.
  bool is_last_process() const;
  /// Whether more than one process takes part.
  bool use_distributed() const;
  /// Whether debug mode (collective checks) is on.
  bool debug() const;
  /// Timeout of collectives.
  std::chrono::milliseconds timeout() const;

  /// Blocks until every process reaches this point (a no-op with one process).
  void wait_for_everyone() const;

  /// Runs `fn` on the main process first, then on the others; returns its result.
  /// The closing barrier runs only when `fn` succeeded (a failure propagates instead).
  template <typename Fn>
  decltype(auto) main_process_first(Fn&& fn) const {
    return goes_first(is_main_process(), std::forward<Fn>(fn));
  }
  /// Runs `fn` on each machine's local main process first, then on the others.
  template <typename Fn>
  decltype(auto) local_main_process_first(Fn&& fn) const {
    return goes_first(is_local_main_process(), std::forward<Fn>(fn));
  }

  /// Wraps `fn` to run only on the main process (always with one process). The wrapper returns
  /// `void` for a `void` function, otherwise `std::optional` of the result, empty where skipped.
  template <typename Fn>
  auto on_main_process(Fn fn) const {
    return only_if(is_main_process() || !use_distributed(), std::move(fn));
  }
  /// Wraps `fn` to run only on each machine's local main process.
  template <typename Fn>
  auto on_local_main_process(Fn fn) const {
    return only_if(is_local_main_process() || !use_distributed(), std::move(fn));
  }
  /// Wraps `fn` to run only on the last process.
  template <typename Fn>
  auto on_last_process(Fn fn) const {
    return only_if(is_last_process() || !use_distributed(), std::move(fn));
  }
  /// Wraps `fn` to run only on the process of index `process_index`.
  template <typename Fn>
  auto on_process(Fn fn, int process_index) const {
    return only_if(this->process_index() == process_index || !use_distributed(), std::move(fn));
  }
  /// Wraps `fn` to run only on the process of local index `local_process_index` on each machine.
  template <typename Fn>
  auto on_local_process(Fn fn, int local_process_index) const {
    return only_if(this->local_process_index() == local_process_index || !use_distributed(), std::move(fn));
  }

  /// This process's contiguous share of `inputs`; earlier processes take one extra element when
  /// the length does not divide. With `apply_padding` every share has the same length, padded
  /// by repeating the last element of `inputs`. With one process `inputs` comes back unchanged.
  ///
  /// Example (2 processes): {"A","B","C"} → process 0 {"A","B"}, process 1 {"C"} (or {"C","C"}).
  template <typename T>
  std::vector<T> split_between_processes(const std::vector<T>& inputs, bool apply_padding = false) const {
    if (num_processes() == 1) return inputs;
    const auto share = share_of(static_cast<int64_t>(inputs.size()), apply_padding, "a vector");
    std::vector<T> result(inputs.begin() + share.begin, inputs.begin() + share.end);
    while (static_cast<int64_t>(result.size()) < share.padded_size) result.push_back(inputs.back());
    return result;
  }
  /// Splits each value of a map of vectors (all must have the same length) the same way.
  template <typename K, typename T>
  std::map<K, std::vector<T>> split_between_processes(const std::map<K, std::vector<T>>& inputs,
                                                      bool apply_padding = false) const {
    if (num_processes() == 1 || inputs.empty()) return inputs;
    const size_t length = inputs.begin()->second.size();
    for (const auto& [key, value] : inputs) check_same_length(value.size(), length);
    std::map<K, std::vector<T>> result;
    for (const auto& [key, value] : inputs) result.emplace(key, split_between_processes(value, apply_padding));
    return result;
  }
  /// Splits a tensor along its first dimension.
  at::Tensor split_between_processes(const at::Tensor& inputs, bool apply_padding = false) const;

  /// Prints its arguments separated by spaces, once per machine (local main process only).
  template <typename... Args>
  void print(const Args&... args) const {
    if (!is_local_main_process()) return;
    std::ostringstream line;
    const char* sep = "";
    ((line << sep << args, sep = " "), ...);
    line << '\n';
    std::cout << line.str() << std::flush;
  }

  /// Raises this process's trigger flag, e.g. when its loss became NaN (upstream: `set_trigger`).
  void set_trigger() const;
  /// Whether any process raised its trigger since the last check; resets the flag when so.
  /// A collective: every process must call it.
  bool check_trigger() const;

  /// Destroys the process group; later collectives are errors (upstream: `destroy_process_group`).
  void destroy_process_group() const;

  /// Makes `device()` the current device of its kind for this thread, as upstream's `set_device`
  /// does with `torch.cuda.set_device` (so that kernels, allocations and NCCL without an explicit
  /// index go to this process's GPU); a no-op on the CPU. The state calls it once when it is made.
  void set_device() const;

  /// Implementation access for the library itself.
  const std::shared_ptr<detail::PartialStateImpl>& impl() const { return impl_; }
  /// A handle on `impl` (the library's own states over some processes of the job).
  static PartialState from_impl(std::shared_ptr<detail::PartialStateImpl> impl) { return PartialState(std::move(impl)); }

 private:
  explicit PartialState(std::shared_ptr<detail::PartialStateImpl> impl) : impl_(std::move(impl)) {}

  struct Share {
    int64_t begin;
    int64_t end;
    int64_t padded_size;
  };
  Share share_of(int64_t length, bool apply_padding, const char* what) const;
  static void check_same_length(size_t actual, size_t expected);

  template <typename Fn>
  decltype(auto) goes_first(bool first, Fn&& fn) const {
    if (!first) wait_for_everyone();
    if constexpr (std::is_void_v<std::invoke_result_t<Fn>>) {
      std::forward<Fn>(fn)();
      if (first) wait_for_everyone();
    } else {
      auto result = std::forward<Fn>(fn)();
      if (first) wait_for_everyone();
      return result;
    }
  }

  template <typename Fn>
  static auto only_if(bool run, Fn fn) {
    return [run, fn = std::move(fn)](auto&&... args) {
      using R = std::invoke_result_t<Fn&, decltype(args)...>;
      if constexpr (std::is_void_v<R>) {
        if (run) fn(std::forward<decltype(args)>(args)...);
      } else {
        return run ? std::optional<R>(fn(std::forward<decltype(args)>(args)...)) : std::optional<R>();
      }
    };
  }

  std::shared_ptr<detail::PartialStateImpl> impl_;
};

/// Settings of an `AcceleratorState` beyond the process topology.
struct AcceleratorStateOptions {
  /// "no", "fp16" or "bf16"; empty reads `ACCELERATE_MIXED_PRECISION`, else "no".
  std::string mixed_precision;
  /// Topology, store and process-group settings.
  PartialStateOptions partial;
};

/// `PartialState` plus what training needs: the mixed-precision mode (upstream: `AcceleratorState`).
class AcceleratorState {
 public:
  /// The process-wide accelerator state, initialised from the environment on first use.
  AcceleratorState();
  /// The process-wide accelerator state, initialised with `options` if it does not exist yet.
  explicit AcceleratorState(const AcceleratorStateOptions& options);
  /// An accelerator state over a standalone `PartialState`, for ranks as threads.
  static AcceleratorState standalone(const AcceleratorStateOptions& options);
  /// Forgets the process-wide accelerator state (and the partial state when `reset_partial_state`).
  static void reset(bool reset_partial_state = true);
  /// Whether the process-wide accelerator state has been initialised.
  static bool initialized();

  /// The underlying process state.
  const PartialState& partial_state() const { return partial_; }
  /// The mixed-precision mode.
  PrecisionType mixed_precision() const { return mixed_precision_; }

  // The topology and process control below forward to `partial_state()`; see `PartialState`.
  DistributedType distributed_type() const { return partial_.distributed_type(); }
  c10::Device device() const { return partial_.device(); }
  int num_processes() const { return partial_.num_processes(); }
  int process_index() const { return partial_.process_index(); }
  int local_process_index() const { return partial_.local_process_index(); }
  bool is_main_process() const { return partial_.is_main_process(); }
  bool is_local_main_process() const { return partial_.is_local_main_process(); }
  bool is_last_process() const { return partial_.is_last_process(); }
  bool use_distributed() const { return partial_.use_distributed(); }
  bool debug() const { return partial_.debug(); }
  void wait_for_everyone() const { partial_.wait_for_everyone(); }
  void set_device() const { partial_.set_device(); }
  void destroy_process_group() const { partial_.destroy_process_group(); }
  template <typename Fn>
  decltype(auto) main_process_first(Fn&& fn) const {
    return partial_.main_process_first(std::forward<Fn>(fn));
  }
  template <typename Fn>
  decltype(auto) local_main_process_first(Fn&& fn) const {
    return partial_.local_main_process_first(std::forward<Fn>(fn));
  }
  template <typename Inputs>
  auto split_between_processes(const Inputs& inputs, bool apply_padding = false) const {
    return partial_.split_between_processes(inputs, apply_padding);
  }
  template <typename... Args>
  void print(const Args&... args) const {
    partial_.print(args...);
  }

 private:
  AcceleratorState(PartialState partial, PrecisionType mixed_precision)
      : partial_(std::move(partial)), mixed_precision_(mixed_precision) {}
  PartialState partial_;
  PrecisionType mixed_precision_;
};

/// Where gradient accumulation stands and which data loaders are being iterated (upstream:
/// `GradientState`). Shared by the accelerator, its optimizers and its data loaders.
class GradientState {
 public:
  /// The process-wide gradient state.
  GradientState();
  /// The process-wide gradient state, configured with `plugin` (later calls update the plugin).
  explicit GradientState(const GradientAccumulationPlugin& plugin);
  /// A gradient state of its own, for ranks as threads.
  static GradientState standalone(const GradientAccumulationPlugin& plugin = {});
  /// Forgets the process-wide gradient state.
  static void reset();

  /// Whether gradients are synchronised (and optimizers step) on this step.
  bool sync_gradients() const;
  /// Whether the current batch is the last of the active data loader.
  bool end_of_dataloader() const;
  /// Samples of the last batch that are padding duplicates to drop (-1: unknown or none).
  int64_t remainder() const;
  /// Number of accumulation steps.
  int num_steps() const;
  /// Whether schedulers are adjusted for accumulation.
  bool adjust_scheduler() const;
  /// Whether the end of a data loader forces a synchronisation.
  bool sync_with_dataloader() const;
  /// Whether gradients are synchronised on every batch.
  bool sync_each_batch() const;
  /// The innermost data loader being iterated, or null.
  const void* active_dataloader() const;
  /// Every data loader being iterated, outermost first.
  std::vector<const void*> dataloader_references() const;
  /// Whether a data loader is being iterated.
  bool in_dataloader() const;
  /// The accumulation settings.
  GradientAccumulationPlugin plugin() const;

  /// Sets whether this step synchronises (used by `Accelerator`).
  void set_sync_gradients(bool sync) const;
  /// Marks the current batch as the last (or not) of the active data loader.
  void set_end_of_dataloader(bool end) const;
  /// Sets the number of padding duplicates in the last batch.
  void set_remainder(int64_t remainder) const;
  /// Pushes a data loader that starts iterating.
  void add_dataloader(const void* loader) const;
  /// Pops a data loader that finished iterating.
  void remove_dataloader(const void* loader) const;
  /// Replaces the accumulation settings.
  void set_plugin(const GradientAccumulationPlugin& plugin) const;
  /// Sets what prepared data loaders run at each step boundary: before a pass starts and before
  /// each batch after the first (used by `Accelerator` to stop a preempted job; see
  /// `PreemptionKwargs`). Empty: nothing.
  void set_step_boundary_callback(std::function<void(const GradientState&)> callback) const;
  /// Runs the step-boundary callback, if there is one (called by prepared data loaders).
  void at_step_boundary() const;

 private:
  explicit GradientState(std::shared_ptr<detail::GradientStateImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<detail::GradientStateImpl> impl_;
};

}  // namespace accelerate
