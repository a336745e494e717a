// Dynamic loss scaling on the CPU: inf gradients are injected to drive the scaler's logic.
#include "accelerate/grad_scaler.h"
#include "accelerate/optimizer.h"
#include "accelerate/scheduler.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <limits>

namespace accelerate::testing {
namespace grad_scaler_test {  // not anonymous: its names must not meet another file's in a unity batch

struct Fixture {
  torch::Tensor weight = torch::ones({3}, torch::requires_grad());
  std::shared_ptr<torch::optim::SGD> sgd = std::make_shared<torch::optim::SGD>(std::vector<torch::Tensor>{weight}, 0.1);

  // Sets the gradient that the scaled loss would have produced.
  void set_grad(const std::vector<float>& values) { weight.mutable_grad() = torch::tensor(values); }
};

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(GradScaler, ScalesTheLossAndUnscalesTheGradientsBeforeTheStep) {
  GradScaler scaler({.init_scale = 8.0});
  Fixture f;
  auto loss = (f.weight * torch::tensor({1.f, 2.f, 3.f})).sum();
  auto scaled = scaler.scale(loss);
  EXPECT_FLOAT_EQ(scaled.item<float>(), 8.f * loss.item<float>());
  scaled.backward();
  EXPECT_TRUE(torch::equal(f.weight.grad(), torch::tensor({8.f, 16.f, 24.f})));
  EXPECT_TRUE(scaler.step(*f.sgd));
  // weight -= 0.1 * unscaled gradient
  EXPECT_TRUE(torch::allclose(f.weight.detach(), torch::tensor({0.9f, 0.8f, 0.7f})));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 8.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 1);
}

TEST(GradScaler, AnInfGradientSkipsTheStepAndBacksTheScaleOff) {
  for (float bad : {kInf, -kInf, std::numeric_limits<float>::quiet_NaN()}) {
    GradScaler scaler({.init_scale = 1024.0, .backoff_factor = 0.25});
    Fixture f;
    f.set_grad({1.f, bad, 1.f});
    EXPECT_FALSE(scaler.step(*f.sgd));
    EXPECT_TRUE(torch::equal(f.weight.detach(), torch::ones({3})));  // untouched
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 256.0);
    EXPECT_EQ(scaler.get_growth_tracker(), 0);
  }
}

TEST(GradScaler, TheScaleGrowsAfterGrowthIntervalCleanSteps) {
  GradScaler scaler({.init_scale = 2.0, .growth_factor = 3.0, .growth_interval = 3});
  Fixture f;
  std::vector<double> scales;
  for (int step = 0; step < 7; ++step) {
    f.set_grad({1.f, 1.f, 1.f});
    if (step == 4) f.set_grad({kInf, 0.f, 0.f});
    (void)scaler.step(*f.sgd);
    scaler.update();
    scales.push_back(scaler.get_scale());
  }
  // clean, clean, clean → ×3; clean; inf → ×0.5 and the count restarts; clean, clean
  EXPECT_EQ(scales, (std::vector<double>{2, 2, 6, 6, 3, 3, 3}));
}

TEST(GradScaler, UnscalingTwiceInOneStepIsAnError) {
  GradScaler scaler({.init_scale = 4.0});
  Fixture f;
  f.set_grad({4.f, 4.f, 4.f});
  scaler.unscale_(*f.sgd);
  EXPECT_TRUE(scaler.is_unscaled(*f.sgd));
  EXPECT_TRUE(torch::equal(f.weight.grad(), torch::ones({3})));
  EXPECT_THROWS_WITH(scaler.unscale_(*f.sgd), "unscale_() was already called on this optimizer");
  EXPECT_TRUE(scaler.step(*f.sgd));  // does not unscale again
  EXPECT_TRUE(torch::allclose(f.weight.detach(), torch::full({3}, 0.9f)));
  EXPECT_THROWS_WITH((void)scaler.step(*f.sgd), "step() was already called");
  scaler.update();
  EXPECT_FALSE(scaler.is_unscaled(*f.sgd));
}

TEST(GradScaler, UnscalingAfterTheStepWithoutAnUpdateIsAnError) {
  GradScaler scaler({.init_scale = 4.0});
  Fixture f;
  f.set_grad({4.f, 4.f, 4.f});
  EXPECT_TRUE(scaler.step(*f.sgd));
  EXPECT_THROWS_WITH(scaler.unscale_(*f.sgd), "unscale_() is being called after step() without an update() in between");
  scaler.update();
  f.set_grad({4.f, 4.f, 4.f});
  scaler.unscale_(*f.sgd);  // a new step may unscale again
  EXPECT_TRUE(torch::equal(f.weight.grad(), torch::ones({3})));
}

TEST(GradScaler, AnEmptyStateFromADisabledScalerIsRefusedByAnEnabledOne) {
  GradScaler disabled({.enabled = false});
  const auto state = disabled.state_dict();
  GradScaler enabled({.init_scale = 8.0});
  EXPECT_THROWS_WITH(enabled.load_state_dict(state),
                     "[GradScaler.load_state_dict] the state is empty: it was saved from a disabled scaler");
  EXPECT_EQ(enabled.get_scale(), 8.0);
}

