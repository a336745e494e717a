// The Accelerator on a CUDA device: prepared models, optimizer states and batches go to the GPU;
// fp16 creates a loss scaler, runs matrix products in half precision and hands back fp32 outputs,
// skips the optimizer step when a gradient overflows and otherwise trains like fp32; bf16
// autocasts to bfloat16 without a scaler. Every test skips without a GPU.
#include "accelerate/accelerator.h"
#include "support/accelerators.h"
#include "support/gpu.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <optional>
#include <tuple>

namespace accelerate::testing {
namespace {

// A linear layer that records the dtype its product came out in, and returns the product with
// the index of its largest entry: an integer tensor, which mixed precision must leave alone.
struct ProbeImpl : torch::nn::Module {
  ProbeImpl() : fc(register_module("fc", torch::nn::Linear(8, 4))) {}
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x) {
    auto y = fc(x);
    inner_dtype = y.scalar_type();
    return {y, y.argmax(1)};
  }
  torch::nn::Linear fc;
  c10::ScalarType inner_dtype = c10::ScalarType::Undefined;
};
TORCH_MODULE(Probe);

AcceleratorOptions with_precision(const std::string& precision, std::optional<double> init_scale = std::nullopt) {
  AcceleratorOptions options;
  options.mixed_precision = precision;
  if (init_scale) options.scaler_kwargs.init_scale = *init_scale;
  return options;
}

// Every parameter of `module`, flattened into one vector.
at::Tensor flat_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> parts;
  for (const auto& p : module.parameters()) parts.push_back(p.detach().flatten());
  return torch::cat(parts);
}

TEST(CudaAccelerator, PrepareMovesTheModelItsOptimizerStateAndTheBatchesToTheGpu) {
  SKIP_WITHOUT_GPUS(1);
  run_accelerators(1, [](const Accelerator& acc, int) {
    ASSERT_TRUE(acc.device().is_cuda()) << acc.device();
    EXPECT_EQ(acc.device().index(), 0);
    torch::manual_seed(0);
    torch::nn::Linear net(3, 1);
    // One step on the CPU first, as when resuming: Adam then holds state tensors on the CPU.
    auto adam = std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(0.1));
    torch::mse_loss(net(torch::randn({4, 3})), torch::zeros({4, 1})).backward();
    adam->step();
    DataLoader loader(std::make_shared<TensorDataset>(torch::randn({8, 3}), torch::randn({8, 1})), {.batch_size = 4});
    auto [model, opt, batches] = acc.prepare(net, adam, loader);
    EXPECT_TRUE(model->weight.is_cuda());
    EXPECT_TRUE(model->bias.is_cuda());
    ASSERT_FALSE(adam->state().empty());
    for (const auto& [key, state] : adam->state()) {
      const auto& adam_state = static_cast<const torch::optim::AdamParamState&>(*state);
      EXPECT_TRUE(adam_state.exp_avg().is_cuda()) << "Adam state " << key << " stayed on the CPU";
      EXPECT_TRUE(adam_state.exp_avg_sq().is_cuda()) << "Adam state " << key << " stayed on the CPU";
    }
    int seen = 0;
    for (auto& batch : batches) {
      EXPECT_TRUE(batch.data.is_cuda());
      EXPECT_TRUE(batch.target.is_cuda());
      // A whole training step on the GPU: it fails if anything was left on the CPU.
      opt.zero_grad();
      acc.backward(torch::mse_loss(model(batch.data), batch.target));
      opt.step();
      ++seen;
    }
    EXPECT_EQ(seen, 2);
  });
}

