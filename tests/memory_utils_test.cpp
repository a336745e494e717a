// Out-of-memory recovery against LibTorch's real CPU allocator (upstream: test_memory_utils.py):
// "too large" batches ask the allocator for far more memory than any machine has, so the errors
// are the allocator's own.
#include "accelerate/memory_utils.h"
#include "support/test_support.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

namespace accelerate::testing {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

// Under AddressSanitizer an allocation that cannot be satisfied aborts the program, unless
// ASAN_OPTIONS has allocator_may_return_null=1; LibTorch's allocator never gets to throw.
bool allocation_failures_throw() {
#if defined(__SANITIZE_ADDRESS__)
  const char* options = std::getenv("ASAN_OPTIONS");
  return options != nullptr && std::string_view(options).find("allocator_may_return_null=1") != std::string_view::npos;
#else
  return true;
#endif
}

#define SKIP_UNLESS_ALLOCATION_FAILURES_THROW()                                                    \
  if (!allocation_failures_throw())                                                                \
  GTEST_SKIP() << "AddressSanitizer aborts on impossible allocations; run with "                   \
                  "ASAN_OPTIONS=allocator_may_return_null=1"

// A training step whose batches of more than `fits` samples need 2^37 floats (512 GiB) per
// sample, which the CPU allocator refuses; smaller batches allocate normally.
at::Tensor step(int64_t batch_size, int64_t fits) {
  if (batch_size > fits) return at::empty({batch_size * (int64_t{1} << 37)});
  return at::ones({batch_size});
}

// Every size that upstream's rule tries from 128 down to 1.
std::vector<int64_t> sizes_from_128_to_1() {
  std::vector<int64_t> sizes;
  for (int64_t size = 128; size > 0; size = static_cast<int64_t>(static_cast<double>(size) * 0.9)) sizes.push_back(size);
  return sizes;
}

TEST(FindExecutableBatchSize, ShrinksTheBatchByTenPercentUntilItFits) {
  SKIP_UNLESS_ALLOCATION_FAILURES_THROW();
  std::vector<int64_t> tried;
  auto run = find_executable_batch_size([&](int64_t batch_size) {
    tried.push_back(batch_size);
    return step(batch_size, /*fits=*/20);
  });
  const at::Tensor result = run();
  EXPECT_THAT(tried, ElementsAre(128, 115, 103, 92, 82, 73, 65, 58, 52, 46, 41, 36, 32, 28, 25, 22, 19));
  EXPECT_EQ(result.numel(), 19);
}

TEST(FindExecutableBatchSize, FollowsUpstreamsIntOfNinetyPercentAllTheWayDown) {
  std::vector<int64_t> tried;
  auto run = find_executable_batch_size([&](int64_t batch_size) {
    tried.push_back(batch_size);
    if (batch_size > 1) throw std::bad_alloc();
  });
  run();
  EXPECT_THAT(tried, ElementsAreArray(sizes_from_128_to_1()));
}

TEST(FindExecutableBatchSize, PassesTheCallersArgumentsAfterTheBatchSize) {
  SKIP_UNLESS_ALLOCATION_FAILURES_THROW();
  int calls = 0;
  auto run = find_executable_batch_size(
      [&](int64_t batch_size, int scale, const std::string& name) {
        ++calls;
        return name + ":" + std::to_string(step(batch_size, 100).numel() * scale);
      },
      /*starting_batch_size=*/128);
  EXPECT_EQ(run(2, std::string("mlp")), "mlp:184");  // 128, 115 and 103 failed; 92 fitted
  EXPECT_EQ(calls, 4);
}

TEST(FindExecutableBatchSize, AWrapperCallStartsFromTheSizeThatFittedLastTime) {
  SKIP_UNLESS_ALLOCATION_FAILURES_THROW();
  std::vector<int64_t> tried;
  auto run = find_executable_batch_size(
      [&](int64_t batch_size) {
        tried.push_back(batch_size);
        (void)step(batch_size, 10);
      },
      /*starting_batch_size=*/16);
  run();
  EXPECT_THAT(tried, ElementsAre(16, 14, 12, 10));
  tried.clear();
  auto copy = run;  // copies share what was learnt, as calls of upstream's decorated function do
  copy();
  EXPECT_THAT(tried, ElementsAre(10));
}

TEST(FindExecutableBatchSize, ThrowsWhenNotEvenOneSampleFits) {
  SKIP_UNLESS_ALLOCATION_FAILURES_THROW();
  std::vector<int64_t> tried;
  auto run = find_executable_batch_size([&](int64_t batch_size) {
    tried.push_back(batch_size);
    return step(batch_size, /*fits=*/0);
  });
  EXPECT_THROWS_WITH(run(), "[find_executable_batch_size] No executable batch size found, reached zero.");
  EXPECT_EQ(tried, sizes_from_128_to_1());
}

TEST(FindExecutableBatchSize, StartingAtZeroThrowsWithoutCallingTheFunction) {
  int calls = 0;
  auto run = find_executable_batch_size([&](int64_t) { ++calls; }, /*starting_batch_size=*/0);
  EXPECT_THROWS_WITH(run(), "No executable batch size found, reached zero.");
  EXPECT_EQ(calls, 0);
  EXPECT_THROWS_WITH(find_executable_batch_size([](int64_t) {}, -4), "starting_batch_size must not be negative, got -4");
}

TEST(FindExecutableBatchSize, OtherErrorsPropagateUnchangedAfterOneCall) {
  int calls = 0;
  auto logic = find_executable_batch_size([&](int64_t) -> int {
    ++calls;
    throw std::invalid_argument("labels and logits disagree");
  });
  EXPECT_THROW(logic(), std::invalid_argument);
  EXPECT_EQ(calls, 1);

  calls = 0;
  auto shapes = find_executable_batch_size([&](int64_t batch_size) {
    ++calls;
    return at::ones({batch_size, 3}).mm(at::ones({4, 2}));
  });
  EXPECT_THROWS_WITH(shapes(), "cannot be multiplied");
  EXPECT_EQ(calls, 1);
}

TEST(FindExecutableBatchSize, AGivenReductionRuleReplacesTheDefault) {
  SKIP_UNLESS_ALLOCATION_FAILURES_THROW();
  std::vector<int64_t> tried;
  auto halve = [](int64_t failed) { return failed / 2; };
  auto run = find_executable_batch_size(
      [&](int64_t batch_size) {
        tried.push_back(batch_size);
        return step(batch_size, 20);
      },
      128, halve);
  (void)run();
  EXPECT_THAT(tried, ElementsAre(128, 64, 32, 16));
}

TEST(FindExecutableBatchSize, AReductionRuleThatDoesNotShrinkIsAnError) {
  int calls = 0;
  auto run = find_executable_batch_size(
      [&](int64_t) {
        ++calls;
        throw std::bad_alloc();
      },
      8, [](int64_t failed) { return failed; });
  EXPECT_THROWS_WITH(run(), "reduce_batch_size_fn must return a smaller, non-negative batch size; after 8 it returned 8");
  EXPECT_EQ(calls, 1);
}

TEST(ShouldReduceBatchSize, RecognisesTheCpuAllocatorsOutOfMemoryError) {
  SKIP_UNLESS_ALLOCATION_FAILURES_THROW();
  try {
    (void)at::empty({int64_t{1} << 42});
    FAIL() << "allocating 16 TiB succeeded";
  } catch (const std::exception& e) {
    EXPECT_THAT(detail::error_text(e), ::testing::HasSubstr("DefaultCPUAllocator: can't allocate memory"));
    EXPECT_TRUE(should_reduce_batch_size(e));
  }
}

TEST(ShouldReduceBatchSize, RecognisesOutOfMemoryErrorsOfOtherDevicesAndLibraries) {
  EXPECT_TRUE(should_reduce_batch_size(std::bad_alloc()));
  EXPECT_TRUE(should_reduce_batch_size(std::runtime_error("CUDA out of memory. Tried to allocate 2.00 GiB")));
  EXPECT_TRUE(should_reduce_batch_size(std::runtime_error("CUDA error: out of memory\nCUDA kernel errors …")));
  EXPECT_TRUE(should_reduce_batch_size(std::runtime_error("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may")));
  EXPECT_TRUE(should_reduce_batch_size(std::runtime_error("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")));
  EXPECT_TRUE(should_reduce_batch_size(std::runtime_error("DefaultCPUAllocator: not enough memory: you tried to")));
  try {
    C10_THROW_ERROR(OutOfMemoryError, "any message");
  } catch (const c10::Error& e) {
    EXPECT_TRUE(should_reduce_batch_size(e));
  }
  try {
    TORCH_CHECK(false, "XPU out of memory. Tried to allocate 1 GiB");
  } catch (const c10::Error& e) {
    EXPECT_TRUE(should_reduce_batch_size(e));
  }
}

TEST(ShouldReduceBatchSize, OtherErrorsAreNotOutOfMemory) {
  EXPECT_FALSE(should_reduce_batch_size(std::runtime_error("shape mismatch")));
  EXPECT_FALSE(should_reduce_batch_size(std::logic_error("CUDA out of memory. (not a runtime error)")));
  EXPECT_FALSE(should_reduce_batch_size(std::bad_cast()));
  try {
    TORCH_CHECK(false, "expected a float tensor");
  } catch (const c10::Error& e) {
    EXPECT_FALSE(should_reduce_batch_size(e));
  }
}

TEST(ClearDeviceCache, IsSafeToCallWithoutCuda) {
  clear_device_cache();
  clear_device_cache();
}

}  // namespace
}  // namespace accelerate::testing
