// Code that runs around a module's forward (upstream: accelerate/hooks.py): moving weights in
// from the CPU or the disk just before a submodule runs and out again after, and moving inputs
// and outputs between devices.
//
// What is covered. Python replaces `module.forward`; LibTorch's `forward` is an ordinary,
// non-virtual member of each module class, so a hook runs only when the call goes through
// `accelerate::forward`:
//   - `accelerate::forward(module, args...)` runs the hook of `module` (if any) around
//     `module->forward(args...)`. A module's own forward reaches its children's hooks by calling
//     them the same way: `x = accelerate::forward(blocks[i], x);` instead of `blocks[i](x)`.
//   - `torch::nn::Sequential` is walked by `accelerate::forward` itself: each element's hook runs,
//     so models built from standard containers and LibTorch layers
//     need no change.
// What is not: a child called directly (`child(x)`, `child->forward(x)`) or whose weights are
// used in a functional call (`F::linear(x, child->weight)`) bypasses the child's hook. If that
// child's weights are offloaded it would compute on the meta device; the outermost hook raises an
// error naming the module when an output comes back on the meta device. For such modules pass
// their class in `preload_module_classes` (their whole subtree is loaded around their own call).
#pragma once

#include "accelerate/utils/offload.h"
#include "accelerate/utils/tensor_tree.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace accelerate {

/// Code run around a module's forward (upstream: `ModelHook`). The tensors of the call's
/// arguments and of its result are handed over flattened (in `flatten_tensors` order) and may be
/// replaced in place.
class ModelHook {
 public:
  virtual ~ModelHook() = default;
  /// Runs once when the hook is attached.
  virtual void init_hook(torch::nn::Module& module) { (void)module; }
  /// Runs before the forward; may replace the input tensors.
  virtual void pre_forward(torch::nn::Module& module, std::vector<at::Tensor>& inputs) {
    (void)module;
    (void)inputs;
  }
  /// Runs after the forward; may replace the output tensors.
  virtual void post_forward(torch::nn::Module& module, std::vector<at::Tensor>& outputs) {
    (void)module;
    (void)outputs;
  }
  /// Runs when the hook is removed, to undo what `init_hook` did.
  virtual void detach_hook(torch::nn::Module& module) { (void)module; }
  /// Whether the module's activations are recomputed in the backward pass instead of kept
  /// (activation checkpointing; upstream wraps the module in PyTorch's non-reentrant
  /// `checkpoint_wrapper`). When true and gradients are recorded, `accelerate::forward` runs the
  /// module's forward without recording, keeping only its inputs, and runs it again during the
  /// backward pass, with the random generators and the autocast state of the first run, before
  /// back-propagating through it. The hook's `pre_forward` and `post_forward` run once, around
  /// the first run.
  virtual bool checkpoints_activations() const { return false; }
};

/// Several hooks run in order (upstream: `SequentialHook`).
class SequentialHook : public ModelHook {
 public:
  explicit SequentialHook(std::vector<std::shared_ptr<ModelHook>> hooks);
  void init_hook(torch::nn::Module& module) override;
  void pre_forward(torch::nn::Module& module, std::vector<at::Tensor>& inputs) override;
  void post_forward(torch::nn::Module& module, std::vector<at::Tensor>& outputs) override;
  void detach_hook(torch::nn::Module& module) override;
  /// True when any of the hooks checkpoints activations.
  bool checkpoints_activations() const override;
  const std::vector<std::shared_ptr<ModelHook>>& hooks() const { return hooks_; }

 private:
  std::vector<std::shared_ptr<ModelHook>> hooks_;
};