TEST(CudaAccelerator, Fp16CreatesAScalerRunsMatmulsInHalfAndReturnsFp32Outputs) {
  SKIP_WITHOUT_GPUS(1);
  run_accelerators(
      1,
      [](const Accelerator& acc, int) {
        ASSERT_TRUE(acc.device().is_cuda()) << acc.device();
        EXPECT_EQ(acc.mixed_precision(), "fp16");
        ASSERT_TRUE(acc.scaler().has_value()) << "fp16 on a GPU must come with a loss scaler";
        EXPECT_TRUE(acc.scaler()->is_enabled());
        EXPECT_EQ(acc.scaler()->get_scale(), 65536.0);  // GradScalerKwargs' default, PyTorch's too

        torch::manual_seed(0);
        Probe probe;
        auto model = acc.prepare(probe);
        const auto x = torch::randn({5, 8}, acc.device());
        auto [logits, best] = model(x);
        EXPECT_EQ(probe->inner_dtype, torch::kHalf)
            << "the product inside the prepared model ran in " << probe->inner_dtype;
        EXPECT_EQ(logits.scalar_type(), torch::kFloat) << "outputs come back in fp32 (upstream's convert_to_fp32)";
        EXPECT_EQ(best.scalar_type(), torch::kLong) << "integer outputs are left as they are";
        EXPECT_TRUE(logits.is_cuda());
        // The numbers of the fp32 layer, to half precision.
        const auto full = probe->fc(x);
        EXPECT_EQ(full.scalar_type(), torch::kFloat) << "autocast leaked out of the prepared model's forward";
        EXPECT_TRUE(torch::allclose(logits, full, /*rtol=*/1e-2, /*atol=*/1e-2)) << logits << full;

        // `autocast()` opens the same region around code of the user's.
        const auto a = torch::randn({16, 16}, acc.device());
        {
          auto region = acc.autocast();
          EXPECT_EQ(torch::matmul(a, a).scalar_type(), torch::kHalf);
        }
        EXPECT_EQ(torch::matmul(a, a).scalar_type(), torch::kFloat);
      },
      with_precision("fp16"));
}

TEST(CudaAccelerator, Fp16SkipsTheStepWhoseGradientsOverflowAndHalvesTheScale) {
  SKIP_WITHOUT_GPUS(1);
  // 2^24 times the loss's gradient does not fit in fp16 (largest finite value 65504), so the
  // backward pass of the half-precision product overflows to inf: a real overflow, not one
  // injected by hand.
  constexpr double kScale = 16777216.0;
  run_accelerators(
      1,
      [&](const Accelerator& acc, int) {
        torch::manual_seed(0);
        torch::nn::Linear net(4, 2);
        auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
        auto [model, opt] = acc.prepare(net, sgd);
        ASSERT_TRUE(acc.scaler().has_value());
        ASSERT_EQ(acc.scaler()->get_scale(), kScale);
        const auto weight = model->weight.detach().clone();
        const auto bias = model->bias.detach().clone();
        const auto x = torch::randn({3, 4}, acc.device());

        acc.backward(model(x).pow(2).sum());
        const auto grad = model->weight.grad();
        ASSERT_TRUE(grad.defined());
        EXPECT_FALSE(torch::isfinite(grad).all().item<bool>())
            << "expected the scaled fp16 gradient to overflow: " << grad;
        opt.step();
        EXPECT_TRUE(opt.step_was_skipped());
        EXPECT_TRUE(acc.optimizer_step_was_skipped());
        EXPECT_TRUE(torch::equal(model->weight, weight)) << "the skipped step changed the weight";
        EXPECT_TRUE(torch::equal(model->bias, bias)) << "the skipped step changed the bias";
        EXPECT_EQ(acc.scaler()->get_scale(), kScale / 2);
        EXPECT_EQ(acc.scaler()->get_growth_tracker(), 0);
      },
      with_precision("fp16", kScale));
}

