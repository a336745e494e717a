// Dynamic loss scaling; see include/accelerate/grad_scaler.h.
#include "accelerate/grad_scaler.h"

#include "detail/collectives.h"
#include "grad_scaler_impl.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace accelerate {
namespace detail {

// Where an optimizer stands within one step (PyTorch's OptState).
enum class ScalerStage { kReady, kUnscaled, kStepped };

struct OptimizerRecord {
  ScalerStage stage = ScalerStage::kReady;
  bool found_inf = false;
};

struct GradScalerImpl {
  GradScalerKwargs kwargs;
  double scale = 1.0;
  int64_t growth_tracker = 0;
  std::mutex mutex;
  std::unordered_map<const torch::optim::Optimizer*, OptimizerRecord> optimizers;
  // With sharded gradients each process checks only its rows: the processes agree on overflow.
  std::optional<PartialState> shared_checks;
};

void share_inf_checks(const GradScaler& scaler, const PartialState& state) { scaler.impl()->shared_checks = state; }

}  // namespace detail

namespace {

std::vector<at::Tensor> gradients_of(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (p.grad().defined()) grads.push_back(p.mutable_grad());
    }
  }
  return grads;
}

// Divides every gradient by the scale (in fp32, as PyTorch computes the inverse) and reports
// whether any element is inf or NaN. As in PyTorch's GradScaler, gradients are unscaled per
// device and dtype: CUDA's fused kernel takes the tensors of one device, with the inverse scale
// and the flag on that device (an optimizer may hold parameters on the GPU and on the CPU).
bool unscale_and_check(std::vector<at::Tensor>& grads, double scale) {
  const float inv_scale = static_cast<float>(1.0 / scale);
  struct Group {
    c10::Device device;
    c10::ScalarType dtype;
    std::vector<at::Tensor> grads;
  };
  std::vector<Group> groups;
  for (auto& g : grads) {
    TORCH_CHECK_VALUE(!g.is_sparse(), "[GradScaler.unscale_] sparse gradients are not supported");
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& group) {
      return group.device == g.device() && group.dtype == g.scalar_type();
    });
    if (it == groups.end()) it = groups.insert(groups.end(), Group{g.device(), g.scalar_type(), {}});
    it->grads.push_back(g);
  }
  at::NoGradGuard no_grad;
  bool found_any = false;
  for (auto& group : groups) {
    const auto options = at::TensorOptions().device(group.device).dtype(at::kFloat);
    if (group.device.is_cuda()) {
      auto found = at::zeros({1}, options);
      auto inv = at::full({1}, inv_scale, options);
      at::_amp_foreach_non_finite_check_and_unscale_(group.grads, found, inv);
      found_any = found.item<float>() != 0.0f || found_any;
      continue;
    }
    auto found = at::zeros({}, options.dtype(at::kBool));
    for (auto& g : group.grads) {
      g.mul_(inv_scale);
      found.logical_or_(g.isfinite().logical_not().any());
    }
    found_any = found.item<bool>() || found_any;
  }
  return found_any;
}

}  // namespace

GradScaler::GradScaler(const GradScalerKwargs& kwargs) : impl_(std::make_shared<detail::GradScalerImpl>()) {
  TORCH_CHECK_VALUE(kwargs.init_scale > 0 && std::isfinite(kwargs.init_scale),
                    "[GradScaler] init_scale must be a positive finite number, got ", kwargs.init_scale);
  TORCH_CHECK_VALUE(kwargs.growth_factor > 1.0, "[GradScaler] growth_factor must be greater than 1, got ",
                    kwargs.growth_factor);
  TORCH_CHECK_VALUE(kwargs.backoff_factor > 0.0 && kwargs.backoff_factor < 1.0,
                    "[GradScaler] backoff_factor must be in (0, 1), got ", kwargs.backoff_factor);
  TORCH_CHECK_VALUE(kwargs.growth_interval > 0, "[GradScaler] growth_interval must be positive, got ",
                    kwargs.growth_interval);
  impl_->kwargs = kwargs;
  impl_->scale = kwargs.enabled ? kwargs.init_scale : 1.0;
}

bool GradScaler::is_enabled() const { return impl_->kwargs.enabled; }

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  if (!impl_->kwargs.enabled) return loss;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return loss * impl_->scale;
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) const {
  if (!impl_->kwargs.enabled) return;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto& record = impl_->optimizers[&optimizer];
  TORCH_CHECK(record.stage != detail::ScalerStage::kUnscaled,
              "[GradScaler.unscale_] unscale_() was already called on this optimizer since the last update()");
  TORCH_CHECK(record.stage != detail::ScalerStage::kStepped,
              "[GradScaler.unscale_] unscale_() is being called after step() without an update() in between");
  auto grads = gradients_of(optimizer);
  record.found_inf = unscale_and_check(grads, impl_->scale);
  if (impl_->shared_checks && impl_->shared_checks->use_distributed()) {
    // Every process unscales at the same step (a sharded model's optimizer steps together).
    auto flag = at::tensor({record.found_inf ? 1.0f : 0.0f});
    record.found_inf =
        detail::all_reduce(*impl_->shared_checks, flag, detail::Reduction::kMax, "GradScaler.unscale_").item<float>() > 0;
  }
  record.stage = detail::ScalerStage::kUnscaled;
}