/// Reads the weights of the next offloaded module while the current one computes (upstream reads
/// each module's weights only when it runs). The offloading hooks that share one learn the order
/// in which their modules run during the first forward pass; from then on each hook, before its
/// module runs, starts reading the weights of the module expected next on a background thread
/// (after the last module, the first). At most one module's weights are read ahead, so the model
/// holds at most two offloaded modules' weights at a time, plus one released buffer kept for
/// reuse (see `own`). A module that runs out of the learned order reads its own weights, as
/// without prefetching; a module never seen before restarts the learning. `dispatch_model`,
/// `cpu_offload` and `disk_offload` give their hooks one.
///
/// Example:
///   auto prefetcher = std::make_shared<accelerate::OffloadPrefetcher>();
///   accelerate::attach_align_device_hook(*model, c10::kCPU, /*offload=*/true, weights, false, "", {}, prefetcher);
class OffloadPrefetcher {
 public:
  /// Reads the weights of one module, in the order of its hook's tensor names.
  using Loader = std::function<std::vector<at::Tensor>()>;

  OffloadPrefetcher();
  OffloadPrefetcher(const OffloadPrefetcher&) = delete;
  OffloadPrefetcher& operator=(const OffloadPrefetcher&) = delete;
  /// Waits for a read in flight and stops the background thread.
  ~OffloadPrefetcher();