TEST(CudaAccelerator, Fp16TrainingFollowsFp32TrainingWithinHalfPrecision) {
  SKIP_WITHOUT_GPUS(1);
  // y = x·w / 4 + noise: 64 samples of 16 features; a 16-32-1 MLP, SGD 0.05, 30 full-batch steps.
  // Within 1e-2 of the fp32 parameters (emulating fp16 rounding on the CPU puts the difference
  // near 1e-3), while fp32 training moves them by about 0.3: a step that was skipped, applied
  // twice or left scaled cannot pass.
  constexpr int kSteps = 30;
  constexpr double kTolerance = 1e-2;
  torch::manual_seed(0);
  const auto x = torch::randn({64, 16});
  const auto y = torch::matmul(x, torch::randn({16, 1})) / 4 + 0.01 * torch::randn({64, 1});
  auto make_net = [] {
    torch::manual_seed(1);
    return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::ReLU(), torch::nn::Linear(32, 1));
  };

  // The fp32 reference: plain LibTorch on the same GPU.
  auto reference = make_net();
  const auto initial = flat_parameters(*reference);
  reference->to(torch::kCUDA);
  torch::optim::SGD reference_sgd(reference->parameters(), torch::optim::SGDOptions(0.05));
  const auto xc = x.to(torch::kCUDA), yc = y.to(torch::kCUDA);
  double reference_loss = 0;
  for (int i = 0; i < kSteps; ++i) {
    reference_sgd.zero_grad();
    auto loss = torch::mse_loss(reference->forward(xc), yc);
    loss.backward();
    reference_sgd.step();
    reference_loss = loss.item<double>();
  }

  // init_scale 1024: large enough to keep fp16 gradients away from zero, small enough that no
  // step of this problem overflows (asserted below), so both runs take the same 30 steps.
  run_accelerators(
      1,
      [&](const Accelerator& acc, int) {
        auto net = make_net();
        auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.05));
        auto [model, opt] = acc.prepare(net, sgd);
        double loss_value = 0;
        for (int i = 0; i < kSteps; ++i) {
          opt.zero_grad();
          auto out = model(xc);
          EXPECT_EQ(out.scalar_type(), torch::kFloat);
          auto loss = torch::mse_loss(out, yc);
          acc.backward(loss);
          opt.step();
          EXPECT_FALSE(opt.step_was_skipped()) << "step " << i << " overflowed at scale " << acc.scaler()->get_scale();
          loss_value = loss.item<double>();
        }
        const auto trained = flat_parameters(*net).cpu();
        const auto expected = flat_parameters(*reference).cpu();
        const double moved = (expected - initial).abs().max().item<double>();
        const double difference = (trained - expected).abs().max().item<double>();
        EXPECT_GT(moved, 10 * kTolerance) << "the fp32 reference hardly trained; the comparison proves nothing";
        EXPECT_LT(difference, kTolerance) << "fp16 parameters differ from fp32 ones by " << difference;
        EXPECT_GT(difference, 0.0) << "bit-identical to fp32 training: the forward passes did not run in fp16";
        EXPECT_NEAR(loss_value, reference_loss, kTolerance * std::max(1.0, reference_loss));
      },
      with_precision("fp16", 1024.0));
}

