// The `Accelerator`: the object a training or inference loop talks to (upstream:
// accelerate/accelerator.py). It prepares models (gradient synchronisation through c10d's
// Reducer), optimizers, schedulers and data loaders for the processes of the job, runs the
// backward pass with gradient accumulation and fp16 loss scaling, controls when gradients are
// synchronised, and offers the process-control helpers and collectives over nested data.
// Checkpoints: `save_state` / `load_state` (crash-safe, see docs/design.md), `save_model` (sharded
// safetensors) and `register_for_checkpointing`. Experiment tracking: `log_with`, `init_trackers`,
// `log`, `get_tracker`, `end_training` (the trackers themselves are in tracking.h).
//
// Example:
//   accelerate::Accelerator accelerator({.mixed_precision = "bf16", .gradient_accumulation_steps = 2});
//   auto [model, optimizer, loader] = accelerator.prepare(net, sgd, data);
//   for (auto& batch : loader) {
//     auto step = accelerator.accumulate(model);
//     auto loss = torch::mse_loss(model(batch.data), batch.target);
//     accelerator.backward(loss);
//     optimizer.step();
//     optimizer.zero_grad();
//   }
#pragma once

#include "accelerate/checkpointing.h"
#include "accelerate/context_parallel.h"
#include "accelerate/data_loader.h"
#include "accelerate/device_mesh.h"
#include "accelerate/distributed.h"
#include "accelerate/grad_scaler.h"
#include "accelerate/optimizer.h"
#include "accelerate/parallelism_config.h"
#include "accelerate/scheduler.h"
#include "accelerate/state.h"
#include "accelerate/tracking.h"
#include "accelerate/utils/autocast.h"
#include "accelerate/utils/dataclasses.h"
#include "accelerate/utils/modeling.h"
#include "accelerate/utils/operations.h"
#include "accelerate/utils/profiler.h"

#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace accelerate {

namespace detail {
struct AcceleratorImpl;
namespace tensor_parallel {
class TensorParallelEngine;
}  // namespace tensor_parallel
}  // namespace detail

/// Options of an `Accelerator`, upstream's constructor arguments as one aggregate. Upstream's
/// `kwargs_handlers` list becomes one field per handler type.
struct AcceleratorOptions {
  /// Move prepared models and data-loader batches to `device()` (per object: `prepare_model`,
  /// `prepare_data_loader`).
  bool device_placement = true;
  /// "no", "fp16" or "bf16"; empty reads `ACCELERATE_MIXED_PRECISION`, else "no". fp16 needs a
  /// CUDA device: on the CPU it is disabled with a warning.
  std::string mixed_precision{};
  /// Batches whose gradients are accumulated per optimizer step (default 1;
  /// `ACCELERATE_GRADIENT_ACCUMULATION_STEPS` overrides it, as upstream). Not with
  /// `gradient_accumulation_plugin`.
  std::optional<int> gradient_accumulation_steps{};
  /// Full accumulation settings; not with `gradient_accumulation_steps`.
  std::optional<GradientAccumulationPlugin> gradient_accumulation_plugin{};
  /// Force the CPU even when CUDA is available (`ACCELERATE_USE_CPU` also sets it).
  bool cpu = false;
  /// How prepared data loaders shard, dispatch and shuffle.
  DataLoaderConfiguration dataloader_config{};
  /// Random generators synchronised from process 0 at the start of every pass of a prepared
  /// data loader: "torch" (LibTorch's CPU generator), "cuda", "generator" (the loader's own,
  /// always synchronised here). Empty: {"generator"}.
  std::vector<std::string> rng_types{};
  /// Experiment trackers: built-in names ("tensorboard", "dvclive", "jsonl", "csv", "all") and
  /// trackers of the user's (see tracking.h); started by `init_trackers`. Checked here: unknown
  /// names, trackers that need Python or a remote service, and trackers that need a logging folder
  /// without one (`project_config.logging_dir`, default `project_dir`) are refused.
  std::vector<Tracker> log_with{};
  /// Folder for checkpoints and logs (sets `project_config.project_dir` when that is empty).
  std::string project_dir{};
  /// Checkpoint naming and folders.
  ProjectConfiguration project_config{};
  /// Step prepared schedulers together with the optimizers (see `AcceleratedScheduler`).
  bool step_scheduler_with_optimizer = true;
  /// How prepared models synchronise gradients.
  DistributedDataParallelKwargs ddp_kwargs{};
  /// fp16 loss-scaler settings.
  GradScalerKwargs scaler_kwargs{};
  /// Process-group settings.
  InitProcessGroupKwargs init_process_group_kwargs{};
  /// Autocast settings of mixed-precision forward passes.
  AutocastKwargs autocast_kwargs{};
  /// Profiler settings of `profile()`.
  ProfileKwargs profile_kwargs{};
  /// Fully sharded data parallelism for prepared models (upstream: `fsdp_plugin`); also turned on
  /// with default settings by `ACCELERATE_USE_FSDP=true` (what `accelerate launch --use_fsdp`
  /// sets), whose `FSDP_*` variables fill the fields left empty. Takes effect with several
  /// processes.
  std::optional<FullyShardedDataParallelPlugin> fsdp_plugin{};
  /// Sizes of the parallel dimensions (upstream: `parallelism_config`), laid out as a
  /// `DeviceMesh` (`torch_device_mesh()`): `dp_shard_size` above 1 shards models (with
  /// `fsdp_plugin`'s settings, or the defaults), over groups that `dp_replicate_size` replicates
  /// (hybrid sharding when both are above 1); `tp_size` above 1 splits the layers of
  /// `tp_handler`'s plan over groups of neighbouring processes; `cp_size` above 1 splits the
  /// sequence of each batch over a context-parallel group (`maybe_context_parallel`), the model
  /// then sharded over dp_shard × cp, or with dp_shard 1 and no plugin its gradients averaged
  /// over dp × cp. Their product must be the number of processes. Resolved once, when the
  /// Accelerator is built (`parallelism_config()`).
  std::optional<ParallelismConfig> parallelism_config{};
  /// How tensor parallelism is applied (upstream: `parallelism_config`'s `tp_handler`; a field of
  /// its own here, beside it).
  TorchTensorParallelConfig tp_handler{};
  /// Stop cleanly, saving the state, when the job is asked to stop by a signal (beyond upstream;
  /// see `PreemptionKwargs`). Empty: the signals keep their default action.
  std::optional<PreemptionKwargs> preemption{};
  /// Run on a state of its own built from these settings instead of the process-wide one (for
  /// several ranks as threads of one process, or several jobs in one program).
  std::optional<PartialStateOptions> standalone_state{};
};

