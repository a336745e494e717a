// Device maps with GPU indices (accelerate/big_modeling.h, accelerate/utils/device_map.h): a model
// dispatched over GPUs, the CPU and the disk computes what the model computes on the CPU, with
// each part's weights where the map put them. Every test skips without enough GPUs.
#include "accelerate/big_modeling.h"
#include "support/gpu.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace accelerate::testing {
namespace {

torch::nn::Sequential make_mlp() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 16),
                               torch::nn::ReLU(), torch::nn::Linear(16, 4));
}

at::Tensor weight_of(torch::nn::Sequential& model, size_t index) {
  return model[index]->as<torch::nn::Linear>()->weight;
}

torch::Device gpu(int index) { return torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index)); }

// GPU float products may sum in another order than the CPU's.
void expect_same_output(const at::Tensor& out, const at::Tensor& expected) {
  EXPECT_TRUE(torch::allclose(out.cpu(), expected, /*rtol=*/1e-4, /*atol=*/1e-5)) << out << expected;
}

TEST(CudaDispatch, ALayerOnGpuZeroAndALayerOnTheCpuComputeWhatTheCpuModelComputes) {
  SKIP_WITHOUT_GPUS(1);
  auto plain = make_mlp();
  const auto x = torch::randn({5, 8});
  const auto expected = plain->forward(x);

  auto model = make_mlp();
  dispatch_model(*model, DeviceMap{{"0", 0}, {"2", "cpu"}, {"4", "cuda:0"}});
  EXPECT_EQ(weight_of(model, 0).device(), gpu(0));
  EXPECT_EQ(weight_of(model, 4).device(), gpu(0));
  // The "cpu" layer is offloaded: its weights come to GPU 0 only while it runs.
  EXPECT_TRUE(weight_of(model, 2).is_meta());

  const auto out = forward(model, x);
  EXPECT_TRUE(out.is_cpu()) << "outputs go back to the device of the inputs, got " << out.device();
  expect_same_output(out, expected);
  EXPECT_TRUE(weight_of(model, 2).is_meta()) << "the offloaded layer kept its weights after the call";

  const auto out_gpu = forward(model, x.to(gpu(0)));
  EXPECT_EQ(out_gpu.device(), gpu(0));
  expect_same_output(out_gpu, expected);
}

TEST(CudaDispatch, LoadCheckpointAndDispatchMaterialisesGpuLayersOnTheGpuAndOffloadsTheRest) {
  SKIP_WITHOUT_GPUS(1);
  auto plain = make_mlp();
  const auto x = torch::randn({4, 8});
  const auto expected = plain->forward(x);
  TempDir checkpoint, offload;
  save_state_dict_sharded(get_state_dict(*plain), checkpoint.str());

  auto model = init_empty_weights(make_mlp);
  load_checkpoint_and_dispatch(
      *model, checkpoint.str(),
      {.device_map = DeviceMap{{"0", 0}, {"2", "disk"}, {"4", "cpu"}}, .offload_folder = offload.str()});
  EXPECT_EQ(weight_of(model, 0).device(), gpu(0));
  EXPECT_TRUE(weight_of(model, 2).is_meta());
  EXPECT_TRUE(weight_of(model, 4).is_meta());
  expect_same_output(forward(model, x), expected);
}

TEST(CudaDispatch, LayersOnTwoGpusComputeWhatTheCpuModelComputes) {
  SKIP_WITHOUT_GPUS(2);
  auto plain = make_mlp();
  const auto x = torch::randn({5, 8});
  const auto expected = plain->forward(x);

  auto model = make_mlp();
  dispatch_model(*model, DeviceMap{{"0", 0}, {"2", 1}, {"4", "cuda:1"}});
  EXPECT_EQ(weight_of(model, 0).device(), gpu(0));
  EXPECT_EQ(weight_of(model, 2).device(), gpu(1));
  EXPECT_EQ(weight_of(model, 4).device(), gpu(1));
  const auto out = forward(model, x);
  EXPECT_TRUE(out.is_cpu()) << out.device();
  expect_same_output(out, expected);
}

}  // namespace
}  // namespace accelerate::testing
