// The optimizer wrapper; see include/accelerate/optimizer.h.
#include "accelerate/optimizer.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>
#include <torch/optim.h>

namespace accelerate {
namespace detail {

struct AcceleratedOptimizerImpl {
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  GradientState gradient_state;
  std::optional<GradScaler> scaler;
  bool step_was_skipped = false;
};

}  // namespace detail

namespace {

void move(at::Tensor& t, c10::Device device) {
  if (t.defined() && t.device() != device) t = t.to(device);
}

// Adam and AdamW keep the same moments in two unrelated state types.
template <typename AdamState>
void move_moments(AdamState& state, c10::Device device) {
  move(state.exp_avg(), device);
  move(state.exp_avg_sq(), device);
  move(state.max_exp_avg_sq(), device);
}

}  // namespace

void move_optimizer_state(torch::optim::Optimizer& optimizer, c10::Device device) {
  for (auto& [key, state] : optimizer.state()) {
    if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(state.get())) {
      move(s->momentum_buffer(), device);
    } else if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(state.get())) {
      move_moments(*a, device);
    } else if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      move_moments(*w, device);
    } else if (auto* g = dynamic_cast<torch::optim::AdagradParamState*>(state.get())) {
      move(g->sum(), device);
    } else if (auto* r = dynamic_cast<torch::optim::RMSpropParamState*>(state.get())) {
      move(r->square_avg(), device);
      move(r->momentum_buffer(), device);
      move(r->grad_avg(), device);
    } else if (auto* l = dynamic_cast<torch::optim::LBFGSParamState*>(state.get())) {
      move(l->d(), device);
      move(l->H_diag(), device);
      move(l->prev_flat_grad(), device);
      for (auto& t : l->old_dirs()) move(t, device);
      for (auto& t : l->old_stps()) move(t, device);
      for (auto& t : l->ro()) move(t, device);
      if (l->al()) {
        for (auto& t : *l->al()) move(t, device);
      }
    } else {
      TORCH_CHECK_VALUE(false, "[AcceleratedOptimizer] cannot move the state of an optimizer of state type ",
                        c10::demangle(typeid(*state).name()), " to ", device,
                        "; prepare it with device_placement off and place its state yourself");
    }
  }
}

AcceleratedOptimizer::AcceleratedOptimizer(std::shared_ptr<torch::optim::Optimizer> optimizer,
                                           const GradientState& gradient_state, std::optional<GradScaler> scaler,
                                           std::optional<c10::Device> device)
    : impl_(std::make_shared<detail::AcceleratedOptimizerImpl>(
          detail::AcceleratedOptimizerImpl{std::move(optimizer), gradient_state, std::move(scaler), false})) {
  TORCH_CHECK_VALUE(impl_->optimizer != nullptr, "[AcceleratedOptimizer] expected an optimizer, got null");
  if (device && !impl_->optimizer->state().empty()) move_optimizer_state(*impl_->optimizer, *device);
}

void AcceleratedOptimizer::step() const {
  if (!impl_->gradient_state.sync_gradients()) return;
  if (impl_->scaler) {
    const bool stepped = impl_->scaler->step(*impl_->optimizer);
    impl_->scaler->update();
    impl_->step_was_skipped = !stepped;
  } else {
    impl_->optimizer->step();
    impl_->step_was_skipped = false;
  }
}

void AcceleratedOptimizer::zero_grad(bool set_to_none) const {
  if (!impl_->gradient_state.sync_gradients()) return;
  for (auto& group : impl_->optimizer->param_groups()) {
    for (auto& p : group.params()) {
      if (!p.mutable_grad().defined()) continue;
      if (set_to_none) {
        p.mutable_grad().reset();
      } else {
        auto& grad = p.mutable_grad();
        if (grad.grad_fn()) {
          grad = grad.detach();
        } else {
          grad.requires_grad_(false);
        }
        grad.zero_();
      }
    }
  }
}

bool AcceleratedOptimizer::step_was_skipped() const { return impl_->step_was_skipped; }
const std::shared_ptr<torch::optim::Optimizer>& AcceleratedOptimizer::optimizer() const { return impl_->optimizer; }
const std::optional<GradScaler>& AcceleratedOptimizer::scaler() const { return impl_->scaler; }
const GradientState& AcceleratedOptimizer::gradient_state() const { return impl_->gradient_state; }

}  // namespace accelerate
