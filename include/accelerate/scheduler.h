// The learning-rate scheduler wrapper of prepared training loops (upstream:
// accelerate/scheduler.py, `AcceleratedScheduler`). It steps the scheduler only after a real
// optimizer step: not on accumulation steps, not after an fp16 step skipped for overflow. When
// each process reads whole batches (no `split_batches`), one optimizer step consumes
// `num_processes` batches of the original loader, so the scheduler advances `num_processes`
// times — upstream's rule, which keeps a schedule written for the single-process loader right.
//
// Example:
//   auto sched = accelerate::get_linear_schedule_with_warmup(optimizer, 100, 1000);
//   auto [opt, prepared] = accelerator.prepare(optimizer, sched);
//   opt.step();
//   prepared.step();      // advances only if `opt` really stepped
#pragma once

#include "accelerate/lr_scheduler.h"
#include "accelerate/optimizer.h"
#include "accelerate/state.h"

#include <memory>
#include <vector>

namespace accelerate {

/// Settings of an `AcceleratedScheduler`.
struct AcceleratedSchedulerOptions {
  /// Step together with the optimizers (false: every `step()` steps the scheduler).
  bool step_with_optimizer = true;
  /// Whether data loaders cut each batch across processes (then one scheduler step per step).
  bool split_batches = false;
  /// Processes that each read whole batches (the scheduler steps this many times per step).
  int num_processes = 1;
};

/// A scheduler that follows the optimizer steps that really happened. A cheap handle.
class AcceleratedScheduler {
 public:
  /// Wraps `scheduler`, whose optimizer is among `optimizers`.
  AcceleratedScheduler(std::shared_ptr<LRScheduler> scheduler, std::vector<AcceleratedOptimizer> optimizers,
                       const GradientState& gradient_state, const AcceleratedSchedulerOptions& options = {});

  /// Steps the scheduler as upstream does: not while accumulating (but with `adjust_scheduler`
  /// the scheduler's step count advances), not after a skipped optimizer step, else once with
  /// `split_batches` or `num_processes` times (never past a OneCycle schedule's total steps).
  void step() const;
  /// The learning rates set by the last step.
  std::vector<double> get_last_lr() const { return scheduler()->get_last_lr(); }
  /// The wrapped scheduler.
  const std::shared_ptr<LRScheduler>& scheduler() const;
  /// The wrapped scheduler's members.
  LRScheduler* operator->() const { return scheduler().get(); }
  /// The optimizers whose steps this scheduler follows.
  const std::vector<AcceleratedOptimizer>& optimizers() const;
  /// The settings.
  const AcceleratedSchedulerOptions& options() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace accelerate
