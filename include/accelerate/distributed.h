// Data-parallel models: the counterpart of PyTorch's `DistributedDataParallel`, which upstream's
// `Accelerator.prepare` wraps models in. Gradients are synchronised by c10d's `Reducer` — the
// engine behind PyTorch DDP — which groups them into buckets and launches one asynchronous
// allreduce per bucket from the autograd hooks as soon as the bucket is complete, overlapping
// communication with the rest of the backward pass. `PreparedModel<M>` is what `prepare` returns:
// it is called like the user's module and adds, around each forward pass, DDP's bookkeeping and
// the mixed-precision region. `DistributedDataParallel::join` is DDP's join protocol for uneven
// inputs (what `Accelerator::join_uneven_inputs` runs). Not here: PowerSGD, sparse gradients,
// multi-device modules, and joining several models at once.
//
// Example:
//   auto prepared = accelerator.prepare(Net());          // a PreparedModel<Net>
//   auto loss = torch::mse_loss(prepared(x), y);         // forward through the wrapper
//   accelerator.backward(loss);                          // gradients averaged over processes
//   Net original = accelerator.unwrap_model(prepared);
#pragma once

#include "accelerate/hooks.h"
#include "accelerate/state.h"
#include "accelerate/utils/autocast.h"
#include "accelerate/utils/dataclasses.h"
#include "accelerate/utils/operations.h"
#include "accelerate/utils/tensor_tree.h"
#include "accelerate/utils/type_traits.h"

#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace accelerate {

class DistributedDataParallel;
struct ForwardOptions;
namespace detail {
struct DistributedDataParallelImpl;
namespace fsdp {
struct FsdpSettings;
}  // namespace fsdp
DistributedDataParallel fully_sharded(std::shared_ptr<torch::nn::Module> module, const PartialState& state,
                                      fsdp::FsdpSettings settings, const ForwardOptions& forward, int dp_shard_size);
}  // namespace detail

/// How a prepared model runs its forward pass, beyond gradient synchronisation.
struct ForwardOptions {
  /// Precision of the forward pass: with fp16/bf16 it runs under autocast and floating-point
  /// outputs come back in fp32, as upstream's `convert_outputs_to_fp32` does.
  PrecisionType mixed_precision = PrecisionType::kNo;
  /// Settings of that autocast region.
  AutocastKwargs autocast{};
};