bool GradScaler::is_unscaled(const torch::optim::Optimizer& optimizer) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  auto it = impl_->optimizers.find(&optimizer);
  return it != impl_->optimizers.end() && it->second.stage == detail::ScalerStage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) const {
  if (!impl_->kwargs.enabled) {
    optimizer.step();
    return true;
  }
  bool found_inf = false;
  {
    std::unique_lock<std::mutex> lock(impl_->mutex);
    auto stage = impl_->optimizers[&optimizer].stage;
    TORCH_CHECK(stage != detail::ScalerStage::kStepped,
                "[GradScaler.step] step() was already called on this optimizer since the last update()");
    if (stage == detail::ScalerStage::kReady) {
      lock.unlock();
      unscale_(optimizer);
      lock.lock();
    }
    auto& record = impl_->optimizers[&optimizer];
    found_inf = record.found_inf;
    record.stage = detail::ScalerStage::kStepped;
  }
  if (found_inf) return false;
  optimizer.step();
  return true;
}

void GradScaler::update() const {
  if (!impl_->kwargs.enabled) return;
  std::lock_guard<std::mutex> lock(impl_->mutex);
  bool recorded = false;
  bool found_inf = false;
  for (const auto& [optimizer, record] : impl_->optimizers) {
    if (record.stage == detail::ScalerStage::kReady) continue;
    recorded = true;
    found_inf = found_inf || record.found_inf;
  }
  TORCH_CHECK(recorded, "[GradScaler.update] no inf checks were recorded before update(): call step() or unscale_() "
                        "on an optimizer first");
  const auto& k = impl_->kwargs;
  if (found_inf) {
    impl_->scale *= k.backoff_factor;
    impl_->growth_tracker = 0;
  } else if (++impl_->growth_tracker == k.growth_interval) {
    // PyTorch keeps the scale when growing it would overflow to infinity.
    const double grown = impl_->scale * k.growth_factor;
    if (std::isfinite(static_cast<float>(grown))) impl_->scale = grown;
    impl_->growth_tracker = 0;
  }
  impl_->optimizers.clear();
}

void GradScaler::update(double new_scale) const {
  if (!impl_->kwargs.enabled) return;
  TORCH_CHECK_VALUE(new_scale > 0 && std::isfinite(new_scale), "[GradScaler.update] new_scale must be a positive "
                                                              "finite number, got ", new_scale);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->scale = new_scale;
  impl_->growth_tracker = 0;
  impl_->optimizers.clear();
}

double GradScaler::get_scale() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->scale;
}

int64_t GradScaler::get_growth_tracker() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->growth_tracker;
}

const GradScalerKwargs& GradScaler::kwargs() const { return impl_->kwargs; }

nlohmann::json GradScaler::state_dict() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  if (!impl_->kwargs.enabled) return nlohmann::json::object();
  return {{"scale", impl_->scale},
          {"growth_factor", impl_->kwargs.growth_factor},
          {"backoff_factor", impl_->kwargs.backoff_factor},
          {"growth_interval", impl_->kwargs.growth_interval},
          {"_growth_tracker", impl_->growth_tracker}};
}

void GradScaler::load_state_dict(const nlohmann::json& state) const {
  TORCH_CHECK_VALUE(state.is_object(), "[GradScaler.load_state_dict] expected a JSON object, got ", state.type_name());
  if (!impl_->kwargs.enabled) return;
  TORCH_CHECK_VALUE(!state.empty(), "[GradScaler.load_state_dict] the state is empty: it was saved from a disabled "
                                    "scaler");
  auto number = [&](const char* key) {
    TORCH_CHECK_VALUE(state.contains(key) && state.at(key).is_number(), "[GradScaler.load_state_dict] key '", key,
                      "' is missing or not a number");
    return state.at(key).get<double>();
  };
  const double scale = number("scale");
  const double growth = number("growth_factor");
  const double backoff = number("backoff_factor");
  const double interval = number("growth_interval");
  const double tracker = number("_growth_tracker");
  TORCH_CHECK_VALUE(scale > 0 && std::isfinite(scale), "[GradScaler.load_state_dict] 'scale' must be positive, got ",
                    scale);
  TORCH_CHECK_VALUE(growth > 1 && backoff > 0 && backoff < 1 && interval >= 1 && tracker >= 0,
                    "[GradScaler.load_state_dict] expected growth_factor > 1, backoff_factor in (0, 1), "
                    "growth_interval >= 1 and _growth_tracker >= 0, got ", growth, ", ", backoff, ", ", interval,
                    ", ", tracker);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->scale = scale;
  impl_->kwargs.growth_factor = growth;
  impl_->kwargs.backoff_factor = backoff;
  impl_->kwargs.growth_interval = static_cast<int64_t>(interval);
  impl_->growth_tracker = static_cast<int64_t>(tracker);
}

GradScaler get_grad_scaler(std::optional<DistributedType> /*distributed_type*/, const GradScalerKwargs& kwargs) {
  return GradScaler(kwargs);
}

}  // namespace accelerate
