// Autocast regions on a CUDA device (accelerate/utils/autocast.h): inside a bf16 or fp16 guard a
// CUDA matrix product comes out in that dtype, precision-sensitive operations stay fp32, nested
// guards and disabled ones switch autocast off, and every guard restores the region around it.
// Every test skips without a GPU.
#include "accelerate/utils/autocast.h"
#include "support/gpu.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace accelerate::testing {
namespace {

c10::ScalarType product_dtype(const at::Tensor& a) { return torch::matmul(a, a).scalar_type(); }

TEST(CudaAutocast, Bf16AndFp16GuardsSetTheMatmulDtypeAndRestoreTheRegionAroundThem) {
  SKIP_WITHOUT_GPUS(1);
  const auto a = torch::randn({16, 16}, torch::kCUDA);
  const auto cpu = a.cpu();
  EXPECT_EQ(product_dtype(a), torch::kFloat);
  {
    AutocastGuard bf16(c10::kCUDA, PrecisionType::kBf16);
    EXPECT_EQ(product_dtype(a), torch::kBFloat16);
    // Precision-sensitive operations stay in fp32 (autocast's fp32 list).
    EXPECT_EQ(torch::matmul(a, a).softmax(-1).scalar_type(), torch::kFloat);
    // The CUDA region leaves CPU tensors alone.
    EXPECT_EQ(product_dtype(cpu), torch::kFloat);
    {
      AutocastGuard fp16(c10::kCUDA, PrecisionType::kFp16);
      EXPECT_EQ(product_dtype(a), torch::kHalf);
      {
        AutocastGuard full(c10::kCUDA, PrecisionType::kNo);
        EXPECT_EQ(product_dtype(a), torch::kFloat) << "PrecisionType::kNo must switch autocast off";
      }
      EXPECT_EQ(product_dtype(a), torch::kHalf);
      {
        AutocastGuard disabled(c10::kCUDA, PrecisionType::kBf16, AutocastKwargs{.enabled = false});
        EXPECT_EQ(product_dtype(a), torch::kFloat) << "AutocastKwargs.enabled = false must switch autocast off";
      }
      EXPECT_EQ(product_dtype(a), torch::kHalf);
    }
    EXPECT_EQ(product_dtype(a), torch::kBFloat16);
  }
  EXPECT_EQ(product_dtype(a), torch::kFloat);
}

TEST(CudaAutocast, ABf16ProductHasTheValueOfTheFp32OneToBfloat16Precision) {
  SKIP_WITHOUT_GPUS(1);
  torch::manual_seed(0);
  const auto a = torch::randn({64, 64}, torch::kCUDA);
  const auto b = torch::randn({64, 64}, torch::kCUDA);
  const auto full = torch::matmul(a, b);
  at::Tensor reduced;
  {
    AutocastGuard bf16(c10::kCUDA, PrecisionType::kBf16);
    reduced = torch::matmul(a, b);
  }
  ASSERT_EQ(reduced.scalar_type(), torch::kBFloat16);
  // bf16 keeps 8 significant bits: each input is off by up to 2^-9 relatively, and a sum of 64
  // products of N(0, 1) numbers is about 8 in size.
  EXPECT_TRUE(torch::allclose(reduced.to(torch::kFloat), full, /*rtol=*/2e-2, /*atol=*/0.25));
  EXPECT_FALSE(torch::equal(reduced.to(torch::kFloat), full)) << "the bf16 product is exact: it did not run in bf16";
}

}  // namespace
}  // namespace accelerate::testing
