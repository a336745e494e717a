// Prepared schedulers follow the optimizer steps that really happened (upstream's stepping rule).
#include "accelerate/accelerator.h"
#include "accelerate/scheduler.h"
#include "support/accelerators.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace accelerate::testing {
namespace scheduler_test {  // not anonymous: its names must not meet another file's in a unity batch

double warmup_then_decay(int64_t epoch) { return epoch < 4 ? (epoch + 1) / 4.0 : 4.0 / (epoch + 1); }

struct Run {
  std::vector<double> lrs;         // learning rate after each iteration
  std::vector<int64_t> step_counts;  // the scheduler's step count after each iteration
};

// Trains 8 iterations with the given options on `ranks` processes and records the schedule.
Run train(int ranks, AcceleratorOptions options) {
  std::vector<Run> runs(ranks);
  run_accelerators(ranks, [&](const Accelerator& acc, int rank) {
    torch::nn::Linear net(2, 1);
    auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), 1.0);
    auto lambda = std::make_shared<LambdaLR>(sgd, warmup_then_decay);
    auto [model, scheduler, optimizer] = acc.prepare(net, lambda, sgd);  // scheduler before its optimizer
    EXPECT_EQ(scheduler.optimizers().size(), 1u);
    EXPECT_EQ(scheduler.optimizers()[0].optimizer(), sgd);
    for (int i = 0; i < 8; ++i) {
      auto guard = acc.accumulate(model);
      acc.backward(model(torch::ones({1, 2})).sum());
      optimizer.step();
      scheduler.step();
      optimizer.zero_grad();
      runs[rank].lrs.push_back(scheduler.get_last_lr()[0]);
      runs[rank].step_counts.push_back(lambda->step_count());
    }
  }, options);
  EXPECT_EQ(runs.front().lrs, runs.back().lrs);
  return runs.front();
}

// The reference rule: after the k-th real optimizer step the schedule has advanced k × `per_step`
// epochs; accumulation iterations only bump the step count (adjust_scheduler).
Run reference(int accumulation, int per_step, bool adjust = true) {
  Run run;
  int64_t epoch = 0, count = 1;
  for (int i = 1; i <= 8; ++i) {
    if (i % accumulation == 0) {
      epoch += per_step;
      count += per_step;
    } else if (adjust) {
      count += 1;
    }
    run.lrs.push_back(warmup_then_decay(epoch));
    run.step_counts.push_back(count);
  }
  return run;
}

TEST(AcceleratedScheduler, StepsOncePerProcessForEachOptimizerStep) {
  auto run = train(2, {});
  auto expected = reference(1, 2);
  EXPECT_EQ(run.lrs, expected.lrs);
  EXPECT_EQ(run.step_counts, expected.step_counts);
}

TEST(AcceleratedScheduler, StepsOncePerOptimizerStepWithSplitBatches) {
  AcceleratorOptions options;
  options.dataloader_config.split_batches = true;
  auto run = train(2, options);
  EXPECT_EQ(run.lrs, reference(1, 1).lrs);
}

TEST(AcceleratedScheduler, HoldsDuringGradientAccumulation) {
  AcceleratorOptions options;
  options.gradient_accumulation_steps = 2;
  auto run = train(2, options);
  auto expected = reference(2, 2);
  EXPECT_EQ(run.lrs, expected.lrs);
  EXPECT_EQ(run.step_counts, expected.step_counts);

  options.gradient_accumulation_steps.reset();
  options.gradient_accumulation_plugin = GradientAccumulationPlugin{.num_steps = 2, .adjust_scheduler = false};
  auto unadjusted = train(1, options);
  auto expected_unadjusted = reference(2, 1, /*adjust=*/false);
  EXPECT_EQ(unadjusted.lrs, expected_unadjusted.lrs);
  EXPECT_EQ(unadjusted.step_counts, expected_unadjusted.step_counts);
}

TEST(AcceleratedScheduler, StepsEveryCallWhenNotTiedToTheOptimizer) {
  AcceleratorOptions options;
  options.gradient_accumulation_steps = 2;
  options.step_scheduler_with_optimizer = false;
  auto run = train(2, options);
  std::vector<double> expected;
  for (int i = 1; i <= 8; ++i) expected.push_back(warmup_then_decay(i));
  EXPECT_EQ(run.lrs, expected);
}

TEST(AcceleratedScheduler, NeverStepsAOneCycleSchedulePastItsEnd) {
  auto gradient_state = GradientState::standalone();
  torch::nn::Linear net(2, 1);
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto one_cycle = std::make_shared<OneCycleLR>(sgd, OneCycleLROptions{.max_lr = 1.0, .total_steps = 5});
  AcceleratedOptimizer optimizer(sgd, gradient_state);
  AcceleratedScheduler scheduler(one_cycle, {optimizer}, gradient_state, {.num_processes = 2});
  for (int i = 0; i < 4; ++i) scheduler.step();  // 8 requested steps: only those up to total_steps run
  EXPECT_EQ(one_cycle->step_count(), 6);
  EXPECT_EQ(one_cycle->last_epoch(), 5);
}

TEST(AcceleratedScheduler, RefusesANullSchedulerOrNoProcesses) {
  auto gradient_state = GradientState::standalone();
  EXPECT_THROWS_WITH(AcceleratedScheduler(nullptr, {}, gradient_state), "expected a scheduler, got null");
  torch::nn::Linear net(2, 1);
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
  auto lambda = std::make_shared<LambdaLR>(sgd, [](int64_t) { return 1.0; });
  EXPECT_THROWS_WITH(AcceleratedScheduler(lambda, {}, gradient_state, {.num_processes = 0}),
                     "num_processes must be at least 1");
}

}  // namespace scheduler_test
}  // namespace accelerate::testing
