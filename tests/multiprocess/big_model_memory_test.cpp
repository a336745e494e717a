// A model four times larger than the CPU memory it is given runs with disk offload, and the
// process's peak resident memory (from /proc/self/status) stays near the budget plus the largest
// layer, in the first pass and in the later ones that read the next layer ahead. Kept out of the sanitizer tier: resident memory under AddressSanitizer is not the
// program's own.
#include "accelerate/big_modeling.h"

#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <map>
#include <string>

namespace acc = accelerate;
using acc::testing::TempDir;

namespace {

constexpr int kLayers = 16;
constexpr int kWidth = 2048;  // 16 MiB of weights per layer, 256 MiB in all
constexpr int64_t kLayerBytes = (int64_t{kWidth} * kWidth + kWidth) * 4;
constexpr int64_t kBudget = int64_t{64} << 20;  // a quarter of the checkpoint
constexpr int64_t kMargin = int64_t{32} << 20;  // activations, allocator slack, mapped headers

torch::nn::Sequential make_model() {
  torch::nn::Sequential model;
  for (int i = 0; i < kLayers; ++i) {
    model->push_back(torch::nn::Linear(kWidth, kWidth));
    model->push_back(torch::nn::Tanh());
  }
  return model;
}

// One reading of /proc/self/status, so that the values it holds belong to the same moment.
std::map<std::string, int64_t> status_values() {
  std::ifstream status("/proc/self/status");
  std::map<std::string, int64_t> values;
  std::string line;
  while (std::getline(status, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos || !line.ends_with(" kB")) continue;
    values[line.substr(0, colon)] = std::stoll(line.substr(colon + 1)) * 1024;
  }
  return values;
}

int64_t status_bytes(const std::string& key) {
  const auto values = status_values();
  const auto it = values.find(key);
  if (it == values.end()) {
    ADD_FAILURE() << key << " not found in /proc/self/status";
    return 0;
  }
  return it->second;
}

// Starts a new peak: the kernel resets VmHWM to the current resident size. Afterwards the peak
// must be (near) the resident size, or the reset did not happen. A page freed between the reset and
// the reading (a library thread ending and releasing its stack, say) widens that gap without
// anything being wrong, so a wide gap is given a few more resets before it counts as a failure.
void reset_peak() {
  malloc_trim(0);
  int64_t gap = 0;
  for (int attempt = 0; attempt < 5; ++attempt) {
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
    clear.close();
    ASSERT_TRUE(clear.good()) << "cannot reset the peak resident size through /proc/self/clear_refs";
    const auto values = status_values();
    ASSERT_TRUE(values.contains("VmHWM") && values.contains("VmRSS")) << "/proc/self/status lacks VmHWM or VmRSS";
    gap = values.at("VmHWM") - values.at("VmRSS");
    if (gap <= (int64_t{4} << 20)) return;
  }
  ADD_FAILURE() << "the peak resident size stayed " << (gap >> 10) << " KiB above the resident size after 5 resets";
}

}  // namespace

TEST(BigModelMemory, DiskOffloadedModelStaysWithinBudgetPlusLargestLayer) {
  TempDir checkpoint, offload;
  torch::manual_seed(0);
  const auto x = torch::randn({4, kWidth});
  at::Tensor expected;
  {
    auto model = make_model();
    torch::NoGradGuard no_grad;
    expected = model->forward(x);
    acc::save_state_dict_sharded(acc::get_state_dict(*model), checkpoint.str(), "64MB");
  }

  auto model = acc::init_empty_weights(make_model);
  reset_peak();
  const int64_t base = status_bytes("VmRSS");
  acc::load_checkpoint_and_dispatch(*model, checkpoint.str(),
                                    {.device_map = std::string("auto"),
                                     .max_memory = acc::MaxMemory{{"cpu", kBudget}},
                                     .offload_folder = offload.str()});
  at::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = acc::forward(model, x);
  }
  const int64_t grown = status_bytes("VmHWM") - base;
  EXPECT_TRUE(torch::allclose(out, expected, 1e-5, 1e-6));
  // Two layers fit the CPU budget once room for the largest layer is kept; the rest is on disk.
  EXPECT_FALSE(model[2]->as<torch::nn::Linear>()->weight.is_meta());
  EXPECT_TRUE(model[4]->as<torch::nn::Linear>()->weight.is_meta());
  EXPECT_EQ(acc::load_offload_index(offload.str()).size(), 2u * (kLayers - 2));
  EXPECT_LT(grown, kBudget + kLayerBytes + kMargin) << "peak grew by " << (grown >> 20) << " MiB";
  std::cout << "disk-offloaded run: peak resident memory grew by " << (grown >> 20) << " MiB for a "
            << ((kLayers * kLayerBytes) >> 20) << " MiB checkpoint and a " << (kBudget >> 20) << " MiB budget\n";

  // Later passes read each module's weights ahead while the one before computes: one module more
  // in memory at a time (and one recycled buffer), still within the bound.
  for (int pass = 0; pass < 3; ++pass) {
    reset_peak();
    const int64_t before = status_bytes("VmRSS");
    {
      torch::NoGradGuard no_grad;
      out = acc::forward(model, x);
    }
    const int64_t pass_grown = status_bytes("VmHWM") - base;
    EXPECT_TRUE(torch::allclose(out, expected, 1e-5, 1e-6)) << "pass " << pass;
    EXPECT_LT(pass_grown, kBudget + kLayerBytes + kMargin)
        << "pass " << pass << " peaked " << (pass_grown >> 20) << " MiB above the start (" << ((before - base) >> 20)
        << " MiB before it)";
  }

  // The measurement can tell: the same model loaded whole grows by the checkpoint's size.
  auto whole = acc::init_empty_weights(make_model);
  reset_peak();
  const int64_t base_whole = status_bytes("VmRSS");
  acc::load_checkpoint_and_dispatch(*whole, checkpoint.str(), {.device_map = acc::DeviceMap{{"", "cpu"}}});
  EXPECT_GT(status_bytes("VmHWM") - base_whole, kLayers * kLayerBytes);
}
