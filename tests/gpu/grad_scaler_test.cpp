// The loss scaler's CUDA path (src/grad_scaler.cpp): gradients on the GPU are unscaled and checked
// for inf/NaN by LibTorch's fused kernel; a step with an overflowing gradient is skipped and the
// scale backs off, a clean one steps with the unscaled gradients. Every test skips without a GPU.
#include "accelerate/grad_scaler.h"
#include "support/gpu.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

namespace accelerate::testing {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

at::Tensor on_gpu(const std::vector<float>& values, c10::ScalarType dtype = torch::kFloat) {
  return torch::tensor(values).to(torch::TensorOptions().device(torch::kCUDA).dtype(dtype));
}

// A parameter of ones on the GPU, with SGD (lr 0.1) over it.
struct GpuParameter {
  explicit GpuParameter(int64_t n, c10::ScalarType dtype = torch::kFloat)
      : weight(torch::ones({n}, torch::TensorOptions().device(torch::kCUDA).dtype(dtype)).requires_grad_(true)),
        sgd(std::make_shared<torch::optim::SGD>(std::vector<at::Tensor>{weight}, 0.1)) {}
  at::Tensor weight;
  std::shared_ptr<torch::optim::SGD> sgd;
};

TEST(CudaGradScaler, UnscalesGpuGradientsBeforeTheStep) {
  SKIP_WITHOUT_GPUS(1);
  GradScaler scaler({.init_scale = 8.0});
  GpuParameter p(3);
  auto loss = (p.weight * on_gpu({1.f, 2.f, 3.f})).sum();
  auto scaled = scaler.scale(loss);
  EXPECT_TRUE(scaled.is_cuda());
  EXPECT_FLOAT_EQ(scaled.item<float>(), 8.f * loss.item<float>());
  scaled.backward();
  EXPECT_TRUE(torch::equal(p.weight.grad().cpu(), torch::tensor({8.f, 16.f, 24.f})));
  scaler.unscale_(*p.sgd);
  EXPECT_TRUE(torch::equal(p.weight.grad().cpu(), torch::tensor({1.f, 2.f, 3.f})));
  EXPECT_TRUE(scaler.step(*p.sgd));
  EXPECT_TRUE(torch::allclose(p.weight.detach().cpu(), torch::tensor({0.9f, 0.8f, 0.7f})));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 8.0);
  EXPECT_EQ(scaler.get_growth_tracker(), 1);
}

TEST(CudaGradScaler, AnInfOrNanGpuGradientSkipsTheStepAndBacksTheScaleOff) {
  SKIP_WITHOUT_GPUS(1);
  for (float bad : {kInf, -kInf, std::numeric_limits<float>::quiet_NaN()}) {
    GradScaler scaler({.init_scale = 1024.0});
    GpuParameter p(3);
    p.weight.mutable_grad() = on_gpu({1.f, bad, 1.f});
    EXPECT_FALSE(scaler.step(*p.sgd)) << "stepped with a gradient holding " << bad;
    EXPECT_TRUE(torch::equal(p.weight.detach().cpu(), torch::ones({3}))) << "the skipped step changed the weight";
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 512.0);
    EXPECT_EQ(scaler.get_growth_tracker(), 0);
  }
}

TEST(CudaGradScaler, FindsAnInfAmongSeveralGpuGradientsOfMixedDtypes) {
  SKIP_WITHOUT_GPUS(1);
  // fp32 and fp16 parameters in one optimizer: the fused kernel takes its per-tensor path.
  GradScaler scaler({.init_scale = 4.0});
  auto a = torch::ones({3}, torch::TensorOptions().device(torch::kCUDA)).requires_grad_(true);
  auto b = torch::ones({2}, torch::TensorOptions().device(torch::kCUDA).dtype(torch::kHalf)).requires_grad_(true);
  torch::optim::SGD sgd(std::vector<at::Tensor>{a, b}, 0.1);
  a.mutable_grad() = on_gpu({4.f, 4.f, 4.f});
  b.mutable_grad() = on_gpu({4.f, kInf}, torch::kHalf);
  EXPECT_FALSE(scaler.step(sgd)) << "the inf in the fp16 gradient went unnoticed";
  EXPECT_TRUE(torch::equal(a.detach().cpu(), torch::ones({3})));
  EXPECT_TRUE(torch::equal(b.detach().cpu(), torch::ones({2}, torch::kHalf)));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 2.0);
  // A clean step: both unscaled by the new scale (2), then stepped.
  a.mutable_grad() = on_gpu({2.f, 2.f, 2.f});
  b.mutable_grad() = on_gpu({2.f, 2.f}, torch::kHalf);
  EXPECT_TRUE(scaler.step(sgd));
  EXPECT_TRUE(torch::allclose(a.detach().cpu(), torch::full({3}, 0.9f)));
  EXPECT_TRUE(torch::allclose(b.detach().cpu().to(torch::kFloat), torch::full({2}, 0.9f), 1e-3, 1e-3));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 2.0);
}

TEST(CudaGradScaler, UnscalesTheGpuAndCpuGradientsOfOneOptimizer) {
  SKIP_WITHOUT_GPUS(1);
  // A model partly offloaded to the CPU (or spread over devices) has one optimizer over tensors
  // on several devices; PyTorch's GradScaler unscales each device's gradients separately.
  GradScaler scaler({.init_scale = 4.0});
  auto gpu = torch::ones({3}, torch::TensorOptions().device(torch::kCUDA)).requires_grad_(true);
  auto cpu = torch::ones({2}, torch::requires_grad());
  torch::optim::SGD sgd(std::vector<at::Tensor>{gpu, cpu}, 0.1);
  gpu.mutable_grad() = on_gpu({4.f, 4.f, 4.f});
  cpu.mutable_grad() = torch::tensor({4.f, 4.f});
  EXPECT_TRUE(scaler.step(sgd));
  EXPECT_TRUE(torch::allclose(gpu.detach().cpu(), torch::full({3}, 0.9f)));
  EXPECT_TRUE(torch::allclose(cpu.detach(), torch::full({2}, 0.9f)));
  scaler.update();
  // An inf on the CPU side skips the step for both.
  gpu.mutable_grad() = on_gpu({4.f, 4.f, 4.f});
  cpu.mutable_grad() = torch::tensor({4.f, kInf});
  EXPECT_FALSE(scaler.step(sgd));
  EXPECT_TRUE(torch::allclose(gpu.detach().cpu(), torch::full({3}, 0.9f)));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 2.0);
}

}  // namespace
}  // namespace accelerate::testing