  /// Called by the hook `key` before its module runs, with the function that reads its weights:
  /// returns them when they were read ahead (waiting for the read to finish), nothing otherwise,
  /// and starts reading the weights of the module expected next.
  std::optional<std::vector<at::Tensor>> arrive(const void* key, Loader load);
  /// An owned copy of the CPU tensor `weight` for a hook to put in its module. Large copies live in
  /// memory that the prefetcher recycles between modules instead of the heap (see Note [Recycled
  /// weight buffers] in src/hooks.cpp); others are plain clones.
  at::Tensor own(const at::Tensor& weight) const;
  /// How many `arrive` calls were served by a read ahead (for tests and benchmarks).
  int64_t hits() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Options of `AlignDevicesHook` (upstream's constructor arguments).
struct AlignDevicesOptions {
  /// Where inputs and weights go before the forward (unset: left where they are).
  std::optional<c10::Device> execution_device{};
  /// Put the weights on the meta device after each forward and load them from `weights_map`
  /// before the next.
  bool offload = false;
  /// Move the outputs back to the device of the first input tensor.
  bool io_same_device = false;
  /// Where offloaded weights are read from, by name relative to the module; unset: the module's
  /// current weights, copied to the CPU when the hook is attached.
  std::shared_ptr<const WeightsMap> weights_map{};
  /// Offload buffers too (otherwise they stay on the execution device).
  bool offload_buffers = false;
  /// Act on the tensors of all submodules, not only the module's own.
  bool place_submodules = false;
  /// Shared by the offloading hooks of one model: reads the next module's weights ahead (unset:
  /// each module reads its own when it runs, as upstream).
  std::shared_ptr<OffloadPrefetcher> prefetcher{};
};

/// Keeps a module's weights and inputs on one device, optionally offloading the weights between
/// calls (upstream: `AlignDevicesHook`).
class AlignDevicesHook : public ModelHook {
 public:
  explicit AlignDevicesHook(AlignDevicesOptions options = {});
  void init_hook(torch::nn::Module& module) override;
  void pre_forward(torch::nn::Module& module, std::vector<at::Tensor>& inputs) override;
  void post_forward(torch::nn::Module& module, std::vector<at::Tensor>& outputs) override;
  void detach_hook(torch::nn::Module& module) override;
  const AlignDevicesOptions& options() const { return options_; }

 private:
  std::vector<std::string> offloaded_names(const torch::nn::Module& module) const;
  AlignDevicesOptions options_;
  std::vector<std::pair<std::string, c10::Device>> original_devices_;
  std::optional<c10::Device> input_device_;
};

/// Attaches `hook` to `module` and runs its `init_hook` (upstream: `add_hook_to_module`). With
/// `append` an existing hook is kept and both run, the existing one first; otherwise it is
/// replaced (without its `detach_hook`, as upstream).
void add_hook_to_module(torch::nn::Module& module, std::shared_ptr<ModelHook> hook, bool append = false);

/// The hook attached to `module`, or null.
std::shared_ptr<ModelHook> get_hook(const torch::nn::Module& module);

/// Runs the hook's `detach_hook` and removes it; with `recurse`, from every submodule too
/// (upstream: `remove_hook_from_module`).
void remove_hook_from_module(torch::nn::Module& module, bool recurse = false);

/// Removes the hooks of every submodule of `module` (not of `module` itself) (upstream:
/// `remove_hook_from_submodules`).
void remove_hook_from_submodules(torch::nn::Module& module);

/// Attaches an `AlignDevicesHook` to every submodule that holds tensors directly, reading
/// offloaded weights under "<module_name>.<name>" (upstream: `attach_align_device_hook`).
/// Modules whose class is in `preload_module_classes` get one hook for their whole subtree.
/// Offloading hooks share `prefetcher` when one is given.
void attach_align_device_hook(torch::nn::Module& module, std::optional<c10::Device> execution_device,
                              bool offload = false, std::shared_ptr<const WeightsMap> weights_map = nullptr,
                              bool offload_buffers = false, const std::string& module_name = "",
                              const std::vector<std::string>& preload_module_classes = {},
                              std::shared_ptr<OffloadPrefetcher> prefetcher = nullptr);

/// Attaches a non-offloading `AlignDevicesHook` on `execution_device` to every submodule that
/// holds tensors and has no hook yet (upstream: `attach_execution_device_hook`).
void attach_execution_device_hook(torch::nn::Module& module, const c10::Device& execution_device,
                                  const std::vector<std::string>& preload_module_classes = {});

/// The hooks of `dispatch_model`: per submodule name, its execution device and whether its
/// weights are offloaded (upstream: `attach_align_device_hook_on_blocks`).
void attach_align_device_hook_on_blocks(torch::nn::Module& module,
                                        const std::map<std::string, c10::Device>& execution_device,
                                        const std::map<std::string, bool>& offload,
                                        std::shared_ptr<const WeightsMap> weights_map = nullptr,
                                        bool offload_buffers = false, const std::string& module_name = "",
                                        const std::vector<std::string>& preload_module_classes = {},
                                        std::shared_ptr<OffloadPrefetcher> prefetcher = nullptr);

namespace detail {

template <typename M>
decltype(auto) module_impl(M&& module) {
  using D = std::decay_t<M>;
  if constexpr (std::is_base_of_v<torch::nn::Module, D>) {
    return (module);
  } else {
    return *module;  // ModuleHolder or shared_ptr
  }
}

/// Runs `module`'s hook around `call`, which takes the (possibly replaced) arguments.
void run_pre_hook(ModelHook& hook, torch::nn::Module& module, std::vector<at::Tensor>& tensors);
void run_post_hook(ModelHook& hook, torch::nn::Module& module, std::vector<at::Tensor>& tensors);

at::Tensor forward_sequential(torch::nn::SequentialImpl& sequential, at::Tensor input);

/// Called from a catch block around a hooked forward: rethrows the error, explained when `module`
/// still has tensors on the meta device (an offloaded child ran without its hook).
[[noreturn]] void rethrow_forward_error(const torch::nn::Module& module);

/// `impl.forward(args...)` with the arguments held in the tuple `args`.
template <typename Impl, typename Tuple>
decltype(auto) call_forward(Impl& impl, Tuple& args) {
  return std::apply([&](auto&... a) { return impl.forward(a...); }, args);
}

/// A module's forward on flattened input tensors, giving its flattened output tensors.
using FlatForward = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// Whether `accelerate::forward` should checkpoint the activations of a module with `hook` now
/// (the hook asks for it and gradients are being recorded).
bool should_checkpoint(const ModelHook& hook);

/// Runs `run` on `inputs` without recording gradients and returns its outputs attached to an
/// autograd node that, in the backward pass, runs `run` again with gradients recorded (random
/// generators and autocast as in the first run) and back-propagates through it (see
/// `ModelHook::checkpoints_activations`). Where neither an input nor a parameter of `module`
/// requires a gradient it simply runs `run`.
std::vector<at::Tensor> checkpointed_forward(torch::nn::Module& module, std::vector<at::Tensor> inputs,
                                             FlatForward run);

/// Whether the calling thread is running a checkpointed forward again in a backward pass (hooks
/// use it to tell a recomputation from a new forward).
bool recomputing_activations();

/// The checkpointed path of `accelerate::forward`: the hook's `pre_forward` has run and replaced
/// `inputs`; the forward runs through `checkpointed_forward`, then the hook's `post_forward`.
template <typename Impl, typename Copies>
auto forward_checkpointed(Impl& impl, ModelHook& hook, const Copies& copies, std::vector<at::Tensor> inputs) {
  using Output = std::decay_t<decltype(call_forward(impl, std::declval<Copies&>()))>;
  // What the closure keeps: the arguments' structure without their tensors (the inputs are saved
  // by the autograd node), the module, and the first run's result until it is handed back here.
  struct First {
    std::optional<Output> output;
    bool taken = false;
  };
  auto skeleton = unflatten_tensors(copies, std::vector<at::Tensor>(inputs.size()));
  auto first = std::make_shared<First>();
  std::shared_ptr<torch::nn::Module> keep = static_cast<torch::nn::Module&>(impl).weak_from_this().lock();
  Impl* module = &impl;
  FlatForward run = [skeleton, first, keep, module](const std::vector<at::Tensor>& in) {
    auto args = unflatten_tensors(skeleton, in);
    auto result = [&]() {
      try {
        return call_forward(*module, args);
      } catch (const std::exception&) {
        rethrow_forward_error(*module);
      }
    }();
    auto flat = flatten_tensors(result);
    if (!first->taken) {
      first->output.emplace(std::move(result));
      first->taken = true;
    }
    return flat;
  };
  auto outputs = checkpointed_forward(impl, std::move(inputs), std::move(run));
  Output shape = std::move(*first->output);
  first->output.reset();
  run_post_hook(hook, impl, outputs);
  return unflatten_tensors(shape, outputs);
}

}  // namespace detail

/// Calls `module->forward(args...)` with `module`'s hook (if any) around it. `module` may be a
/// module holder (`torch::nn::Linear`, a `TORCH_MODULE` type), a `shared_ptr` or a reference.
/// Arguments and the result may be any structure `flatten_tensors` walks.
template <typename M, typename... Args>
auto forward(M&& module, Args&&... args) {
  auto& impl = detail::module_impl(std::forward<M>(module));
  using Impl = std::decay_t<decltype(impl)>;
  if constexpr (std::is_same_v<Impl, torch::nn::SequentialImpl>) {
    static_assert(sizeof...(Args) == 1, "accelerate::forward on a Sequential takes one tensor");
    return detail::forward_sequential(impl, at::Tensor(std::forward<Args>(args)...));
  } else {
    auto hook = get_hook(impl);
    if (!hook) return impl.forward(std::forward<Args>(args)...);
    std::tuple<std::decay_t<Args>...> copies(std::forward<Args>(args)...);
    auto inputs = flatten_tensors(copies);
    detail::run_pre_hook(*hook, impl, inputs);
    if (detail::should_checkpoint(*hook)) return detail::forward_checkpointed(impl, *hook, copies, std::move(inputs));
    copies = unflatten_tensors(copies, inputs);
    auto call = [&]() {
      try {
        return std::apply([&](auto&... a) { return impl.forward(a...); }, copies);
      } catch (const std::exception&) {
        detail::rethrow_forward_error(impl);
      }
    };
    auto output = call();
    auto outputs = flatten_tensors(output);
    detail::run_post_hook(*hook, impl, outputs);
    return unflatten_tensors(output, outputs);
  }
}

}  // namespace accelerate