/// The type-erased engine of a prepared model: the module, its `Reducer` (when more than one
/// process takes part) and the flags that decide whether the next backward pass synchronises.
/// A cheap handle: copies share the engine.
class DistributedDataParallel {
 public:
  /// Wraps `module`. With several processes this broadcasts every parameter and buffer from
  /// process 0, checks that every process has the same parameter shapes (a clear error names the
  /// first mismatch), and builds the reducer; with one process it only records the settings.
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, const PartialState& state,
                          const DistributedDataParallelKwargs& kwargs = {}, const ForwardOptions& forward = {});

  /// A fully sharded engine (upstream: the model after `fully_shard`): with several processes the
  /// module's parameters are split over the processes as `plugin` says (see
  /// `FullyShardedDataParallelPlugin`), gathered around each unit's forward and backward, and
  /// their gradients reduce-scattered; the module's own parameter objects then hold this
  /// process's shards between steps, which is what the optimizer steps. With one process it
  /// only records the settings, as the DDP engine does.
  ///
  /// `dp_shard_size` (a `ParallelismConfig`'s) shards over groups of that many consecutive
  /// processes and replicates over the groups (hybrid sharding); 0 shards over every process, or
  /// under HYBRID_SHARD and _HYBRID_SHARD_ZERO2 over the processes of each machine.
  static DistributedDataParallel fully_sharded(std::shared_ptr<torch::nn::Module> module, const PartialState& state,
                                               const FullyShardedDataParallelPlugin& plugin,
                                               const ForwardOptions& forward = {}, int dp_shard_size = 0);

  /// An engine that never synchronises (models prepared for evaluation only): it keeps the
  /// forward-pass settings for a module living on `device`.
  static DistributedDataParallel local(std::shared_ptr<torch::nn::Module> module, c10::Device device,
                                       const ForwardOptions& forward = {});

  /// The wrapped module.
  const std::shared_ptr<torch::nn::Module>& module() const;
  /// Whether a reducer or the fully sharded engine synchronises the gradients (more than one process).
  bool is_distributed() const;
  /// Whether the model is fully sharded (`fully_sharded` with more than one process).
  bool is_fully_sharded() const;
  /// Whether layers of the module are split by tensor parallelism.
  bool is_tensor_parallel() const;
  /// After a forward pass of a tensor-parallel model: refuses a pass in which a split layer ran
  /// without its hook (Note [Split layers called without their hook] in src/tensor_parallel/engine.cpp).
  void check_tensor_parallel_pass(const std::vector<at::Tensor>& outputs) const;
  /// `input` as the model's call passes it on: a floating tensor in the param_dtype of a fully
  /// sharded model's mixed-precision policy (upstream casts the root's inputs too); else `input`.
  at::Tensor cast_forward_input(const at::Tensor& input) const;
  /// The DDP settings.
  const DistributedDataParallelKwargs& kwargs() const;
  /// The forward-pass settings.
  const ForwardOptions& forward_options() const;

  /// Whether the next backward pass after a forward pass synchronises gradients (false inside `no_sync`).
  bool require_backward_grad_sync() const;
  /// Sets `require_backward_grad_sync` (used by the sync-control guards).
  void set_require_backward_grad_sync(bool sync) const;
  /// Whether buffers are broadcast before the next forward pass (DDP's `require_forward_param_sync`).
  bool require_forward_param_sync() const;
  /// Sets `require_forward_param_sync`.
  void set_require_forward_param_sync(bool sync) const;
  /// Makes the coming backward pass synchronise although the forward pass ran without it
  /// (upstream's `trigger_sync_in_backward`); a no-op with one process.
  void prepare_for_backward_now() const;
  /// Called from a catch block around the module's forward (`PreparedModel`'s call): rethrows
  /// the error, naming the sharded units that ran without their hooks in this pass when there are
  /// any (Note [Units called without their hook] in src/distributed.cpp).
  [[noreturn]] void rethrow_forward_error() const;
  /// Forward passes that prepared a synchronising backward pass so far.
  int64_t num_iterations() const;

  /// Runs `fn` with DDP's join protocol, so that processes may run out of inputs at different
  /// times (PyTorch: `DistributedDataParallel.join()`, with `divide_by_initial_world_size=True`).
  /// See Note [Join protocol] in src/distributed.cpp: a process whose `fn` returned keeps
  /// matching the collectives of the processes still running — their forward passes, their
  /// buffer broadcasts, their synchronising backward passes, to which it contributes zero
  /// gradients (the average still divides by the full number of processes) — until every `fn`
  /// has returned; then every process takes the parameters and buffers of the last process to
  /// finish. Returns what `fn` returns; when `fn` throws, the exception propagates without the
  /// joining collectives. With one process it just runs `fn`.
  ///
  /// Limits: one model per join (the backward collectives of several models interleave in an
  /// order a finished process cannot reproduce); with `static_graph`, a process that runs out of
  /// inputs before the model's first synchronising iteration takes part in the join correctly,
  /// but its reducer never recorded the graph, so every process then refuses to train the model
  /// further, with an error saying so; a backward pass made to synchronise after its forward pass
  /// (`trigger_sync_in_backward`) is not matched by finished processes.
  ///
  /// Example:
  ///   model.ddp().join([&] {
  ///     for (auto& batch : my_uneven_batches) { accelerator.backward(loss_of(model, batch)); opt.step(); }
  ///   });
  template <typename Fn>
  auto join(Fn&& fn) const {
    if (!is_distributed()) return std::forward<Fn>(fn)();
    JoinScope scope(*this);
    if constexpr (std::is_void_v<std::invoke_result_t<Fn>>) {
      std::forward<Fn>(fn)();
      join_until_all_finished();
    } else {
      auto result = std::forward<Fn>(fn)();
      join_until_all_finished();
      return result;
    }
  }
  /// Whether forward passes currently follow the join protocol (inside `join`).
  bool join_enabled() const;

  /// What the forward pass of a `PreparedModel` does before calling the module: DDP bookkeeping,
  /// the buffer broadcast, and the autocast region (closed when the scope ends).
  class [[nodiscard]] ForwardScope {
   public:
    /// Opens the forward pass of `ddp`.
    explicit ForwardScope(const DistributedDataParallel& ddp);
    ForwardScope(const ForwardScope&) = delete;
    ForwardScope& operator=(const ForwardScope&) = delete;
    ForwardScope(ForwardScope&&) = delete;
    ForwardScope& operator=(ForwardScope&&) = delete;

   private:
    std::optional<AutocastGuard> autocast_;
  };

  /// Finishes a forward pass that produced `output`: converts it to fp32 under mixed precision and
  /// prepares the reducer for the backward pass.
  template <typename T>
  T finish_forward(T output) const {
    if (forward_options().mixed_precision != PrecisionType::kNo) output = convert_to_fp32(output);
    if (is_tensor_parallel()) check_tensor_parallel_pass(flatten_tensors(output));
    if (!is_distributed()) return output;
    if (!wants_outputs()) {
      after_forward({});
      return output;
    }
    auto tensors = after_forward(flatten_tensors(output));
    return tensors.empty() ? output : unflatten_tensors(output, tensors);
  }

  /// An engine for the same module that never synchronises gradients, keeping the forward-pass
  /// settings (autocast, fp32 outputs) when `keep_mixed_precision` and dropping them otherwise
  /// (what `extract_model_from_parallel` wraps the module in).
  DistributedDataParallel without_synchronisation(bool keep_mixed_precision) const;

  /// Implementation access for the library itself.
  const std::shared_ptr<detail::DistributedDataParallelImpl>& impl() const { return impl_; }

 private:
  // Whether `after_forward` needs the output tensors (unused-parameter search, static graph).
  bool wants_outputs() const;
  // Prepares the backward pass; returns replacement output tensors when they must be routed
  // through an autograd node of the engine (static graph, first iteration), else nothing.
  std::vector<at::Tensor> after_forward(const std::vector<at::Tensor>& outputs) const;

  // Turns the join protocol on while `join` runs `fn`, and off again however `fn` ends.
  class [[nodiscard]] JoinScope {
   public:
    explicit JoinScope(const DistributedDataParallel& ddp);
    ~JoinScope();
    JoinScope(const JoinScope&) = delete;
    JoinScope& operator=(const JoinScope&) = delete;
    JoinScope(JoinScope&&) = delete;
    JoinScope& operator=(JoinScope&&) = delete;

   private:
    const DistributedDataParallel& ddp_;
  };
  // The part of `join` after `fn` returned: shadow the others until all are done, then agree on
  // the final model.
  void join_until_all_finished() const;

  friend DistributedDataParallel detail::fully_sharded(std::shared_ptr<torch::nn::Module> module,
                                                      const PartialState& state, detail::fsdp::FsdpSettings settings,
                                                      const ForwardOptions& forward, int dp_shard_size);
  explicit DistributedDataParallel(std::shared_ptr<detail::DistributedDataParallelImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<detail::DistributedDataParallelImpl> impl_;
};

