// AcceleratedOptimizer: steps and gradient clearing follow gradient synchronisation.
#include "accelerate/optimizer.h"
#include "detail/torch_compat.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace accelerate::testing {
namespace {

struct Fixture {
  torch::Tensor weight = torch::ones({2}, torch::requires_grad());
  std::shared_ptr<torch::optim::SGD> sgd = std::make_shared<torch::optim::SGD>(std::vector<torch::Tensor>{weight}, 0.5);
  GradientState gradient_state = GradientState::standalone();
  AcceleratedOptimizer optimizer{sgd, gradient_state};
};

TEST(AcceleratedOptimizer, StepAndZeroGradDoNothingWhileGradientsAccumulate) {
  Fixture f;
  f.weight.mutable_grad() = torch::full({2}, 2.f);
  f.gradient_state.set_sync_gradients(false);
  f.optimizer.step();
  f.optimizer.zero_grad();
  EXPECT_TRUE(torch::equal(f.weight.detach(), torch::ones({2})));
  EXPECT_TRUE(torch::equal(f.weight.grad(), torch::full({2}, 2.f)));

  f.gradient_state.set_sync_gradients(true);
  f.optimizer.step();
  EXPECT_TRUE(torch::equal(f.weight.detach(), torch::zeros({2})));
  EXPECT_FALSE(f.optimizer.step_was_skipped());
  f.optimizer.zero_grad();
  EXPECT_FALSE(f.weight.grad().defined());
}

TEST(AcceleratedOptimizer, ZeroGradCanKeepZeroFilledGradients) {
  Fixture f;
  f.weight.mutable_grad() = torch::full({2}, 2.f);
  auto before = f.weight.grad();
  f.optimizer.zero_grad(/*set_to_none=*/false);
  ASSERT_TRUE(f.weight.grad().defined());
  EXPECT_TRUE(torch::equal(f.weight.grad(), torch::zeros({2})));
  EXPECT_TRUE(f.weight.grad().is_same(before));  // zeroed in place
}

TEST(AcceleratedOptimizer, ForwardsToTheWrappedOptimizer) {
  Fixture f;
  EXPECT_EQ(f.optimizer.optimizer(), f.sgd);
  EXPECT_EQ(&f.optimizer.param_groups(), &f.sgd->param_groups());
  EXPECT_EQ(f.optimizer->param_groups().size(), 1u);
  EXPECT_FALSE(f.optimizer.scaler().has_value());
  AcceleratedOptimizer copy = f.optimizer;
  f.weight.mutable_grad() = torch::ones({2});
  copy.step();
  EXPECT_TRUE(torch::equal(f.weight.detach(), torch::full({2}, 0.5f)));
}

TEST(AcceleratedOptimizer, MovesKnownOptimizerStateAndRefusesUnknownState) {
  auto weight = torch::ones({2}, torch::requires_grad());
  auto adam = std::make_shared<torch::optim::Adam>(std::vector<torch::Tensor>{weight}, 0.1);
  weight.mutable_grad() = torch::ones({2});
  adam->step();
  ASSERT_FALSE(adam->state().empty());
  move_optimizer_state(*adam, c10::Device(c10::kMeta));
  auto& state = static_cast<torch::optim::AdamParamState&>(*adam->state().begin()->second);
  EXPECT_TRUE(state.exp_avg().is_meta());
  EXPECT_TRUE(state.exp_avg_sq().is_meta());

  struct OddState : torch::optim::OptimizerCloneableParamState<OddState> {};
  const auto stranger = torch::zeros({1});
  adam->state()[detail::compat::optimizer_state_key(stranger)] = std::make_unique<OddState>();
  EXPECT_THROWS_WITH(move_optimizer_state(*adam, c10::Device(c10::kMeta)), "cannot move the state of an optimizer");
}

TEST(AcceleratedOptimizer, RefusesANullOptimizer) {
  EXPECT_THROWS_WITH(AcceleratedOptimizer(nullptr, GradientState::standalone()), "expected an optimizer, got null");
}

}  // namespace
}  // namespace accelerate::testing
