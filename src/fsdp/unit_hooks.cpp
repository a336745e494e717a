// What runs around each unit of the engine: the hook on its module's forward, the autograd node
// that marks the end of its backward, and the hooks on its outputs' gradients.
#include "fsdp/engine_impl.h"

#include "detail/autograd_function.h"

#include <torch/csrc/autograd/custom_function.h>

namespace accelerate::detail::fsdp {
namespace {

// Marks the backward end of a unit: an identity on its inputs whose backward runs once the
// gradients of everything the unit computed from them are known.
struct UnitInputNode : torch::autograd::Function<UnitInputNode> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                int64_t engine, int64_t unit) {
    ctx->saved_data["engine"] = c10::IValue(engine);
    ctx->saved_data["unit"] = c10::IValue(unit);
    return inputs.vec();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* impl = reinterpret_cast<FsdpEngineImpl*>(static_cast<intptr_t>(ctx->saved_data["engine"].toInt()));
    const auto unit = static_cast<size_t>(ctx->saved_data["unit"].toInt());
    auto& u = impl->units[unit];
    if (u.pending_input_nodes > 0 && --u.pending_input_nodes == 0) impl->post_backward(unit);
    grads.emplace_back();
    grads.emplace_back();
    return grads;
  }
};

// Runs around the forward of a wrapped submodule.
class UnitHook final : public ModelHook {
 public:
  UnitHook(std::weak_ptr<FsdpEngineImpl> engine, size_t unit) : engine_(std::move(engine)), unit_(unit) {}

  void pre_forward(torch::nn::Module& module, std::vector<at::Tensor>& inputs) override {
    (void)module;
    auto e = engine_.lock();
    if (!e) return;
    auto& u = e->units[unit_];
    u.hooked_pass = e->pass;
    e->gather(u);
    // A recomputation in the backward pass (Note [Activation checkpointing]) is not a forward:
    // it neither extends the order that prefetching follows nor prefetches.
    if (at::GradMode::is_enabled() && !recomputing_activations()) {
      e->forward_order.push_back(unit_);
      if (e->settings.forward_prefetch) {
        if (auto next = FsdpEngineImpl::neighbour(e->last_forward_order, unit_, /*after=*/true)) {
          if (e->start_gather(e->units[*next])) ++e->forward_prefetches;
        }
      }
    }
    for (auto& input : inputs) input = e->cast_input(input);
    if (!at::GradMode::is_enabled()) return;
    std::vector<size_t> positions;
    std::vector<at::Tensor> differentiable;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].defined() && inputs[i].requires_grad()) {
        positions.push_back(i);
        differentiable.push_back(inputs[i]);
      }
    }
    if (differentiable.empty()) return;  // the end of the backward pass reduces this unit
    auto routed = apply_function<UnitInputNode>(at::TensorList(differentiable),
                                                static_cast<int64_t>(reinterpret_cast<intptr_t>(e.get())),
                                                static_cast<int64_t>(unit_));
    for (size_t i = 0; i < positions.size(); ++i) inputs[positions[i]] = routed[i];
    ++u.pending_input_nodes;
  }

  void post_forward(torch::nn::Module& module, std::vector<at::Tensor>& outputs) override {
    (void)module;
    auto e = engine_.lock();
    if (!e) return;
    auto& u = e->units[unit_];
    if (at::GradMode::is_enabled()) arm_outputs(e, unit_, outputs);
    if (e->settings.reshard_after_forward || !at::GradMode::is_enabled()) e->reshard(u);
  }

  // Units other than the root are checkpointed when the plugin asks for it (upstream applies
  // the checkpoint wrapper to the modules its auto-wrap policy selects).
  bool checkpoints_activations() const override {
    auto e = engine_.lock();
    return e && e->settings.activation_checkpointing;
  }

 private:
  std::weak_ptr<FsdpEngineImpl> engine_;
  size_t unit_;
};

}  // namespace

void arm_outputs(const std::shared_ptr<FsdpEngineImpl>& impl, size_t unit, const std::vector<at::Tensor>& outputs) {
  std::weak_ptr<FsdpEngineImpl> weak = impl;
  // The root's outputs take the gradient into the model: divided there (Note [The gradient divisor]).
  const double divisor = unit == 0 ? impl->gradient_divisor : 1;
  for (const auto& t : outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    at::Tensor handle = t;
    handle.register_hook([weak, unit, divisor](const at::Tensor& grad) {
      if (auto e = weak.lock()) e->pre_backward(unit);
      return divisor == 1 ? grad : grad / divisor;
    });
  }
}

std::shared_ptr<ModelHook> unit_hook(std::weak_ptr<FsdpEngineImpl> engine, size_t unit) {
  return std::make_shared<UnitHook>(std::move(engine), unit);
}

}  // namespace accelerate::detail::fsdp
