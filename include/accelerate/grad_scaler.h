// Dynamic loss scaling for fp16 training (upstream uses `torch.amp.GradScaler`, which LibTorch's
// C++ API lacks). The loss is multiplied by a large scale before the backward pass so that small
// fp16 gradients do not flush to zero; before the optimizer step the gradients are divided by the
// scale again and checked: a step with an inf or NaN gradient is skipped and the scale shrinks
// (`backoff_factor`), and after `growth_interval` clean steps in a row it grows (`growth_factor`).
// Same rules and same state as PyTorch's scaler, so a scale sequence can be compared with it.
//
// Example:
//   accelerate::GradScaler scaler({.init_scale = 1024});
//   scaler.scale(loss).backward();
//   scaler.step(*optimizer);      // unscales, skips the step on inf/NaN
//   scaler.update();              // backs off or grows the scale
#pragma once

#include "accelerate/utils/dataclasses.h"

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

#include <memory>
#include <optional>

namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace accelerate {

namespace detail {
struct GradScalerImpl;
}  // namespace detail

/// A dynamic loss scaler. A cheap handle: copies share the scale and the per-step bookkeeping.
class GradScaler {
 public:
  /// A scaler with the given settings; refuses non-positive scales and factors that do not
  /// shrink (`backoff_factor` in (0, 1)) or grow (`growth_factor` > 1).
  explicit GradScaler(const GradScalerKwargs& kwargs = {});

  /// Whether scaling is on (`GradScalerKwargs::enabled`).
  bool is_enabled() const;
  /// `loss` multiplied by the current scale (unchanged when disabled).
  at::Tensor scale(const at::Tensor& loss) const;
  /// Divides the gradients of `optimizer`'s parameters by the scale and records whether any is
  /// inf or NaN. At most once per optimizer between two `update()` calls (a second call raises,
  /// as PyTorch's does); `is_unscaled` tells whether it happened.
  void unscale_(torch::optim::Optimizer& optimizer) const;
  /// Whether `unscale_` ran for `optimizer` since the last `update()`.
  bool is_unscaled(const torch::optim::Optimizer& optimizer) const;
  /// Unscales if needed, then steps `optimizer` unless its gradients had an inf or NaN.
  /// Returns whether the optimizer stepped.
  bool step(torch::optim::Optimizer& optimizer) const;
  /// Backs the scale off if any optimizer found an inf/NaN since the last update, else counts a
  /// clean step and grows the scale every `growth_interval` clean steps. Needs at least one
  /// `unscale_`/`step` since the last update.
  void update() const;
  /// Sets the scale to `new_scale` and restarts the growth count.
  void update(double new_scale) const;

  /// The current scale (1 when disabled).
  double get_scale() const;
  /// Clean steps in a row since the scale last changed.
  int64_t get_growth_tracker() const;
  /// The settings.
  const GradScalerKwargs& kwargs() const;

  /// The scaler's state as PyTorch names it: scale, growth_factor, backoff_factor,
  /// growth_interval, _growth_tracker.
  nlohmann::json state_dict() const;
  /// Restores `state_dict()`'s output; raises a ValueError naming a missing or ill-typed key.
  void load_state_dict(const nlohmann::json& state) const;

  /// Implementation access for the library itself.
  const std::shared_ptr<detail::GradScalerImpl>& impl() const { return impl_; }

 private:
  std::shared_ptr<detail::GradScalerImpl> impl_;
};

/// The loss scaler for fp16 training with `kwargs` (upstream: `get_grad_scaler`, which picks the
/// scaler class of the device and, for FSDP, the sharded one). accelerate-cpp has one scaler
/// class for every device and distributed type (`DistributedType` has no FSDP), so
/// `distributed_type` does not change the result; it is taken for upstream's signature.
/// `Accelerator` builds its scaler (fp16 on CUDA) with this function.
GradScaler get_grad_scaler(std::optional<DistributedType> distributed_type = std::nullopt,
                           const GradScalerKwargs& kwargs = {});

}  // namespace accelerate