TEST(GradScaler, UpdateWithoutAStepIsAnError) {
  GradScaler scaler;
  EXPECT_THROWS_WITH(scaler.update(), "no inf checks were recorded");
}

TEST(GradScaler, ADisabledScalerIsTransparent) {
  GradScaler scaler({.enabled = false});
  Fixture f;
  auto loss = f.weight.sum();
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  f.set_grad({kInf, 1.f, 1.f});
  EXPECT_TRUE(scaler.step(*f.sgd));  // no inf check when disabled
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_EQ(scaler.state_dict(), nlohmann::json::object());
}

TEST(GradScaler, StateDictRoundTripsAndRejectsBadInput) {
  GradScaler a({.init_scale = 16.0, .growth_interval = 5});
  Fixture f;
  f.set_grad({1.f, 1.f, 1.f});
  (void)a.step(*f.sgd);
  a.update();
  GradScaler b;
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.get_scale(), 16.0);
  EXPECT_EQ(b.get_growth_tracker(), 1);
  EXPECT_EQ(b.kwargs().growth_interval, 5);
  auto state = a.state_dict();
  state.erase("scale");
  EXPECT_THROWS_WITH(b.load_state_dict(state), "key 'scale' is missing");
  state = a.state_dict();
  state["_growth_tracker"] = "three";
  EXPECT_THROWS_WITH(b.load_state_dict(state), "'_growth_tracker' is missing or not a number");
  state = a.state_dict();
  state["scale"] = -1;
  EXPECT_THROWS_WITH(b.load_state_dict(state), "'scale' must be positive");
  EXPECT_THROWS_WITH(b.load_state_dict(nlohmann::json::array()), "expected a JSON object");
  state = a.state_dict();
  state["backoff_factor"] = 2.0;
  EXPECT_THROWS_WITH(b.load_state_dict(state), "backoff_factor in (0, 1)");
  EXPECT_THROWS_WITH(b.update(0.0), "new_scale must be a positive finite number, got 0");
}

TEST(GradScaler, InvalidSettingsAreRefused) {
  EXPECT_THROWS_WITH(GradScaler({.init_scale = 0}), "init_scale must be a positive");
  EXPECT_THROWS_WITH(GradScaler({.growth_factor = 1.0}), "growth_factor must be greater than 1");
  EXPECT_THROWS_WITH(GradScaler({.backoff_factor = 1.5}), "backoff_factor must be in (0, 1)");
  EXPECT_THROWS_WITH(GradScaler({.growth_interval = 0}), "growth_interval must be positive");
}

// The accelerated wrappers around a scaler: a skipped step is reported and the scheduler holds.
TEST(GradScaler, AnOverflowSkipsTheOptimizerAndTheSchedulerStep) {
  Fixture f;
  auto gradient_state = GradientState::standalone();
  GradScaler scaler({.init_scale = 2.0});
  AcceleratedOptimizer optimizer(f.sgd, gradient_state, scaler);
  auto lambda = std::make_shared<LambdaLR>(f.sgd, [](int64_t epoch) { return 1.0 / (1 + epoch); });
  AcceleratedScheduler scheduler(lambda, {optimizer}, gradient_state);

  f.set_grad({2.f, 2.f, 2.f});
  optimizer.step();
  scheduler.step();
  EXPECT_FALSE(optimizer.step_was_skipped());
  EXPECT_EQ(lambda->last_epoch(), 1);
  EXPECT_DOUBLE_EQ(scheduler.get_last_lr()[0], 0.05);

  f.set_grad({kInf, 2.f, 2.f});
  const auto before = f.weight.detach().clone();
  optimizer.step();
  scheduler.step();
  EXPECT_TRUE(optimizer.step_was_skipped());
  EXPECT_TRUE(torch::equal(f.weight.detach(), before));
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_EQ(lambda->last_epoch(), 1);  // held back
  EXPECT_DOUBLE_EQ(scheduler.get_last_lr()[0], 0.05);

  f.set_grad({1.f, 1.f, 1.f});
  optimizer.step();
  scheduler.step();
  EXPECT_FALSE(optimizer.step_was_skipped());
  EXPECT_EQ(lambda->last_epoch(), 2);
}

TEST(GetGradScaler, BuildsAScalerWithTheGivenSettingsAndTheRestAtTheirDefaults) {
  // Upstream's test of GradScalerKwargs(init_scale=1024, growth_factor=2).
  auto scaler = get_grad_scaler(DistributedType::kMultiCpu, {.init_scale = 1024, .growth_factor = 2});
  EXPECT_EQ(scaler.get_scale(), 1024.0);
  EXPECT_EQ(scaler.kwargs().growth_factor, 2.0);
  EXPECT_EQ(scaler.kwargs().backoff_factor, 0.5);
  EXPECT_EQ(scaler.kwargs().growth_interval, 2000);
  EXPECT_TRUE(scaler.is_enabled());
  EXPECT_EQ(get_grad_scaler().get_scale(), 65536.0);
}

}  // namespace grad_scaler_test
}  // namespace accelerate::testing