namespace model_detail {
template <typename T> using pointee = traits::pointee<T, void>;
using traits::is_shared_ptr;
template <typename T, typename = void> struct is_module_holder : std::false_type {};
template <typename T>
struct is_module_holder<T, std::void_t<typename T::ContainedType>>
    : std::is_base_of<torch::nn::Module, typename T::ContainedType> {};

/// Whether `M` is a module holder or a shared pointer to a module.
template <typename M>
inline constexpr bool is_model_v =
    is_module_holder<M>::value ||
    (is_shared_ptr<M>::value && std::is_base_of_v<torch::nn::Module, typename pointee<M>::type>);

/// The module behind a holder or a shared pointer.
template <typename M>
std::shared_ptr<torch::nn::Module> module_of(const M& model) {
  if constexpr (is_shared_ptr<M>::value) {
    return model;
  } else {
    return model.ptr();
  }
}
}  // namespace model_detail

/// A model returned by `Accelerator::prepare`: call it like the module (`prepared(x)`), reach the
/// module's members with `->`, and get the module back with `module()` (upstream: the model
/// wrapped in `DistributedDataParallel`, and `unwrap_model`). `M` is a module holder such as
/// `torch::nn::Linear` or a `TORCH_MODULE` type, or a `std::shared_ptr` to a module.
template <typename M>
class PreparedModel {
 public:
  /// Pairs the user's `module` with the engine that `Accelerator::prepare` built for it.
  PreparedModel(M module, DistributedDataParallel ddp) : module_(std::move(module)), ddp_(std::move(ddp)) {}

