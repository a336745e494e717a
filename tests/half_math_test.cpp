// The fp16 arithmetic of DDP's fp16 compression (detail::add_out, detail::to_half_divided and its
// in-place form, detail::widen_in_place): the bits of ATen's own fp16 operations on every fp16
// value, subnormals, infinities and overflow included, in place and cut across threads, on this
// processor's vector path and on ATen's.
#include "detail/half_math.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>

namespace accelerate::testing {
namespace {

// Every one of fp16's 65536 bit patterns.
torch::Tensor every_half() {
  return torch::arange(-32768, 32768, torch::kInt).to(torch::kShort).view(torch::kHalf);
}

// Where the expected value is a NaN, any NaN; elsewhere the same bits. Returns the first index
// that differs, or -1.
int64_t first_difference(const torch::Tensor& got, const torch::Tensor& expected) {
  const auto nan = expected.isnan();
  const auto same = got.view(torch::kShort).eq(expected.view(torch::kShort)).logical_or(nan.logical_and(got.isnan()));
  const auto wrong = same.logical_not().nonzero();
  return wrong.numel() == 0 ? -1 : wrong[0][0].item<int64_t>();
}

class HalfMath : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    // Where the processor has no F16C, ATen's operations are the only path: the Aten case.
    if (!GetParam() && !detail::has_half_conversions()) GTEST_SKIP() << "this processor has no F16C";
    detail::use_aten_for_half_math(GetParam());
  }
  void TearDown() override { detail::use_aten_for_half_math(false); }
};

TEST_P(HalfMath, AddingGivesAtensBitsForEveryPairOfFp16Values) {
  const auto a = every_half();
  torch::manual_seed(7);
  // 65536 pairs in each of four pairings: every value against a shuffle of all values, against
  // itself (doubling reaches the overflow to infinity), and against its neighbours.
  for (const auto& b : {a.index_select(0, torch::randperm(a.numel())), a.clone(), a.roll(1), a.roll(-4099)}) {
    const auto expected = a.add(b);
    const auto through_fp32 = (a.to(torch::kFloat) + b.to(torch::kFloat)).to(torch::kHalf);
    ASSERT_EQ(first_difference(expected, through_fp32), -1) << "ATen's fp16 addition is not one rounding";
    // Lengths that leave a remainder after whole vectors, from an offset inside the tensor.
    for (const int64_t length : {a.numel(), int64_t{1}, int64_t{7}, int64_t{9}, int64_t{65533}}) {
      const auto x = a.narrow(0, a.numel() - length, length), y = b.narrow(0, b.numel() - length, length);
      auto out = torch::empty_like(x);
      detail::add_out(out, x, y);
      const auto at = first_difference(out, expected.narrow(0, a.numel() - length, length));
      EXPECT_EQ(at, -1) << "length " << length << ": " << x[at].item<float>() << " + " << y[at].item<float>();
    }
    // In place, as the ring adds a received piece into its own.
    auto own = a.clone();
    detail::add_out(own, own, b);
    EXPECT_EQ(first_difference(own, expected), -1) << "in place";
  }
}

TEST_P(HalfMath, AddingAcrossIntraOpThreadsGivesTheSameBits) {
  torch::manual_seed(11);
  const auto a = torch::randn({1 << 20}).mul(300).to(torch::kHalf), b = torch::randn({1 << 20}).to(torch::kHalf);
  auto out = torch::empty_like(a);
  const int threads = torch::get_num_threads();
  torch::set_num_threads(4);
  detail::add_out(out, a, b);
  torch::set_num_threads(threads);
  EXPECT_EQ(first_difference(out, a.add(b)), -1);
}

TEST_P(HalfMath, AddingOtherTypesIsAtensAddition) {
  const auto a = torch::linspace(-3, 3, 1001, torch::kFloat), b = torch::linspace(5, -1, 1001, torch::kFloat);
  for (const auto type : {torch::kBFloat16, torch::kFloat, torch::kDouble}) {
    auto out = torch::empty({1001}, type);
    detail::add_out(out, a.to(type), b.to(type));
    EXPECT_TRUE(torch::equal(out, a.to(type).add(b.to(type)))) << type;
  }
}

TEST_P(HalfMath, CompressionIsTheCastThenTheDivisionBitForBit) {
  torch::manual_seed(3);
  // Values across fp32's range around fp16's: below its subnormals, on them, up to and past its
  // largest finite value, and the special values.
  auto spread = torch::randn({200000}) * torch::exp(torch::randn({200000}) * 5);
  const auto specials = torch::tensor({0.0F, -0.0F, 65504.0F, 65519.0F, 65520.0F, 1e6F, 6e-8F, 2.9e-8F, 3e-8F,
                                       std::numeric_limits<float>::infinity(),
                                       -std::numeric_limits<float>::infinity(),
                                       std::numeric_limits<float>::quiet_NaN()});
  const auto from = torch::cat({spread, specials, every_half().to(torch::kFloat)});
  for (const int64_t divisor : {1, 2, 3, 4, 5, 7, 64, 1000}) {
    const auto expected = from.to(torch::kHalf).div_(divisor);
    const auto got = detail::to_half_divided(from, divisor);
    ASSERT_EQ(got.scalar_type(), torch::kHalf);
    ASSERT_EQ(got.sizes(), from.sizes());
    const auto at = first_difference(got, expected);
    EXPECT_EQ(at, -1) << "divisor " << divisor << ": " << from[at].item<float>() << " gave "
                      << got[at].item<float>() << ", ATen " << expected[at].item<float>();
  }
  // A length that leaves a remainder after whole vectors, and a view that starts inside a tensor.
  const auto part = from.narrow(0, 3, 1003);
  EXPECT_EQ(first_difference(detail::to_half_divided(part, 3), part.to(torch::kHalf).div_(3)), -1);
}

// The hook's form: each bucket compressed over the first half of its own bytes and, once summed,
// widened back there. Lengths that leave a remainder after whole vectors at either end.
TEST_P(HalfMath, CompressionInPlaceAndWideningBackGiveTheSameBitsAsWithCopies) {
  torch::manual_seed(5);
  const auto values = torch::cat({torch::randn({70000}) * torch::exp(torch::randn({70000}) * 5),
                                  every_half().to(torch::kFloat)});
  for (const int64_t length : {int64_t{1}, int64_t{7}, int64_t{8}, int64_t{9}, int64_t{1003}, values.numel()}) {
    const auto from = values.narrow(0, values.numel() - length, length);
    for (const int64_t divisor : {1, 3, 4}) {
      const auto expected = detail::to_half_divided(from, divisor);
      auto bucket = from.clone();
      const auto halves = detail::to_half_divided_in_place(bucket, divisor);
      ASSERT_EQ(halves.scalar_type(), torch::kHalf);
      ASSERT_EQ(halves.numel(), length);
      ASSERT_EQ(halves.data_ptr(), bucket.data_ptr()) << "not in the bucket's own bytes";
      const auto at = first_difference(halves, expected);
      EXPECT_EQ(at, -1) << "length " << length << ", divisor " << divisor;
      // Widened back: every fp16 value exactly, NaN where it was NaN.
      const auto widened = halves.to(torch::kFloat);
      detail::widen_in_place(bucket, halves);
      const auto nan = widened.isnan();
      EXPECT_TRUE(torch::equal(bucket.masked_fill(nan, 0), widened.masked_fill(nan, 0)))
          << "length " << length << ", divisor " << divisor;
      EXPECT_TRUE(torch::equal(bucket.isnan(), nan));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, HalfMath, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Aten" : "ThisProcessor"; });

}  // namespace
}  // namespace accelerate::testing
