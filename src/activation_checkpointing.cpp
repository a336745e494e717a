// Activation checkpointing (upstream: the checkpoint wrapper PyTorch's FSDP and
// `gradient_checkpointing` apply, non-reentrant): the forward of a module whose hook asks for it
// runs without keeping its activations, and again in the backward pass. `accelerate::forward`
// reaches it through `detail::checkpointed_forward`, declared in include/accelerate/hooks.h
// beside the templates that call it.
#include "accelerate/hooks.h"
#include "context_parallel/ring_attention.h"

#include "detail/autograd_function.h"
#include "detail/torch_compat.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>

#include <algorithm>

namespace accelerate::detail {

// Note [Activation checkpointing]
// A checkpointed module runs twice: once in the forward pass, without recording gradients, so
// that none of its intermediate tensors outlive the call (only its inputs are kept, saved by the
// autograd node its outputs hang from), and again when the backward pass reaches that node, with
// gradients recorded, from the saved inputs detached. The node then back-propagates the output
// gradients through the recomputed graph with a nested backward pass, which accumulates the
// gradients of the module's parameters (and of any other leaf it used) into their `.grad` as the
// ordinary graph would, and hands the gradients of the detached inputs on as its own. This is
// PyTorch's checkpointing; the parameters' gradients arrive through their own hooks, so engines
// that act on them (the fully sharded engine's reductions) see the same events as without.
// The recomputation must compute what the first run did: the default random generators of the
// devices involved are set back to their state before the first run (and restored afterwards),
// and autocast is set as it was, with its cast cache off so that no cast outlives the recompute.
// When no input requires a gradient (token ids into an embedding) the node still has to exist
// for the parameters' sake: an empty leaf that requires a gradient is passed along as an anchor,
// and receives none.
namespace {

thread_local int recompute_depth = 0;

struct DeviceRandomState {
  at::Generator generator;
  at::Tensor state;
};

std::vector<DeviceRandomState> random_states(const std::vector<at::Tensor>& inputs) {
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  for (const auto& t : inputs) {
    if (t.defined() && !t.is_cpu() && !t.is_meta() &&
        std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  std::vector<DeviceRandomState> states;
  for (const auto& device : devices) {
    at::Generator generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    states.push_back({generator, generator.get_state()});
  }
  return states;
}

void set_random_states(const std::vector<DeviceRandomState>& states) {
  for (const auto& s : states) {
    at::Generator generator = s.generator;
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(s.state);
  }
}

struct AutocastState {
  bool enabled;
  c10::ScalarType dtype;
};

AutocastState autocast_state(c10::DeviceType device) {
  return {compat::is_autocast_enabled(device), compat::get_autocast_dtype(device)};
}

void set_autocast_state(c10::DeviceType device, const AutocastState& state) {
  compat::set_autocast_enabled(device, state.enabled);
  compat::set_autocast_dtype(device, state.dtype);
}

// Where the defined tensors of `tensors` sit.
std::vector<size_t> defined_positions(const std::vector<at::Tensor>& tensors) {
  std::vector<size_t> at;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].defined()) at.push_back(i);
  }
  return at;
}

// What a checkpointed call keeps for its recomputation. Undefined tensors (an optional argument
// left empty, an output that is absent) cannot pass through an autograd function, so the node
// sees only the defined ones; `inputs_at`/`outputs_at` say where they sit among all of them.
struct Recompute final : torch::CustomClassHolder {
  FlatForward run;
  std::vector<DeviceRandomState> random;
  AutocastState cpu{};
  AutocastState cuda{};
  std::vector<size_t> inputs_at;
  size_t input_count = 0;
  std::vector<size_t> outputs_at;
  size_t output_count = 0;
  // The context-parallel scope of the first run, if any: the recomputation runs its attention
  // over the same group and pieces, even where the backward pass runs on another thread or after
  // the scope ended.
  std::shared_ptr<const detail::context_parallel::ContextParallelImpl> context_parallel;

  std::vector<at::Tensor> all_inputs(const std::vector<at::Tensor>& defined) const {
    std::vector<at::Tensor> all(input_count);
    for (size_t k = 0; k < defined.size(); ++k) all[inputs_at[k]] = defined[k];
    return all;
  }
};

// Turns autocast's cache of casts off for its lifetime. A cast cached during a run without
// gradients would carry no history, and a later use of the same weight in the same autocast
// region, with gradients, would take it and lose its gradient; the recomputation must not leave
// casts behind either.
class CastCacheOff {
 public:
  CastCacheOff() : was_(at::autocast::is_autocast_cache_enabled()) { at::autocast::set_autocast_cache_enabled(false); }
  ~CastCacheOff() { at::autocast::set_autocast_cache_enabled(was_); }
  CastCacheOff(const CastCacheOff&) = delete;
  CastCacheOff& operator=(const CastCacheOff&) = delete;

 private:
  bool was_;
};

// Sets the autocast state of a first run for a recomputation and puts the caller's back after.
class AutocastAsBefore {
 public:
  explicit AutocastAsBefore(const Recompute& r) : cpu_(autocast_state(c10::kCPU)), cuda_(autocast_state(c10::kCUDA)) {
    set_autocast_state(c10::kCPU, r.cpu);
    set_autocast_state(c10::kCUDA, r.cuda);
  }
  ~AutocastAsBefore() {
    set_autocast_state(c10::kCPU, cpu_);
    set_autocast_state(c10::kCUDA, cuda_);
  }
  AutocastAsBefore(const AutocastAsBefore&) = delete;
  AutocastAsBefore& operator=(const AutocastAsBefore&) = delete;