  /// Runs the module's `forward` with DDP's bookkeeping and the mixed-precision region.
  template <typename... Args>
  auto operator()(Args&&... args) const {
    using Out = std::decay_t<decltype(std::declval<M&>()->forward(std::forward<Args>(args)...))>;
    if constexpr (std::is_void_v<Out>) {
      DistributedDataParallel::ForwardScope scope(ddp_);
      try {
        module_->forward(input(std::forward<Args>(args))...);
      } catch (const std::exception&) {
        ddp_.rethrow_forward_error();
      }
    } else {
      Out output = [&] {
        DistributedDataParallel::ForwardScope scope(ddp_);
        try {
          return call(input(std::forward<Args>(args))...);
        } catch (const std::exception&) {
          ddp_.rethrow_forward_error();
        }
      }();
      return ddp_.finish_forward(std::move(output));
    }
  }

  /// The module's members.
  auto operator->() const {
    if constexpr (model_detail::is_shared_ptr<M>::value) {
      return module_.get();
    } else {
      return module_.operator->();
    }
  }
  /// The user's module (upstream: `unwrap_model`).
  const M& module() const { return module_; }
  /// The synchronisation engine.
  const DistributedDataParallel& ddp() const { return ddp_; }

 private:
  // The module's forward; a Sequential's children each through their hooks (FSDP units, split
  // layers, offloaded modules), as accelerate::forward walks it: SequentialImpl::forward would call
  // them past their hooks.
  template <typename... Args>
  auto call(Args&&... args) const {
    auto& impl = *operator->();
    if constexpr (std::is_same_v<std::decay_t<decltype(impl)>, torch::nn::SequentialImpl>) {
      static_assert(sizeof...(Args) == 1, "a prepared Sequential takes one tensor");
      return detail::forward_sequential(impl, at::Tensor(std::forward<Args>(args)...));
    } else {
      return module_->forward(std::forward<Args>(args)...);
    }
  }

  // A tensor argument as the engine passes it on (DistributedDataParallel::cast_forward_input);
  // every other argument as it is.
  template <typename A>
  decltype(auto) input(A&& arg) const {
    if constexpr (std::is_same_v<std::decay_t<A>, at::Tensor>) {
      return ddp_.cast_forward_input(arg);
    } else {
      return std::forward<A>(arg);
    }
  }

  // A handle: calling through a const PreparedModel still runs (and may change) the module,
  // as calling through a const std::shared_ptr does.
  mutable M module_;
  DistributedDataParallel ddp_;
};

/// Whether `T` is a `PreparedModel`.
template <typename T> struct is_prepared_model : std::false_type {};
template <typename M> struct is_prepared_model<PreparedModel<M>> : std::true_type {};

/// `model` without its gradient synchronisation (upstream: `extract_model_from_parallel`, which
/// strips the DDP wrapper): calling the result runs the user's module with no DDP bookkeeping and
/// no communication. With `keep_fp32_wrapper` (the default, as upstream) the forward pass keeps
/// the mixed-precision region and the outputs come back in fp32; without it the module's own
/// forward runs, as upstream's unwrapped model with its original `forward`. The module itself is
/// `result.module()`. (Upstream's `keep_torch_compile` and `recursive` concern torch.compile and
/// XLA wrappers, which LibTorch has not.)
template <typename M>
PreparedModel<M> extract_model_from_parallel(const PreparedModel<M>& model, bool keep_fp32_wrapper = true) {
  return PreparedModel<M>(model.module(), model.ddp().without_synchronisation(keep_fp32_wrapper));
}
/// A model that was never prepared is returned as it is.
template <typename M>
  requires model_detail::is_model_v<M>
const M& extract_model_from_parallel(const M& model, bool /*keep_fp32_wrapper*/ = true) {
  return model;
}

}  // namespace accelerate