/// Restores the gradient-synchronisation flags of prepared models when it goes out of scope;
/// returned by `Accelerator::accumulate`, `no_sync` and `trigger_sync_in_backward`.
class [[nodiscard]] SyncGuard {
 public:
  /// Sets `require_backward_grad_sync` of every model to `sync` (when given); with
  /// `trigger_now`, also makes the coming backward pass synchronise.
  SyncGuard(std::vector<DistributedDataParallel> models, std::optional<bool> sync, bool trigger_now = false);
  ~SyncGuard();
  SyncGuard(const SyncGuard&) = delete;
  SyncGuard& operator=(const SyncGuard&) = delete;
  SyncGuard(SyncGuard&&) = delete;
  SyncGuard& operator=(SyncGuard&&) = delete;

 private:
  struct Saved {
    DistributedDataParallel model;
    bool backward_sync;
    bool forward_sync;
  };
  std::vector<Saved> saved_;
};

namespace accelerator_detail {
template <typename T> struct is_object_list : std::false_type {};
template <typename X, typename A>
struct is_object_list<std::vector<X, A>>
    : std::bool_constant<std::is_arithmetic_v<X> || std::is_same_v<X, std::string> || std::is_same_v<X, at::Tensor> ||
                         std::is_same_v<X, c10::IValue>> {};
template <typename T> struct is_optimizer_pointer : std::false_type {};
template <typename O>
struct is_optimizer_pointer<std::shared_ptr<O>> : std::is_base_of<torch::optim::Optimizer, O> {};
template <typename T> struct is_scheduler_pointer : std::false_type {};
template <typename S>
struct is_scheduler_pointer<std::shared_ptr<S>> : std::is_base_of<LRScheduler, S> {};
template <typename T> struct is_value_list : std::false_type {};
template <typename X, typename A>
struct is_value_list<std::vector<X, A>> : std::bool_constant<std::is_arithmetic_v<X> || std::is_same_v<X, std::string>> {};
}  // namespace accelerator_detail

/// Options of `Accelerator::load_state`.
struct LoadStateOptions {
  /// Convert a tensor whose dtype differs from the one it is loaded into (a model's weight, an
  /// optimizer's state, a registered object's tensor) instead of refusing the checkpoint.
  bool convert_dtypes = false;
  /// Whose files the folder holds: detected by default (upstream's when it holds their pickled
  /// files: see `CheckpointLayout`), or forced.
  CheckpointLayout layout = CheckpointLayout::kDetect;
};

/// Options of `Accelerator::save_state`.
struct SaveStateOptions {
  /// Whose files to write; unset: `ProjectConfiguration::checkpoint_layout`.
  std::optional<CheckpointLayout> layout{};
};

