// W9: training throughput and peak memory of a transformer-sized model of blocks under DDP and
// under fully sharded data parallelism (FULL_SHARD and SHARD_GRAD_OP, each block a unit), on the
// processes `accelerate launch` starts. Blocks are pre-norm MLP blocks (LayerNorm, Linear d→4d,
// GELU, Linear 4d→d, residual): the parameters, gradients and AdamW state that sharding divides
// are those of a transformer's MLPs, which hold two thirds of its parameters. Process 0 prints one
// JSON object: samples/s over the timed steps (after warm-up), its peak resident memory (VmHWM),
// its resident memory before the model was built, the fp32 bytes of the largest unit, and the
// final loss. On a GPU (the accelerator's device) the model and the batches live there, and it
// also prints the CUDA caching allocator's peaks of its device (allocated to tensors and
// reserved), the figures FSDP divides.
// Usage: accelerate launch -n N bench_fsdp ddp|full_shard|shard_grad_op [--quick]
#include "device_memory.h"

#include <accelerate/accelerate.h>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace acc = accelerate;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kWidth = 768;
constexpr int kBlocks = 8;
constexpr int64_t kRowsPerProcess = 64;

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kWidth})))),
        up(register_module("up", torch::nn::Linear(kWidth, 4 * kWidth))),
        down(register_module("down", torch::nn::Linear(4 * kWidth, kWidth))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + down(torch::gelu(up(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl() : head(register_module("head", torch::nn::Linear(kWidth, 16))) {
    for (int i = 0; i < kBlocks; ++i) blocks->push_back(Block());
    register_module("blocks", blocks);
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(acc::forward(blocks, x)); }
  torch::nn::Sequential blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

// A field of /proc/self/status, in MiB.
double status_mib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  TORCH_CHECK(argc >= 2, "usage: bench_fsdp ddp|full_shard|shard_grad_op [--quick]");
  const std::string mode = argv[1];
  const bool quick = argc > 2 && std::string(argv[2]) == "--quick";
  const double base_mib = status_mib("VmRSS");
  acc::AcceleratorOptions options;
  if (mode != "ddp") {
    TORCH_CHECK(mode == "full_shard" || mode == "shard_grad_op", "unknown mode ", mode);
    options.fsdp_plugin = acc::FullyShardedDataParallelPlugin{
        .sharding_strategy = mode == "full_shard" ? acc::FsdpShardingStrategy::kFullShard
                                                  : acc::FsdpShardingStrategy::kShardGradOp,
        .auto_wrap_policy = acc::FsdpAutoWrapPolicy::kTransformerBasedWrap,
        .transformer_cls_names_to_wrap = {"Block"}};
    if (const char* r = std::getenv("BENCH_FSDP_RANK0_ONLY"); r != nullptr && std::string(r) == "0") {
      options.fsdp_plugin->state_dict_config = acc::FsdpStateDictConfig{.offload_to_cpu = true, .rank0_only = false};
      options.fsdp_plugin->optim_state_dict_config = options.fsdp_plugin->state_dict_config;
    }
  }
  acc::Accelerator accelerator(options);
  const c10::Device device = accelerator.device();
  const int gpu = device.is_cuda() ? device.index() : -1;
  if (gpu >= 0) {
    // The caching allocator knows its devices once CUDA started in this process: one allocation
    // first, or resetting the peaks fails with "Invalid device argument".
    (void)at::empty({1}, at::TensorOptions().device(device));
    bench::reset_device_peaks(gpu);
  }
  torch::manual_seed(0);
  Net net;
  int64_t params = 0;
  for (const auto& p : net->parameters()) params += p.numel();
  int64_t largest_unit = 0;
  for (const auto& p : net->blocks->ptr(0)->parameters()) largest_unit += p.numel() * 4;
  // BENCH_FSDP_STAGES=1: where the peak is reached (resident and peak memory after each stage).
  const bool stages = std::getenv("BENCH_FSDP_STAGES") != nullptr;
  const auto stage = [&](const char* name) {
    if (stages) std::fprintf(stderr, "stage %s: rss %.1f MiB, peak %.1f MiB\n", name, status_mib("VmRSS"), status_mib("VmHWM"));
  };
  stage("model built");
  auto adamw = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-4));
  auto [model, optimizer] = accelerator.prepare(net, adamw);

  stage("prepared");
  const int rank = accelerator.process_index();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + rank);
  const auto x = at::randn({kRowsPerProcess, kWidth}, gen).to(device);
  const auto y = at::randint(0, 16, {kRowsPerProcess}, gen).to(device);
  const int warmup = 2, steps = quick ? 4 : 10;
  double loss = 0;
  Clock::time_point start;
  for (int s = 0; s < warmup + steps; ++s) {
    if (s == warmup) {
      accelerator.wait_for_everyone();
      start = Clock::now();
    }
    auto out = torch::nn::functional::cross_entropy(model(x), y);
    accelerator.backward(out);
    optimizer.step();
    optimizer.zero_grad();
    loss = out.item<double>();
    if (s < 2) stage(s == 0 ? "step 1" : "step 2");
  }
  accelerator.wait_for_everyone();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const double samples_per_s = steps * kRowsPerProcess * accelerator.num_processes() / seconds;
  const double peak_mib = status_mib("VmHWM");
  if (accelerator.is_main_process()) {
    std::printf(
        "{\"workload\": \"fsdp\", \"mode\": \"%s\", \"side\": \"cpp\", \"processes\": %d, \"params\": %lld, "
        "\"samples_per_s\": %.1f, \"peak_mib\": %.1f, \"base_mib\": %.1f, \"largest_unit_mib\": %.1f, "
        "\"device\": \"%s\", \"peak_device_allocated_mib\": %.1f, \"peak_device_reserved_mib\": %.1f, "
        "\"last_loss\": %.6f}\n",
        mode.c_str(), accelerator.num_processes(), static_cast<long long>(params), samples_per_s, peak_mib, base_mib,
        largest_unit / 1048576.0, device.str().c_str(), gpu >= 0 ? bench::peak_device_allocated_mib(gpu) : -1.0,
        gpu >= 0 ? bench::peak_device_reserved_mib(gpu) : -1.0, loss);
    std::fflush(stdout);
  }
  // BENCH_FSDP_SAVE=<folder>: then a FULL_STATE_DICT save_state there, and each process's growth of
  // its peak memory during the save (BENCH_FSDP_RANK0_ONLY=0 turns the state-dict configs'
  // rank0_only off; upstream's default keeps it on).
  if (const char* folder = std::getenv("BENCH_FSDP_SAVE"); folder != nullptr && mode != "ddp") {
    const double before = status_mib("VmHWM");
    accelerator.save_state(folder);
    const double after = status_mib("VmHWM");
    const auto* rank0_only = std::getenv("BENCH_FSDP_RANK0_ONLY");
    std::printf("{\"workload\": \"fsdp_save\", \"mode\": \"%s\", \"process\": %d, \"rank0_only\": %s, "
                "\"peak_before_mib\": %.1f, \"peak_after_mib\": %.1f, \"save_peak_growth_mib\": %.1f}\n",
                mode.c_str(), rank, rank0_only && std::string(rank0_only) == "0" ? "false" : "true", before, after,
                after - before);
    std::fflush(stdout);
  }
  return 0;
}