TEST(CudaAccelerator, UnscaleGradientsDividesByTheLossScaleOncePerStepAndOnlyTheNamedOptimizers) {
  SKIP_WITHOUT_GPUS(1);
  // A power of two: dividing by it is exact, so unscaled gradients equal scaled ones / kScale.
  constexpr double kScale = 1024.0;
  run_accelerators(
      1,
      [&](const Accelerator& acc, int) {
        ASSERT_TRUE(acc.scaler().has_value());
        torch::manual_seed(0);
        torch::nn::Linear first_net(4, 2), second_net(4, 2);
        auto first_sgd = std::make_shared<torch::optim::SGD>(first_net->parameters(), torch::optim::SGDOptions(0.1));
        auto second_sgd = std::make_shared<torch::optim::SGD>(second_net->parameters(), torch::optim::SGDOptions(0.1));
        auto [first, first_opt, second, second_opt] = acc.prepare(first_net, first_sgd, second_net, second_sgd);
        const auto x = torch::randn({3, 4}, acc.device());
        acc.backward(first(x).pow(2).sum() + second(x).pow(2).sum());
        const auto first_scaled = first->weight.grad().clone();
        const auto second_scaled = second->weight.grad().clone();
        ASSERT_TRUE(torch::isfinite(first_scaled).all().item<bool>()) << first_scaled;
        ASSERT_GT(first_scaled.abs().max().item<float>(), 0.f);

        acc.unscale_gradients(first_opt);
        EXPECT_TRUE(torch::equal(first->weight.grad(), first_scaled / kScale)) << "the named optimizer";
        EXPECT_TRUE(torch::equal(second->weight.grad(), second_scaled)) << "an optimizer not named was unscaled";
        acc.unscale_gradients();  // every prepared optimizer, each at most once per step
        EXPECT_TRUE(torch::equal(first->weight.grad(), first_scaled / kScale)) << "unscaled twice";
        EXPECT_TRUE(torch::equal(second->weight.grad(), second_scaled / kScale));
        acc.unscale_gradients();
        (void)acc.clip_grad_norm_(first->parameters(), 1e9);  // unscales again only if nothing did
        EXPECT_TRUE(torch::equal(second->weight.grad(), second_scaled / kScale)) << "unscaled twice";

        // The step uses the unscaled gradients once more, not divided again.
        const auto weight = first->weight.detach().clone();
        first_opt.step();
        EXPECT_FALSE(first_opt.step_was_skipped());
        EXPECT_TRUE(torch::allclose(first->weight.detach(), weight - 0.1 * first_scaled / kScale));
      },
      with_precision("fp16", kScale));
}

TEST(CudaAccelerator, Bf16AutocastsMatmulsToBfloat16WithoutAScalerAndReturnsFp32Outputs) {
  SKIP_WITHOUT_GPUS(1);
  run_accelerators(
      1,
      [](const Accelerator& acc, int) {
        ASSERT_TRUE(acc.device().is_cuda()) << acc.device();
        EXPECT_EQ(acc.mixed_precision(), "bf16");
        EXPECT_FALSE(acc.scaler().has_value()) << "bf16 needs no loss scaling";
        torch::manual_seed(0);
        Probe probe;
        auto sgd = std::make_shared<torch::optim::SGD>(probe->parameters(), torch::optim::SGDOptions(0.1));
        auto [model, opt] = acc.prepare(probe, sgd);
        const auto x = torch::randn({5, 8}, acc.device());
        auto [logits, best] = model(x);
        EXPECT_EQ(probe->inner_dtype, torch::kBFloat16)
            << "the product inside the prepared model ran in " << probe->inner_dtype;
        EXPECT_EQ(logits.scalar_type(), torch::kFloat);
        EXPECT_EQ(best.scalar_type(), torch::kLong);
        EXPECT_TRUE(torch::allclose(logits, probe->fc(x), /*rtol=*/5e-2, /*atol=*/5e-2));
        // A backward pass through the bf16 region leaves fp32 gradients on the fp32 parameters.
        const auto weight = probe->fc->weight.detach().clone();
        acc.backward(logits.pow(2).sum());
        ASSERT_TRUE(probe->fc->weight.grad().defined());
        EXPECT_EQ(probe->fc->weight.grad().scalar_type(), torch::kFloat);
        EXPECT_TRUE(probe->fc->weight.grad().is_cuda());
        opt.step();
        EXPECT_FALSE(torch::equal(probe->fc->weight, weight)) << "the bf16 step did not change the weight";
        const auto a = torch::randn({16, 16}, acc.device());
        {
          auto region = acc.autocast();
          EXPECT_EQ(torch::matmul(a, a).scalar_type(), torch::kBFloat16);
        }
        EXPECT_EQ(torch::matmul(a, a).scalar_type(), torch::kFloat);
      },
      with_precision("bf16"));
}

}  // namespace
}  // namespace accelerate::testing
