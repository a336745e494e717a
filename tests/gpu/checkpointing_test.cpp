// Checkpoints on a CUDA machine: `save_state` records every GPU's generator state next to the
// CPU one (upstream's `torch_cuda_manual_seed`), and `load_state` puts it back, so random draws on
// the GPU after a resume repeat those after the save. Every test skips without a GPU.
#include "accelerate/accelerator.h"
#include "accelerate/checkpointing.h"
#include "accelerate/utils/safetensors.h"
#include "support/accelerators.h"
#include "support/gpu.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace accelerate::testing {
namespace {

TEST(CudaCheckpoint, LoadStateRestoresTheDrawsOfTheGpuGeneratorAfterSaveState) {
  SKIP_WITHOUT_GPUS(1);
  TempDir dir;
  run_accelerators(1, [&](const Accelerator& acc, int) {
    ASSERT_TRUE(acc.device().is_cuda()) << acc.device();
    torch::nn::Linear net(2, 1);
    auto model = acc.prepare(net);
    (void)torch::randn({3}, acc.device());  // move the generator away from its seed
    const std::string folder = acc.save_state((dir.path() / "ckpt").string());

    const auto first = torch::randn({16}, acc.device());
    const auto first_cpu = torch::rand({4});
    const auto later = torch::randn({16}, acc.device());
    ASSERT_FALSE(torch::equal(first, later)) << "the generator does not move on; equal draws would prove nothing";

    acc.load_state(folder);
    EXPECT_TRUE(torch::equal(torch::randn({16}, acc.device()), first)) << "the GPU draws after load_state differ "
                                                                          "from those after save_state";
    EXPECT_TRUE(torch::equal(torch::rand({4}), first_cpu));

    // Every device's state is in the checkpoint, under upstream's name.
    const auto states = load_file(folder + "/random_states_0.safetensors");
    EXPECT_EQ(states.count("torch_manual_seed"), 1u);
    for (int i = 0; i < cuda_device_count(); ++i) {
      EXPECT_EQ(states.count("torch_cuda_manual_seed." + std::to_string(i)), 1u) << "no state for GPU " << i;
    }
  });
}

TEST(CudaCheckpoint, RngStateDictRestoresTheDrawsOfEveryGpu) {
  SKIP_WITHOUT_GPUS(1);
  const int gpus = cuda_device_count();
  const auto state = rng_state_dict();
  std::vector<at::Tensor> expected;
  for (int i = 0; i < gpus; ++i) expected.push_back(torch::randn({8}, torch::Device(torch::kCUDA, i)));
  for (int i = 0; i < gpus; ++i) (void)torch::randn({5}, torch::Device(torch::kCUDA, i));
  load_rng_state_dict(state);
  for (int i = 0; i < gpus; ++i) {
    EXPECT_TRUE(torch::equal(torch::randn({8}, torch::Device(torch::kCUDA, i)), expected[i])) << "GPU " << i;
  }
}

}  // namespace
}  // namespace accelerate::testing
