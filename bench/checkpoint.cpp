// Checkpoint throughput: saving (with fsync) and loading a ~200 MB state dict as safetensors, and
// `save_state` / `load_state` of a small transformer trained one step with AdamW. One process.
// Loading the state dict copies every tensor into preallocated tensors of the same shapes (what
// loading weights into a model does, through `SafetensorsFile::read_into` as
// `load_checkpoint_in_model` does). Prints one JSON object per workload with the median over
// the repetitions (after one warm-up), as bench/checkpoint_twin.py does for torch.save/torch.load;
// bench/run_checkpoint compares them next to dd's rates for the same size on the same disk.
// Usage: bench_checkpoint DIR [--quick]
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

double seconds_of(const std::function<void()>& fn) {
  const auto start = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

uint64_t folder_bytes(const fs::path& folder) {
  uint64_t total = 0;
  for (const auto& e : fs::recursive_directory_iterator(folder)) {
    if (e.is_regular_file()) total += e.file_size();
  }
  return total;
}

void report(const char* workload, uint64_t bytes, const std::vector<double>& save, const std::vector<double>& load) {
  std::printf("{\"workload\": \"%s\", \"side\": \"cpp\", \"bytes\": %llu, \"save_mb_per_s\": %.1f, "
              "\"load_mb_per_s\": %.1f, \"save_s\": %.4f, \"load_s\": %.4f}\n",
              workload, static_cast<unsigned long long>(bytes), bytes / 1e6 / median(save), bytes / 1e6 / median(load),
              median(save), median(load));
  std::fflush(stdout);
}

void state_dict_200mb(const fs::path& dir, int reps) {
  // 50 float tensors of 1M elements (4 MB each): 200 MB.
  acc::TensorMap tensors, targets;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
  for (int i = 0; i < 50; ++i) {
    const auto name = "layer." + std::to_string(i) + ".weight";
    tensors.emplace(name, at::randn({1024, 1024}, gen));
    targets.emplace(name, at::empty({1024, 1024}));
  }
  const auto path = (dir / "state.safetensors").string();
  std::vector<double> save, load;
  for (int r = 0; r <= reps; ++r) {
    const double s = seconds_of([&] { acc::save_file(tensors, path, {{"format", "pt"}}, /*fsync=*/true); });
    const double l = seconds_of([&] { acc::SafetensorsFile(path).read_into(targets); });
    if (r > 0) save.push_back(s), load.push_back(l);
  }
  TORCH_CHECK(at::equal(targets.begin()->second, tensors.begin()->second), "bench_checkpoint: load mismatch");
  report("state_dict_200mb", fs::file_size(path), save, load);
}

void transformer_save_state(const fs::path& dir, int reps) {
  torch::manual_seed(0);
  acc::Accelerator accelerator;
  torch::nn::TransformerEncoder encoder(
      torch::nn::TransformerEncoderOptions(torch::nn::TransformerEncoderLayerOptions(256, 4), 2));
  auto adamw = std::make_shared<torch::optim::AdamW>(encoder->parameters(), 1e-3);
  auto [model, optimizer] = accelerator.prepare(encoder, adamw);
  auto x = torch::randn({64, 16, 256});
  accelerator.backward(model(x).pow(2).mean());
  optimizer.step();
  std::vector<double> save, load;
  uint64_t bytes = 0;
  for (int r = 0; r <= reps; ++r) {
    const auto out = dir / ("state_" + std::to_string(r));
    const double s = seconds_of([&] { accelerator.save_state(out.string()); });
    const double l = seconds_of([&] { accelerator.load_state(out.string()); });
    bytes = folder_bytes(out);
    if (r > 0) save.push_back(s), load.push_back(l);
    fs::remove_all(out);
  }
  report("transformer_save_state", bytes, save, load);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_checkpoint DIR [--quick]\n");
    return 2;
  }
  const fs::path dir(argv[1]);
  const bool quick = argc > 2 && std::string(argv[2]) == "--quick";
  fs::create_directories(dir);
  state_dict_200mb(dir, quick ? 2 : 5);
  transformer_save_state(dir, quick ? 3 : 10);
  return 0;
}
