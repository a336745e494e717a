// The scheduler wrapper; see include/accelerate/scheduler.h.
#include "accelerate/scheduler.h"

#include <c10/util/Exception.h>

namespace accelerate {

struct AcceleratedScheduler::Impl {
  std::shared_ptr<LRScheduler> scheduler;
  std::vector<AcceleratedOptimizer> optimizers;
  GradientState gradient_state;
  AcceleratedSchedulerOptions options;
};

AcceleratedScheduler::AcceleratedScheduler(std::shared_ptr<LRScheduler> scheduler,
                                           std::vector<AcceleratedOptimizer> optimizers,
                                           const GradientState& gradient_state,
                                           const AcceleratedSchedulerOptions& options)
    : impl_(std::make_shared<Impl>(Impl{std::move(scheduler), std::move(optimizers), gradient_state, options})) {
  TORCH_CHECK_VALUE(impl_->scheduler != nullptr, "[AcceleratedScheduler] expected a scheduler, got null");
  TORCH_CHECK_VALUE(options.num_processes >= 1, "[AcceleratedScheduler] num_processes must be at least 1, got ",
                    options.num_processes);
}

void AcceleratedScheduler::step() const {
  auto& s = *impl_->scheduler;
  if (!impl_->options.step_with_optimizer) {
    s.step();
    return;
  }
  if (!impl_->gradient_state.sync_gradients()) {
    if (impl_->gradient_state.adjust_scheduler()) s.set_step_count(s.step_count() + 1);
    return;
  }
  for (const auto& optimizer : impl_->optimizers) {
    if (optimizer.step_was_skipped()) return;
  }
  if (impl_->options.split_batches) {
    s.step();
    return;
  }
  for (int i = 0; i < impl_->options.num_processes; ++i) {
    // A OneCycle schedule refuses steps past its end, which the repeated steps of a last short
    // epoch could otherwise reach.
    if (auto total = s.total_steps(); total && s.step_count() > *total) continue;
    s.step();
  }
}

const std::shared_ptr<LRScheduler>& AcceleratedScheduler::scheduler() const { return impl_->scheduler; }
const std::vector<AcceleratedOptimizer>& AcceleratedScheduler::optimizers() const { return impl_->optimizers; }
const AcceleratedSchedulerOptions& AcceleratedScheduler::options() const { return impl_->options; }

}  // namespace accelerate