 private:
  AutocastState cpu_;
  AutocastState cuda_;
};

// The random generators of a first run for a recomputation; the caller's come back after, and
// the recomputation depth goes down, even when the recomputation throws.
class RandomAsBefore {
 public:
  explicit RandomAsBefore(const Recompute& r) {
    for (const auto& before : r.random) {
      at::Generator generator = before.generator;
      std::lock_guard<std::mutex> lock(generator.mutex());
      callers_.push_back({generator, generator.get_state()});
    }
    ++recompute_depth;
    try {
      set_random_states(r.random);
    } catch (...) {
      --recompute_depth;
      set_random_states(callers_);
      throw;
    }
  }
  ~RandomAsBefore() {
    --recompute_depth;
    set_random_states(callers_);
  }
  RandomAsBefore(const RandomAsBefore&) = delete;
  RandomAsBefore& operator=(const RandomAsBefore&) = delete;

 private:
  std::vector<DeviceRandomState> callers_;
};

struct CheckpointNode : torch::autograd::Function<CheckpointNode> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                at::TensorList anchor, c10::intrusive_ptr<Recompute> recompute) {
    (void)anchor;
    ctx->save_for_backward(inputs.vec());
    const auto outputs = recompute->run(recompute->all_inputs(inputs.vec()));
    recompute->output_count = outputs.size();
    recompute->outputs_at = defined_positions(outputs);
    std::vector<at::Tensor> defined;
    for (const size_t i : recompute->outputs_at) defined.push_back(outputs[i]);
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(std::move(recompute));
    return defined;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The nested backward pass accumulates into `.grad`, as `backward()` does; it cannot serve a
    // pass that must leave `.grad` alone or build a graph of its own (as PyTorch's reentrant
    // checkpoint, which refuses the same).
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
                "[activation checkpointing] the gradients of a checkpointed module can only be computed by "
                "backward() without `inputs`: torch::autograd::grad and backward(..., inputs) are not supported");
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "[activation checkpointing] backward with create_graph=true (gradients of gradients) through a "
                "checkpointed module is not supported");
    const auto saved = ctx->get_saved_variables();
    auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    std::vector<at::Tensor> leaves;
    leaves.reserve(saved.size());
    for (const auto& t : saved) {
      leaves.push_back(t.detach());
      if (t.requires_grad()) leaves.back().requires_grad_(true);
    }
    std::vector<at::Tensor> outputs;
    {
      RandomAsBefore random(*recompute);
      AutocastAsBefore autocast(*recompute);
      detail::context_parallel::ActiveScope context_parallel(recompute->context_parallel.get());
      CastCacheOff no_cache;
      at::AutoGradMode record(true);
      outputs = recompute->run(recompute->all_inputs(leaves));
    }
    const auto now_at = defined_positions(outputs);
    TORCH_CHECK(outputs.size() == recompute->output_count && now_at == recompute->outputs_at,
                "[activation checkpointing] the recomputed forward returned ", outputs.size(), " tensors (",
                outputs.size() - now_at.size(), " undefined) where the first run returned ", recompute->output_count, " (",
                recompute->output_count - recompute->outputs_at.size(),
                " undefined): a checkpointed module must compute the same thing when it runs again");
    std::vector<at::Tensor> roots;
    std::vector<at::Tensor> root_grads;
    for (size_t k = 0; k < recompute->outputs_at.size(); ++k) {
      const auto& out = outputs[recompute->outputs_at[k]];
      if (out.requires_grad() && grads[k].defined()) {
        roots.push_back(out);
        root_grads.push_back(grads[k]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    torch::autograd::variable_list result;
    result.reserve(leaves.size() + 2);
    for (const auto& leaf : leaves) result.push_back(leaf.requires_grad() ? leaf.grad() : at::Tensor());
    result.emplace_back();  // the anchor, when there is one (extra undefined gradients are allowed)
    result.emplace_back();  // the recompute
    return result;
  }
};

}  // namespace

bool should_checkpoint(const ModelHook& hook) { return hook.checkpoints_activations() && at::GradMode::is_enabled(); }

bool recomputing_activations() { return recompute_depth > 0; }

std::vector<at::Tensor> checkpointed_forward(torch::nn::Module& module, std::vector<at::Tensor> inputs,
                                             FlatForward run) {
  const bool input_grad = std::any_of(inputs.begin(), inputs.end(),
                                      [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
  bool param_grad = false;
  for (const auto& p : module.parameters()) param_grad = param_grad || p.requires_grad();
  if (!input_grad && !param_grad) return run(inputs);
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->random = random_states(inputs);
  recompute->cpu = autocast_state(c10::kCPU);
  recompute->cuda = autocast_state(c10::kCUDA);
  if (const auto* scope = detail::context_parallel::active_context_parallel()) {
    recompute->context_parallel = scope->shared_from_this();
  }
  recompute->run = std::move(run);
  recompute->input_count = inputs.size();
  recompute->inputs_at = defined_positions(inputs);
  std::vector<at::Tensor> defined;
  for (const size_t i : recompute->inputs_at) defined.push_back(std::move(inputs[i]));
  std::vector<at::Tensor> anchor;
  if (!input_grad) anchor.push_back(at::empty({0}).requires_grad_(true));
  const Recompute& shape = *recompute;
  std::vector<at::Tensor> outputs;
  {
    CastCacheOff no_cache;
    outputs = apply_function<CheckpointNode>(at::TensorList(defined), at::TensorList(anchor), recompute);
  }
  std::vector<at::Tensor> all(shape.output_count);
  for (size_t k = 0; k < outputs.size(); ++k) all[shape.outputs_at[k]] = std::move(outputs[k]);
  return all;
}

}  // namespace accelerate::detail
