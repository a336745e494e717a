// The optimizer wrapper of prepared training loops (upstream: accelerate/optimizer.py,
// `AcceleratedOptimizer`). During gradient accumulation `step()` and `zero_grad()` do nothing
// until the step that synchronises gradients; with fp16 training the step goes through the
// loss scaler, which skips it when the gradients overflowed (`step_was_skipped()`). Works with
// any `torch::optim::Optimizer`.
//
// Example:
//   auto [model, opt] = accelerator.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
//   accelerator.backward(loss);
//   opt.step();          // a no-op on accumulation steps
//   opt.zero_grad();
#pragma once

#include "accelerate/grad_scaler.h"
#include "accelerate/state.h"

#include <c10/core/Device.h>
#include <torch/optim/optimizer.h>

#include <memory>
#include <optional>
#include <vector>

namespace accelerate {

namespace detail {
struct AcceleratedOptimizerImpl;
}  // namespace detail

/// Moves the state tensors of `optimizer` (momentum buffers, Adam moments, …) to `device`.
/// Knows the optimizers of LibTorch (SGD, Adam, AdamW, Adagrad, RMSprop, LBFGS); any other
/// optimizer with state on another device is refused with an error naming its state type.
void move_optimizer_state(torch::optim::Optimizer& optimizer, c10::Device device);

/// An optimizer that steps only when gradients are synchronised. A cheap handle: copies share the
/// optimizer and the skipped-step flag.
class AcceleratedOptimizer {
 public:
  /// Wraps `optimizer`; `scaler` is the fp16 loss scaler (none otherwise); with `device` the
  /// optimizer's state is moved there (upstream's `device_placement`).
  AcceleratedOptimizer(std::shared_ptr<torch::optim::Optimizer> optimizer, const GradientState& gradient_state,
                       std::optional<GradScaler> scaler = std::nullopt,
                       std::optional<c10::Device> device = std::nullopt);

  /// Steps the optimizer if gradients are synchronised on this step, through the scaler when
  /// there is one (then the step is skipped on inf/NaN gradients and the scale updated).
  void step() const;
  /// Clears the gradients if gradients are synchronised on this step: sets them to undefined
  /// (`set_to_none`, the default as in PyTorch 2) or fills them with zeros.
  void zero_grad(bool set_to_none = true) const;
  /// Whether the last `step()` was skipped because the gradients overflowed.
  bool step_was_skipped() const;

  /// The wrapped optimizer.
  const std::shared_ptr<torch::optim::Optimizer>& optimizer() const;
  /// The wrapped optimizer, by reference.
  torch::optim::Optimizer& operator*() const { return *optimizer(); }
  /// The wrapped optimizer's members.
  torch::optim::Optimizer* operator->() const { return optimizer().get(); }
  /// The optimizer's parameter groups.
  std::vector<torch::optim::OptimizerParamGroup>& param_groups() const { return optimizer()->param_groups(); }
  /// The fp16 loss scaler, if any.
  const std::optional<GradScaler>& scaler() const;
  /// The gradient state that decides when to step.
  const GradientState& gradient_state() const;

 private:
  std::shared_ptr<detail::AcceleratedOptimizerImpl> impl_;
};

}  // namespace accelerate
