// Random generators on CUDA machines (accelerate/utils/random.h): `set_seed` seeds every GPU's
// generator, and `synchronize_rng_states({"cuda"})` gives every GPU process the generator state
// of process 0 (two GPUs, ranks as threads over NCCL). Every test skips without enough GPUs.
#include "accelerate/utils/random.h"
#include "support/gpu.h"
#include "support/test_support.h"

#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <mutex>

namespace accelerate::testing {
namespace {

TEST(CudaRandom, SetSeedSeedsTheGeneratorOfEveryGpu) {
  SKIP_WITHOUT_GPUS(1);
  for (int i = 0; i < cuda_device_count(); ++i) {
    const torch::Device gpu(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
    set_seed(42);
    const auto first = torch::randn({8}, gpu);
    set_seed(42);
    EXPECT_TRUE(torch::equal(torch::randn({8}, gpu), first)) << "set_seed(42) twice gave different draws on GPU " << i;
    set_seed(43);
    EXPECT_FALSE(torch::equal(torch::randn({8}, gpu), first)) << "set_seed(43) gave set_seed(42)'s draws on GPU " << i;
  }
}

TEST(CudaRandom, SynchronizeRngStatesGivesEveryGpuProcessTheGeneratorOfProcessZero) {
  SKIP_WITHOUT_GPUS(2);
  std::vector<at::Tensor> draws(2);
  run_ranks(2, [&](const PartialState& state) {
    const int rank = state.process_index();
    ASSERT_EQ(state.device(), torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(rank)));
    ASSERT_EQ(state.backend(), "nccl");
    {
      // Each rank's own device generator, seeded differently.
      auto generator = at::globalContext().defaultGenerator(state.device());
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_current_seed(100 + static_cast<uint64_t>(rank));
    }
    synchronize_rng_states(state, {"cuda"});
    draws[rank] = torch::randn({8}, state.device()).cpu();
  });
  EXPECT_TRUE(torch::equal(draws[0], draws[1])) << "GPU 1 did not take GPU 0's generator state";
}

}  // namespace
}  // namespace accelerate::testing