/// A save-state pre-hook: called on every process by `save_state` before anything is written, with
/// the prepared models, their state dicts (remove an entry to keep that model out of the
/// checkpoint; the remaining ones are numbered in order) and the folder being written (renamed
/// to the checkpoint's name once every process succeeded: files a hook writes there are part of
/// the checkpoint).
using SaveStatePreHook = std::function<void(const std::vector<DistributedDataParallel>& models,
                                            std::vector<StateDictMap>& weights, const std::string& output_dir)>;
/// A load-state pre-hook: called on every process by `load_state` before anything is read, with
/// the prepared models (remove an entry to load that model yourself) and the checkpoint folder.
using LoadStatePreHook = std::function<void(std::vector<DistributedDataParallel>& models, const std::string& input_dir)>;

/// Removes a registered hook (upstream: `torch.utils.hooks.RemovableHandle`).
class RemovableHandle {
 public:
  RemovableHandle() = default;
  explicit RemovableHandle(std::function<void()> remove) : remove_(std::move(remove)) {}
  /// Unregisters the hook; later calls do nothing.
  void remove() {
    if (remove_) std::exchange(remove_, nullptr)();
  }

 private:
  std::function<void()> remove_;
};

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
  /// As the state's, except FSDP for several processes whose models are fully sharded (upstream's
  /// AcceleratorState under an fsdp_plugin).
  DistributedType distributed_type() const;
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
  /// Batches accumulated per optimizer step.
  int gradient_accumulation_steps() const { return gradient_state_.num_steps(); }
  /// Changes the number of batches accumulated per optimizer step.
  void set_gradient_accumulation_steps(int steps) const;
  /// Whether the last optimizer step was skipped because fp16 gradients overflowed.
  bool optimizer_step_was_skipped() const;
  /// Whether data loaders cut each batch across processes (`dataloader_config.split_batches`).
  bool split_batches() const;
  /// Whether prepared data loaders give every process the same number of batches.
  bool even_batches() const;
  /// Whether prepared models and batches are moved to `device()` by default.
  bool device_placement() const;
  /// Whether prepared schedulers follow the optimizer steps.
  bool step_scheduler_with_optimizer() const;
  /// Batches seen by `accumulate` since the last synchronisation (upstream: `step`).
  int64_t step() const;
  /// The project folder ("" when none).
  std::string project_dir() const;
  /// The folder of tracker logs ("" when none).
  std::string logging_dir() const;
  /// The project settings.
  ProjectConfiguration project_configuration() const;
  /// The loss scaler of fp16 training, if any.
  std::optional<GradScaler> scaler() const;
  /// The fully sharded settings prepared models get, when models are sharded (upstream:
  /// `state.fsdp_plugin`).
  std::optional<FullyShardedDataParallelPlugin> fsdp_plugin() const;
  /// The processes laid out by the `parallelism_config` (upstream: `torch_device_mesh`); nothing
  /// without one.
  std::optional<DeviceMesh> torch_device_mesh() const;
  /// The `parallelism_config`, every size resolved and checked (upstream: the accelerator's
  /// `parallelism_config`); nothing without one. Its `device_mesh` is `torch_device_mesh()`.
  std::optional<ParallelismConfig> parallelism_config() const;
  /// The processes data parallelism runs over: the mesh's "dp" under tensor or context
  /// parallelism (the processes of one tensor- or context-parallel group share every batch),
  /// else every process. Data loaders shard over them, and `gather_for_metrics` gathers over them.
  const PartialState& data_parallel_state() const;
  /// The processes a prepared model's gradients are averaged (or sharded) over: the mesh's
  /// "dp_cp" under tensor or context parallelism, else every process.
  const PartialState& gradient_sync_state() const;
  /// A scope in which context parallelism splits `buffers` (inputs, labels, position ids) along
  /// `buffer_seq_dims` over the mesh's "cp" group and `accelerate::scaled_dot_product_attention`
  /// runs as ring attention (upstream: `maybe_context_parallel`, a context manager); see
  /// `ContextParallel`. Without a `parallelism_config` whose `cp_size` is above 1 it changes
  /// nothing (warning once), so that one loop serves both. Make one per step.
  ContextParallel maybe_context_parallel(const std::vector<at::Tensor>& buffers = {},
                                         const std::vector<int64_t>& buffer_seq_dims = {},
                                         const std::vector<at::Tensor>& no_restore_buffers = {}) const;
  /// Whether models are fully sharded with version 2 of the plugin (upstream: `is_fsdp2`).
  bool is_fsdp2() const;

  // ---- preparation ----------------------------------------------------------------------------

  /// Prepares every argument for the job — models (module holders such as `torch::nn::Linear` or
  /// `std::shared_ptr` to modules), optimizers (`std::shared_ptr` to any `torch::optim::Optimizer`),
  /// schedulers (`std::shared_ptr<LRScheduler>`) and `DataLoader`s — in any order and number, and
  /// returns them in the same order (one object, or a tuple for several). Schedulers follow the
  /// optimizer they schedule even when it is passed after them.
  ///
  /// Example:
  ///   auto [model, optimizer, loader, scheduler] = accelerator.prepare(net, adam, loader, sched);
  template <typename... Ts>
  auto prepare(const Ts&... objects) const {
    static_assert(sizeof...(Ts) > 0, "accelerate: prepare needs at least one object");
    (prepare_optimizer_first(objects), ...);
    if constexpr (sizeof...(Ts) == 1) {
      return prepare_one(objects...);
    } else {
      // Braced initialisation runs left to right, the order upstream prepares objects in.
      return std::tuple<decltype(prepare_one(objects))...>{prepare_one(objects)...};
    }
  }

  /// Prepares a model: moves it to `device()` (unless `device_placement` is false), broadcasts its
  /// parameters and buffers from process 0, and wraps it for gradient synchronisation and the
  /// mixed-precision forward pass. With `evaluation_mode` it is not wrapped for training (no
  /// gradient synchronisation). Preparing the same module again returns the same engine.
  template <typename M>
  PreparedModel<M> prepare_model(const M& model, std::optional<bool> device_placement = std::nullopt,
                                 bool evaluation_mode = false) const {
    static_assert(model_detail::is_model_v<M>,
                  "accelerate: prepare_model expects a module holder (e.g. torch::nn::Linear or a TORCH_MODULE type) "
                  "or a std::shared_ptr to a torch::nn::Module");
    return PreparedModel<M>(model, prepare_module(model_detail::module_of(model), device_placement, evaluation_mode));
  }
  /// Prepares an optimizer: steps follow gradient synchronisation and the fp16 scaler.
  AcceleratedOptimizer prepare_optimizer(const std::shared_ptr<torch::optim::Optimizer>& optimizer,
                                         std::optional<bool> device_placement = std::nullopt) const;
  /// Prepares a scheduler to follow the real steps of its optimizer (or of every prepared
  /// optimizer when its own was not prepared).
  AcceleratedScheduler prepare_scheduler(const std::shared_ptr<LRScheduler>& scheduler) const;
  /// Prepares a data loader: shards it over the processes as `dataloader_config` says and moves
  /// batches to `device()` (unless `device_placement` is false).
  DataLoader prepare_data_loader(const DataLoader& loader, std::optional<bool> device_placement = std::nullopt) const;

  /// Whether `model` or one of its submodules was dispatched over more than one device
  /// (`dispatch_model` with a device map of several entries; see `hf_device_map`) (upstream:
  /// `verify_device_map`). Such a model is not moved by `prepare`, and is refused by it when
  /// several processes run (unless ACCELERATE_BYPASS_DEVICE_MAP is "true").
  bool verify_device_map(const torch::nn::Module& model) const;
  /// `verify_device_map` of a module holder or shared pointer.
  template <typename M>
    requires model_detail::is_model_v<M>
  bool verify_device_map(const M& model) const {
    return verify_device_map(*model_detail::module_of(model));
  }

  /// The user's module inside a prepared model (upstream: `unwrap_model`).
  template <typename M>
  const M& unwrap_model(const PreparedModel<M>& model) const {
    return model.module();
  }

  // ---- training step --------------------------------------------------------------------------

  /// Backpropagates `loss` divided by `gradient_accumulation_steps()`, through the loss scaler
  /// under fp16. `retain_graph` / `create_graph` as in `at::Tensor::backward`.
  void backward(const at::Tensor& loss, std::optional<bool> retain_graph = std::nullopt,
                bool create_graph = false) const;

  /// Decides on entry whether this batch synchronises gradients — every
  /// `gradient_accumulation_steps`-th batch, the last batch of the data loader (with
  /// `sync_with_dataloader`) — and, when it does not, keeps the models' backward pass from
  /// synchronising until the guard ends (unless `sync_each_batch`).
  ///
  /// Example:
  ///   for (auto& batch : loader) {
  ///     auto guard = accelerator.accumulate(model);
  ///     accelerator.backward(loss_of(model, batch));
  ///     optimizer.step();
  ///     optimizer.zero_grad();
  ///   }
  template <typename... Ms>
  SyncGuard accumulate(const PreparedModel<Ms>&... models) const {
    return SyncGuard(std::vector<DistributedDataParallel>{models.ddp()...}, begin_accumulation_step());
  }
  /// Keeps `model`'s backward passes from synchronising gradients while the guard lives (they
  /// accumulate locally); a no-op with one process.
  template <typename M>
  SyncGuard no_sync(const PreparedModel<M>& model) const {
    return SyncGuard({model.ddp()}, use_distributed() ? std::optional<bool>(false) : std::nullopt);
  }
  /// Makes the next backward pass of `model` synchronise even though its forward pass ran inside
  /// `no_sync` (upstream's experimental `trigger_sync_in_backward`); a no-op with one process.
  template <typename M>
  SyncGuard trigger_sync_in_backward(const PreparedModel<M>& model) const {
    return SyncGuard({model.ddp()}, use_distributed() ? std::optional<bool>(true) : std::nullopt, use_distributed());
  }

  /// An autocast region in this accelerator's mixed precision (full precision with "no").
  AutocastGuard autocast(const std::optional<AutocastKwargs>& kwargs = std::nullopt) const;

  /// Divides the gradients of the prepared optimizers (or of `optimizer` only) by the fp16 loss
  /// scale, at most once per optimizer step; a no-op without a scaler.
  void unscale_gradients(const std::optional<AcceleratedOptimizer>& optimizer = std::nullopt) const;
  /// Unscales the gradients, then clips their global `norm_type`-norm to `max_norm`; returns the
  /// norm before clipping.
  double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type = 2.0) const;
  /// Unscales the gradients, then clamps each element to [-clip_value, clip_value].
  void clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value) const;

  /// Runs `fn` under LibTorch's profiler with `kwargs` (default: the accelerator's
  /// `profile_kwargs`) and returns its result; a `fn` taking `accelerate::Profiler&` gets the
  /// profiler, whose `step()` drives the schedule. With `output_trace_dir` each process writes its
  /// traces there, then every process waits for the others (upstream: `profile`).
  template <typename Fn>
  decltype(auto) profile(Fn&& fn, const std::optional<ProfileKwargs>& kwargs = std::nullopt) const {
    return accelerate::profile(partial(), kwargs.value_or(profile_kwargs()), std::forward<Fn>(fn));
  }
  /// The profiler settings given at construction.
  const ProfileKwargs& profile_kwargs() const;

  /// Drops this accelerator's references to the objects it prepared and restarts its step count
  /// (upstream: `free_memory`); cached device memory is released.
  void free_memory() const;
  /// Same as `free_memory`.
  void clear() const { free_memory(); }
  /// The data loaders, models, optimizers and schedulers prepared so far.
  std::vector<DataLoader> prepared_data_loaders() const;
  /// The engines of the models prepared so far.
  std::vector<DistributedDataParallel> prepared_models() const;
  /// The optimizers prepared so far.
  std::vector<AcceleratedOptimizer> prepared_optimizers() const;
  /// The schedulers prepared so far.
  std::vector<AcceleratedScheduler> prepared_schedulers() const;

  /// A loader like `loader` that skips its first `num_batches` batches (upstream: `skip_first_batches`).
  DataLoader skip_first_batches(const DataLoader& loader, int64_t num_batches = 0) const {
    return accelerate::skip_first_batches(loader, num_batches);
  }

  /// Blocks until every process reaches this point.
  void wait_for_everyone() const { partial().wait_for_everyone(); }
  /// Whether the job was asked to stop: one of `preemption`'s signals reached any of its
  /// processes. A collective: every process calls it at the same point, and all get the same
  /// answer, so they stop at the same step. Always false without `preemption`.
  bool preemption_requested() const;
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
      return gather_object_for_metrics(data_parallel_state(), gradient_state_, data);
    } else if constexpr (accelerator_detail::is_object_list<T>::value) {
      if (use_gather_object) return gather_object_for_metrics(data_parallel_state(), gradient_state_, data);
      return accelerate::gather_for_metrics(data_parallel_state(), gradient_state_, data);
    } else {
      TORCH_CHECK_VALUE(!use_gather_object, "[gather_for_metrics] use_gather_object needs a std::vector of numbers, "
                                            "strings, tensors or IValues");
      return accelerate::gather_for_metrics(data_parallel_state(), gradient_state_, data);
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

  // ---- checkpoints ------------------------------------------------------------------------------

  /// Writes `tensors` at `path` on the main process only (on each machine's local main process
  /// with `save_on_each_node`), flushed and renamed into place (upstream: `save`): a safetensors
  /// file, or with `safe_serialization` false a torch.save file of an OrderedDict of the tensors,
  /// which Python's `torch.load` reads (with `weights_only=True` too) and `load_state_dict`
  /// reads back. Upstream's default is torch.save; here nothing is pickled unless asked.
  void save(const StateDictMap& tensors, const std::string& path, bool safe_serialization = true) const;
  /// `save` for a name -> tensor map.
  void save(const TensorMap& tensors, const std::string& path, bool safe_serialization = true) const;
  /// `save` for JSON values: a JSON file, or with `safe_serialization` false a torch.save file of
  /// the values as Python's (objects become dicts, arrays lists).
  void save(const nlohmann::json& values, const std::string& path, bool safe_serialization = true) const;

  /// The state dict of a model: its parameters and buffers in PyTorch's order (upstream:
  /// `get_state_dict`; prepared models hold the user's module, so `unwrap` changes nothing).
  /// For a fully sharded model, the whole tensors, gathered from every process (a collective).
  template <typename M>
  StateDictMap get_state_dict(const M& model, bool unwrap = true) const {
    (void)unwrap;
    return model_state_dict(checkpoint_module(model));
  }

  /// Saves a model's weights to the folder `save_directory` on the main process (on each
  /// machine's local main process with `save_on_each_node`): `model.safetensors`, or shards of
  /// at most `max_shard_size` and `model.safetensors.index.json` (see `save_state_dict_sharded`).
  /// The model may be prepared or not. Not a collective, except for a fully sharded model, whose
  /// whole tensors are gathered from every process first.
  template <typename M>
  void save_model(const M& model, const std::string& save_directory,
                  const std::string& max_shard_size = "10GB") const {
    save_module(checkpoint_module(model), save_directory, max_shard_size);
  }

  /// Saves everything needed to resume training into a folder (upstream: `save_state`):
  /// `model.safetensors` (`model_<i>.safetensors` for the i-th prepared model),
  /// `optimizer.safetensors` (`optimizer_<i>…`), `scheduler.json`, `sampler.json` (the data
  /// loader's order; `dl_state_dict.json` with its position for `use_stateful_dataloader`),
  /// `scaler.json`, `custom_checkpoint_<i>.{json,safetensors}` and every process's
  /// `random_states_<process>.safetensors` (generator states and the step count). With
  /// `automatic_checkpoint_naming` the folder is `<project_dir>/checkpoints/checkpoint_<iteration>`
  /// (`output_dir` must then be empty), the iteration advances, and the oldest checkpoints beyond
  /// `total_limit` are removed after the new one is complete. Crash-safe: the files go to a
  /// hidden staging folder, are flushed, every process confirms its writes, and only then is the
  /// folder renamed into place — an error on any process fails the save on every process and
  /// leaves the previous checkpoint as it was. A collective; returns the checkpoint folder.
  /// With `CheckpointLayout::kPython` (`options.layout` or the project configuration) it writes
  /// upstream's files instead, which Python Accelerate's `load_state` resumes: `model.safetensors`,
  /// `optimizer.bin`, `scheduler.bin`, `scaler.pt`, `custom_checkpoint_<i>.pkl` and
  /// `random_states_<process>.pkl` in torch.save's format (no data loader state: upstream's
  /// `sampler.bin` is a pickled Python object). Models with sharded states and OneCycleLR are
  /// refused there.
  std::string save_state(const std::string& output_dir = "", const SaveStateOptions& options = {}) const;
  /// Restores what `save_state` wrote (upstream: `load_state`). Without `input_dir` (and with
  /// `automatic_checkpoint_naming`) the newest complete checkpoint of the project is taken
  /// (folders of that name without a save's files are skipped and named in a warning), and the
  /// iteration continues after it. Every file is read and checked before anything changes, and
  /// a failure leaves every object as it was; a failure on any process fails the load on every
  /// process, naming the file and the key. Model weights and optimizer states must match the
  /// prepared objects exactly (names, shapes and dtypes, unless `options.convert_dtypes`); tensors
  /// holding NaN or infinity where the model's had none are named in a warning. A collective.
  /// A folder written by Python Accelerate's `save_state` is read too (`LoadStateOptions::layout`):
  /// the model (`model.safetensors`, `pytorch_model.bin`, or their index and shards), the
  /// optimizers, LambdaLR schedulers, the scaler, the torch generators and the step, and
  /// registered objects whose state is values and tensors; nothing in it runs code, and anything
  /// but PyTorch's own classes is refused by name. Python's `random` and numpy states, and the
  /// data loaders' pickled samplers, have no C++ counterpart: they are named in one warning.
  void load_state(const std::string& input_dir = "", const LoadStateOptions& options = {}) const;

  /// Registers objects whose state `save_state` saves and `load_state` restores, in order
  /// (upstream: `register_for_checkpointing`): anything with `state_dict()` and
  /// `load_state_dict(state)` where the state is nlohmann::json, TensorMap, StateDictMap,
  /// StateDict or DataLoaderState, and modules. Objects passed as `std::shared_ptr` are shared;
  /// others are referenced and must outlive their use here. Anything else does not compile
  /// (the error names the argument's position); a null pointer raises naming its position.
  template <typename... Objects>
  void register_for_checkpointing(Objects&&... objects) const {
    static_assert(sizeof...(Objects) > 0, "accelerate: register_for_checkpointing needs at least one object");
    static_assert(((std::is_lvalue_reference_v<Objects> ||
                    checkpoint_detail::is_shared_ptr<std::decay_t<Objects>>::value) && ...),
                  "accelerate: register_for_checkpointing references its objects: pass variables, or std::shared_ptr");
    register_checkpoint_objects(make_checkpoint_objects(std::index_sequence_for<Objects...>{}, objects...));
  }
  /// Registers a hook run by `save_state` before it writes; see `SaveStatePreHook`.
  RemovableHandle register_save_state_pre_hook(SaveStatePreHook hook) const;
  /// Registers a hook run by `load_state` before it reads; see `LoadStatePreHook`.
  RemovableHandle register_load_state_pre_hook(LoadStatePreHook hook) const;
  /// The number of the next automatically named checkpoint (upstream: `save_iteration`).
  int save_iteration() const;
  /// Sets the number of the next automatically named checkpoint.
  void set_save_iteration(int iteration) const;

  // ---- experiment tracking --------------------------------------------------------------------

  /// Starts a run named `project_name` on every tracker of `log_with` (upstream: `init_trackers`):
  /// built-in trackers are created — on the main process only, other processes get trackers that
  /// do nothing — with their options from `init_kwargs` (a JSON object keyed by tracker name, e.g.
  /// `{{"tensorboard", {{"filename_suffix", ".v2"}}}}`; unknown names and options are refused), and a
  /// non-empty `config` (a JSON object) is stored by every tracker as the run's hyperparameters.
  /// Trackers of the user's with `main_process_only()` false run on every process.
  ///
  /// Example:
  ///   accelerator.init_trackers("my_project", {{"learning_rate", 1e-3}, {"batch_size", 32}});
  void init_trackers(const std::string& project_name, const nlohmann::json& config = nlohmann::json::object(),
                     const nlohmann::json& init_kwargs = nlohmann::json::object()) const;
  /// Logs `values` (a JSON object: numbers, strings, or objects of numbers — see tracking.h) at
  /// `step` to every tracker, on the main process only (upstream: `log`). The values are checked on
  /// every process. `log_kwargs` is keyed by tracker name, as upstream; the built-in trackers take
  /// no log options, so it must hold only empty objects.
  ///
  /// Example:
  ///   accelerator.log({{"train_loss", 1.12}, {"valid_loss", 0.8}}, /*step=*/1);
  void log(const nlohmann::json& values, std::optional<int64_t> step = std::nullopt,
           const nlohmann::json& log_kwargs = nlohmann::json::object()) const;
  /// The tracker named `name` (upstream: `get_tracker`); on a process that does not run it, a
  /// tracker of that name that does nothing. Without any tracker, a tracker that does nothing.
  std::shared_ptr<GeneralTracker> get_tracker(const std::string& name) const;
  /// The trackers started by `init_trackers`, in `log_with` order ("all" expands to every
  /// built-in after the user's trackers). Its content changes with `init_trackers`, which must
  /// not run on another thread while it is read.
  const std::vector<std::shared_ptr<GeneralTracker>>& trackers() const;
  /// Finishes every tracker (closing their files) and waits for every process (upstream:
  /// `end_training`). Every tracker is finished even when one fails; the first error is raised
  /// after the wait. A collective; `init_trackers` may start new runs afterwards.
  void end_training() const;

  // ---- uneven inputs --------------------------------------------------------------------------

  /// Runs `fn` so that processes may run out of batches at different times (upstream:
  /// `join_uneven_inputs`, over PyTorch's `Join`): with several processes and `even_batches`
  /// false, the prepared model in `joinables` follows DDP's join protocol
  /// (`DistributedDataParallel::join`): a process whose `fn` returned keeps matching the others'
  /// collectives, contributing zero gradients (averages still divide by the full number of
  /// processes), until every `fn` returned, and then every process takes the model of the last
  /// process to finish. `even_batches`, when given, overrides the setting of the prepared
  /// map-style data loaders while `fn` runs (restored afterwards, even when `fn` throws);
  /// dispatching and iterable loaders keep theirs, with a warning. With one process it just runs
  /// `fn` (warning when the distributed type is not "NO"). Returns what `fn` returns; an
  /// exception from `fn` propagates without the joining collectives. Models prepared for
  /// evaluation do not take part; at most one prepared training model can be joined at a time,
  /// see `DistributedDataParallel::join` for that and the other limits.
  ///
  /// Example:
  ///   accelerator.join_uneven_inputs({model.ddp()}, [&] {
  ///     for (auto& batch : loader) {
  ///       accelerator.backward(torch::mse_loss(model(batch.data), batch.target));
  ///       optimizer.step();
  ///       optimizer.zero_grad();
  ///     }
  ///   }, /*even_batches=*/false);
  template <typename Fn>
  auto join_uneven_inputs(std::vector<DistributedDataParallel> joinables, Fn&& fn,
                          std::optional<bool> even_batches = std::nullopt) const {
    using Result = std::invoke_result_t<Fn>;
    if constexpr (std::is_void_v<Result>) {
      join_uneven_inputs_erased(std::move(joinables), [&] { std::forward<Fn>(fn)(); }, even_batches);
    } else {
      std::optional<std::decay_t<Result>> result;
      join_uneven_inputs_erased(std::move(joinables), [&] { result.emplace(std::forward<Fn>(fn)()); }, even_batches);
      return std::move(*result);
    }
  }
  /// `join_uneven_inputs` over a type-erased body (what the template runs).
  void join_uneven_inputs_erased(std::vector<DistributedDataParallel> joinables, const std::function<void()>& fn,
                                 std::optional<bool> even_batches) const;

 private:
  const PartialState& partial() const { return state_.partial_state(); }

  // The state dict of a module, gathered when a prepared model shards it.
  StateDictMap model_state_dict(const std::shared_ptr<torch::nn::Module>& module, bool for_saving = false) const;
  template <typename M>
  static std::shared_ptr<torch::nn::Module> checkpoint_module(const M& model) {
    if constexpr (is_prepared_model<M>::value) {
      return model_detail::module_of(model.module());
    } else {
      static_assert(model_detail::is_model_v<M>,
                    "accelerate: expected a prepared model, a module holder or a std::shared_ptr to a module");
      return model_detail::module_of(model);
    }
  }
  template <size_t... I, typename... Objects>
  static std::vector<CheckpointObject> make_checkpoint_objects(std::index_sequence<I...>, Objects&... objects) {
    return {checkpoint_detail::make_checkpoint_object<I>(objects)...};
  }
  void register_checkpoint_objects(std::vector<CheckpointObject> objects) const;
  void save_module(const std::shared_ptr<torch::nn::Module>& module, const std::string& save_directory,
                   const std::string& max_shard_size) const;
  bool writes_shared_files() const;
  // Numbers the first automatically named checkpoint after an earlier run's (Note [A new run
  // beside an earlier run's checkpoints]); updates `project.iteration`.
  void number_after_earlier_run(ProjectConfiguration& project) const;

  template <typename T>
  void prepare_optimizer_first(const T& object) const {
    if constexpr (accelerator_detail::is_optimizer_pointer<T>::value) (void)prepare_optimizer(object);
  }
  template <typename T>
  auto prepare_one(const T& object) const {
    if constexpr (std::is_same_v<T, DataLoader>) {
      return prepare_data_loader(object);
    } else if constexpr (model_detail::is_model_v<T>) {
      return prepare_model(object);
    } else if constexpr (accelerator_detail::is_optimizer_pointer<T>::value) {
      return prepare_optimizer(object);
    } else if constexpr (accelerator_detail::is_scheduler_pointer<T>::value) {
      return prepare_scheduler(object);
    } else if constexpr (is_prepared_model<T>::value || std::is_same_v<T, AcceleratedOptimizer> ||
                         std::is_same_v<T, AcceleratedScheduler>) {
      return object;
    } else {
      static_assert(model_detail::is_model_v<T>,
                    "accelerate: prepare accepts models (module holders or std::shared_ptr to a torch::nn::Module), "
                    "std::shared_ptr to optimizers and to LRSchedulers, and DataLoaders");
    }
  }
  DistributedDataParallel prepare_module(const std::shared_ptr<torch::nn::Module>& module,
                                         std::optional<bool> device_placement, bool evaluation_mode) const;
  // Splits the layers of the tensor-parallel plan (the tp_handler's, else the model class's).
  std::shared_ptr<detail::tensor_parallel::TensorParallelEngine> apply_tensor_parallelism(
      const std::shared_ptr<torch::nn::Module>& module) const;
  // Stops the job when it was asked to, at a step boundary of a prepared data loader (Note
  // [Preemption] in src/preemption.cpp); registered with the gradient state when built.
  void install_preemption() const;
  Accelerator(AcceleratorState state, GradientState gradient_state, std::shared_ptr<detail::AcceleratorImpl> impl)
      : state_(std::move(state)), gradient_state_(std::move(gradient_state)), impl_(std::move(impl)) {}
  void stop_if_preempted() const;
  // Upstream's `_do_sync`: advances the step count and decides whether this batch synchronises.
  // Returns the backward-sync flag the models get for the batch (empty: leave them alone).
  std::optional<bool> begin_accumulation_step() const;

  AcceleratorState state_;
  GradientState gradient_state_;
  std::shared_ptr<detail::AcceleratorImpl> impl_;
};

}  // namespace accelerate
