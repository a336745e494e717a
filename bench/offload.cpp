// W8: forward throughput of a model whose weights are offloaded to the disk (read in before each
// layer, released after) against the same model fully in memory (the limit). 16 Linear(1024,1024)
// layers with tanh (64 MB of fp32 weights), batch 64, no gradients. The offloaded model is built
// on the meta device and loaded with `load_checkpoint_and_dispatch` and a device map that puts
// everything on the disk; weights come from the checkpoint's safetensors files through the page
// cache (warm after the first pass), which is what the twin's memory-mapped `.dat` files read too.
// Prints one JSON object per variant with the median samples/s over the repetitions (after one
// warm-up) and a checksum of the output, as bench/offload_twin.py does.
// Usage: bench_offload DIR [--quick]
#include <accelerate/accelerate.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace acc = accelerate;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kLayers = 16;
constexpr int kWidth = 1024;
constexpr int kBatch = 64;

torch::nn::Sequential make_model() {
  torch::nn::Sequential model;
  for (int i = 0; i < kLayers; ++i) {
    model->push_back(torch::nn::Linear(kWidth, kWidth));
    model->push_back(torch::nn::Tanh());
  }
  return model;
}

void report(const char* variant, const std::vector<double>& seconds, int iters, double checksum) {
  auto sorted = seconds;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  std::printf(
      "{\"workload\": \"offload\", \"variant\": \"%s\", \"side\": \"cpp\", \"samples_per_s\": %.1f, "
      "\"min_samples_per_s\": %.1f, \"max_samples_per_s\": %.1f, \"checksum\": %.6f}\n",
      variant, iters * kBatch / median, iters * kBatch / sorted.back(), iters * kBatch / sorted.front(), checksum);
  std::fflush(stdout);
}

template <typename Forward>
void measure(const char* variant, Forward forward, const at::Tensor& x, int iters, int reps) {
  std::vector<double> seconds;
  double checksum = 0;
  for (int r = 0; r <= reps; ++r) {
    const auto start = Clock::now();
    for (int i = 0; i < iters; ++i) checksum = forward(x).sum().template item<double>();
    if (r > 0) seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  report(variant, seconds, iters, checksum);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_offload DIR [--quick]\n");
    return 2;
  }
  const fs::path dir = argv[1];
  const bool quick = argc > 2 && std::string(argv[2]) == "--quick";
  const int iters = quick ? 5 : 20;
  const int reps = quick ? 3 : 5;
  at::set_num_threads(1);
  torch::NoGradGuard no_grad;
  torch::manual_seed(0);
  auto model = make_model();
  const auto x = torch::randn({kBatch, kWidth});
  fs::remove_all(dir);
  acc::save_state_dict_sharded(acc::get_state_dict(*model), (dir / "checkpoint").string(), "16MB");
  measure(
      "in_memory", [&](const at::Tensor& input) { return model->forward(input); }, x, iters, reps);

  auto offloaded = acc::init_empty_weights(make_model);
  acc::load_checkpoint_and_dispatch(
      *offloaded, (dir / "checkpoint").string(),
      {.device_map = acc::DeviceMap{{"", "disk"}}, .offload_folder = (dir / "offload").string()});
  measure(
      "disk_offload", [&](const at::Tensor& input) { return acc::forward(offloaded, input); }, x, iters, reps);
  return 0;
}
