// Out-of-memory recovery on a real GPU (accelerate/memory_utils.h): the CUDA caching allocator's
// out-of-memory error is recognised, and `find_executable_batch_size` retries a function that
// allocates too much with smaller batch sizes until one fits. Every test skips without a GPU.
#include "accelerate/memory_utils.h"
#include "support/gpu.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace accelerate::testing {
namespace {

// 1 GiB per sample: a batch of 2^16 samples asks for 64 TiB, more than any GPU has.
constexpr int64_t kBytesPerSample = int64_t{1} << 30;
constexpr int64_t kStartingBatchSize = int64_t{1} << 16;

at::Tensor allocate_batch(int64_t batch_size) {
  return torch::empty({batch_size, kBytesPerSample}, torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA));
}

TEST(CudaOutOfMemory, TheCachingAllocatorsErrorIsOneToReduceTheBatchSizeFor) {
  SKIP_WITHOUT_GPUS(1);
  try {
    (void)allocate_batch(kStartingBatchSize);
    FAIL() << "allocating 64 TiB on the GPU succeeded";
  } catch (const std::exception& e) {
    EXPECT_TRUE(should_reduce_batch_size(e)) << "not recognised as out of memory: " << e.what();
  }
  clear_device_cache();
}

TEST(CudaFindExecutableBatchSize, HalvesTheBatchAfterEachCudaOutOfMemoryErrorUntilItFits) {
  SKIP_WITHOUT_GPUS(1);
  std::vector<int64_t> tried;
  auto train = find_executable_batch_size(
      [&](int64_t batch_size) {
        tried.push_back(batch_size);
        const auto batch = allocate_batch(batch_size);  // throws c10::OutOfMemoryError while too large
        return batch.size(0);
      },
      kStartingBatchSize, [](int64_t failed) { return failed / 2; });
  const int64_t fitted = train();
  clear_device_cache();
  ASSERT_FALSE(tried.empty());
  EXPECT_EQ(tried.back(), fitted);
  EXPECT_LT(fitted, kStartingBatchSize) << "64 TiB fitted on this GPU";
  EXPECT_GE(fitted, 1);
  // Every size from the start, halved after each failure, up to the first that fitted.
  std::vector<int64_t> halvings;
  for (int64_t size = kStartingBatchSize; size >= fitted; size /= 2) halvings.push_back(size);
  EXPECT_EQ(tried, halvings);
}

}  // namespace
}  // namespace accelerate::testing
