// Local SGD with two ranks as threads: gradients stay local, parameters are averaged every K
// steps and on exit, and nothing communicates when it is disabled.
#include "accelerate/local_sgd.h"
#include "support/accelerators.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>

namespace accelerate::testing {
namespace local_sgd_test {  // not anonymous: its names must not meet another file's in a unity batch

constexpr int kRanks = 2;

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(4, 3))), fc2(register_module("fc2", torch::nn::Linear(3, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Net);

Net make_net(int seed) {
  Net net;
  torch::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : net->parameters()) {
    p.copy_(torch::linspace(-0.5, 0.5, p.numel()).reshape(p.sizes()) * (1 + 0.1 * i++) + 0.05 * seed);
  }
  return net;
}

// A batch that differs per rank and step.
torch::Tensor batch(int rank, int step) {
  return torch::sin(torch::arange(16, torch::kFloat).reshape({4, 4}) * (0.3 + 0.1 * step) + rank);
}
torch::Tensor targets(const torch::Tensor& x) { return torch::cos(x.sum(1, true)); }

torch::Tensor flat(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> parts;
  for (const auto& t : tensors) parts.push_back(t.detach().reshape(-1));
  return torch::cat(parts);
}
torch::Tensor flat_grads(const torch::nn::Module& module) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : module.parameters()) grads.push_back(p.grad().defined() ? p.grad() : torch::zeros_like(p));
  return flat(grads);
}

// Whether every rank holds the same values (a collective).
bool same_on_all_ranks(const Accelerator& acc, const torch::Tensor& t) {
  auto all = acc.gather(t.reshape({1, -1}).contiguous());
  return torch::equal(all[0], all[1]);
}

template <typename M, typename O>
void train_step(const Accelerator& acc, const PreparedModel<M>& model, O& optimizer, int rank, int step) {
  optimizer.zero_grad();
  auto x = batch(rank, step);
  acc.backward(torch::mse_loss(model(x), targets(x)));
  optimizer.step();
}

TEST(LocalSGD, ParametersAreAveragedEveryKthStepAndOnExit) {
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    Net net = make_net(rank);
    auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
    torch::Tensor final_mean;
    std::vector<bool> averaged;
    const int steps = local_sgd(acc, model, {.local_sgd_steps = 2}, [&](LocalSGD& sgd) {
      EXPECT_TRUE(sgd.enabled());
      EXPECT_FALSE(model.ddp().require_backward_grad_sync());
      for (int step = 0; step < 5; ++step) {
        opt.zero_grad();
        auto x = batch(rank, step);
        acc.backward(torch::mse_loss(model(x), targets(x)));
        EXPECT_FALSE(same_on_all_ranks(acc, flat_grads(*net))) << "gradients were synchronised at step " << step;
        opt.step();
        auto local = flat(net->parameters()).clone();
        auto mean = acc.reduce(local, "mean");
        sgd.step();
        auto now = flat(net->parameters());
        const bool same = same_on_all_ranks(acc, now);
        averaged.push_back(same);
        if (same) {
          EXPECT_TRUE(torch::allclose(now, mean, 1e-6, 1e-7)) << "step " << step;
        } else {
          EXPECT_TRUE(torch::equal(now, local)) << "step " << step;
        }
      }
      final_mean = acc.reduce(flat(net->parameters()).clone(), "mean");
      return static_cast<int>(sgd.num_steps());
    });
    EXPECT_EQ(steps, 5);
    EXPECT_EQ(averaged, (std::vector<bool>{false, true, false, true, false}));
    auto params = flat(net->parameters());
    EXPECT_TRUE(same_on_all_ranks(acc, params));
    EXPECT_TRUE(torch::allclose(params, final_mean, 1e-6, 1e-7));
    EXPECT_TRUE(model.ddp().require_backward_grad_sync());  // no_sync ended with the block
  });
}

TEST(LocalSGD, DisabledLocalSgdLeavesEverythingLocal) {
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    Net net = make_net(0);
    auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
    local_sgd(acc, model, {.local_sgd_steps = 1, .enabled = false}, [&](LocalSGD& sgd) {
      EXPECT_FALSE(sgd.enabled());
      EXPECT_TRUE(model.ddp().require_backward_grad_sync());  // gradients synchronise as usual
      train_step(acc, model, opt, rank, 0);
      EXPECT_TRUE(same_on_all_ranks(acc, flat_grads(*net)));
      {
        torch::NoGradGuard no_grad;
        net->fc2->bias.add_(rank + 1.0);  // the models drift apart
      }
      // A different number of steps per rank: a collective here would fail.
      for (int i = 0; i <= 2 * rank; ++i) sgd.step();
      EXPECT_EQ(sgd.num_steps(), 2 * rank + 1);
    });
    EXPECT_FALSE(same_on_all_ranks(acc, flat(net->parameters())));
  });
}

TEST(LocalSGD, OneProcessOnlyCountsSteps) {
  run_accelerators(1, [](const Accelerator& acc, int) {
    Net net = make_net(0);
    auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
    const auto steps = local_sgd(acc, model, {.local_sgd_steps = 1}, [&](LocalSGD& sgd) {
      EXPECT_FALSE(sgd.enabled());
      train_step(acc, model, opt, 0, 0);
      sgd.step();
      sgd.step();
      return sgd.num_steps();
    });
    EXPECT_EQ(steps, 2);
  });
}

TEST(LocalSGD, LocalSgdStepsBelowOneAreRefused) {
  run_accelerators(1, [](const Accelerator& acc, int) {
    auto model = acc.prepare(make_net(0));
    EXPECT_THROWS_WITH(local_sgd(acc, model, {}, [](LocalSGD&) {}), "local_sgd_steps must be at least 1, got 0");
    EXPECT_THROWS_WITH(LocalSGD(acc, model.ddp(), {.local_sgd_steps = -3}), "got -3");
  });
}

TEST(LocalSGD, AnExceptionPropagatesWithoutTheFinalAveraging) {
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    Net net = make_net(0);
    auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
    EXPECT_THROWS_WITH(local_sgd(acc, model, {.local_sgd_steps = 10}, [&](LocalSGD& sgd) {
      train_step(acc, model, opt, rank, 0);
      sgd.step();
      throw std::runtime_error("diverged");
    }), "diverged");
    EXPECT_FALSE(same_on_all_ranks(acc, flat(net->parameters())));
    EXPECT_TRUE(model.ddp().require_backward_grad_sync());
  });
}

}  // namespace local_sgd_test
}  // namespace accelerate::testing
