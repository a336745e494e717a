// W10: the main example's model (examples/char_gpt.cpp's GPT: token and position embeddings,
// pre-norm blocks of causal self-attention and an MLP, a head over the 65 characters) trained with
// AdamW on the processes `accelerate launch` starts, under one of:
//   ddp      data parallelism over every process;
//   fsdp     FULL_SHARD over every process, each block a unit;
//   tp       tensor parallelism over pairs of neighbouring processes (each block's heads and MLP
//            split, Megatron-LM's way), data parallelism (DDP) over the pairs;
//   fsdp_tp  the same pairs, FULL_SHARD over them.
// Process 0 prints one JSON object: tokens/s over the timed steps (after warm-up; a tensor-parallel
// pair counts its tokens once), the bytes of parameters, gradients and AdamW state this process
// holds (`state_mib`, what sharding and splitting divide), its peak resident memory (VmHWM) and
// its resident memory before the model, and the final loss.
// With --phases it prints a second line: process 0's milliseconds per step in the forward pass, the
// backward pass (the gradient communication DDP does not overlap included), the optimizer's step
// and zero_grad.
// Usage: accelerate launch -n N bench_parallel ddp|fsdp|tp|fsdp_tp [--quick] [--phases]
#include <accelerate/accelerate.h>

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>

namespace acc = accelerate;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kVocab = 65, kBlock = 64, kEmbd = 128, kHeads = 4, kLayers = 4, kBatch = 16;

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln1(register_module("ln1", acc::nn::LayerNorm(torch::nn::LayerNormOptions({kEmbd})))),
        qkv(register_module("qkv", acc::nn::Linear(kEmbd, 3 * kEmbd))),
        proj(register_module("proj", acc::nn::Linear(kEmbd, kEmbd))),
        ln2(register_module("ln2", acc::nn::LayerNorm(torch::nn::LayerNormOptions({kEmbd})))),
        fc(register_module("fc", acc::nn::Linear(kEmbd, 4 * kEmbd))),
        fc_out(register_module("fc_out", acc::nn::Linear(4 * kEmbd, kEmbd))) {}

  // As char_gpt's: qkv's outputs head by head, so a split by columns gives each process whole heads.
  torch::Tensor forward(torch::Tensor x) {
    const int64_t B = x.size(0), T = x.size(1), hs = kEmbd / kHeads;
    auto qkv_out = qkv(ln1(x));
    const int64_t heads = qkv_out.size(2) / (3 * hs);
    auto parts = qkv_out.view({B, T, heads, 3, hs}).permute({3, 0, 2, 1, 4});
    auto att = torch::matmul(parts[0], parts[1].transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hs)));
    auto future = torch::ones({T, T}, x.options().dtype(torch::kBool)).triu(1);
    att = att.masked_fill(future, -INFINITY).softmax(-1);
    auto y = torch::matmul(att, parts[2]).transpose(1, 2).contiguous().view({B, T, heads * hs});
    x = x + proj(y);
    return x + fc_out(torch::gelu(fc(ln2(x))));
  }
  acc::nn::LayerNorm ln1;
  acc::nn::Linear qkv, proj;
  acc::nn::LayerNorm ln2;
  acc::nn::Linear fc, fc_out;
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module, acc::nn::TensorParallelPlanned {
  GPTImpl()
      : tok(register_module("tok", torch::nn::Embedding(kVocab, kEmbd))),
        pos(register_module("pos", torch::nn::Embedding(kBlock, kEmbd))),
        ln_f(register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kEmbd})))),
        head(register_module("head", torch::nn::Linear(kEmbd, kVocab))) {
    for (int i = 0; i < kLayers; ++i) blocks->push_back(Block());
    register_module("blocks", blocks);
  }
  std::vector<std::pair<std::string, std::string>> tp_plan() const override {
    return {{"blocks.*.qkv", "colwise"}, {"blocks.*.proj", "rowwise"}, {"blocks.*.fc", "colwise"},
            {"blocks.*.fc_out", "rowwise"}};
  }
  torch::Tensor forward(const torch::Tensor& ids) {
    auto x = tok(ids) + pos(torch::arange(ids.size(1), ids.options()));
    return head(ln_f(acc::forward(blocks, x)));
  }
  torch::nn::Embedding tok, pos;
  torch::nn::Sequential blocks;
  torch::nn::LayerNorm ln_f;
  torch::nn::Linear head;
};
TORCH_MODULE(GPT);

double status_mib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  TORCH_CHECK(argc >= 2, "usage: bench_parallel ddp|fsdp|tp|fsdp_tp [--quick] [--phases]");
  const std::string mode = argv[1];
  TORCH_CHECK(mode == "ddp" || mode == "fsdp" || mode == "tp" || mode == "fsdp_tp", "unknown mode ", mode);
  bool quick = false, phases = false;
  for (int i = 2; i < argc; ++i) {
    const std::string flag = argv[i];
    TORCH_CHECK(flag == "--quick" || flag == "--phases", "unknown flag ", flag);
    (flag == "--quick" ? quick : phases) = true;
  }
  const double base_mib = status_mib("VmRSS");
  const int world = acc::PartialState().num_processes();
  const bool tp = mode == "tp" || mode == "fsdp_tp", fsdp = mode == "fsdp" || mode == "fsdp_tp";
  acc::AcceleratorOptions options;
  const int tp_size = tp ? 2 : 1;
  options.parallelism_config = acc::ParallelismConfig{
      .dp_replicate_size = fsdp ? 1 : world / tp_size, .dp_shard_size = fsdp ? world / tp_size : 1, .tp_size = tp_size};
  if (fsdp) {
    options.fsdp_plugin = acc::FullyShardedDataParallelPlugin{
        .auto_wrap_policy = acc::FsdpAutoWrapPolicy::kTransformerBasedWrap, .transformer_cls_names_to_wrap = {"Block"}};
  }
  acc::Accelerator accelerator(options);
  torch::manual_seed(0);
  GPT net;
  int64_t params = 0;
  for (const auto& p : net->parameters()) params += p.numel();
  auto adamw = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-3));
  auto [model, optimizer] = accelerator.prepare(net, adamw);

  // Every process of a tensor-parallel pair trains on the same batch.
  const int dp = world / tp_size, dp_rank = accelerator.process_index() / tp_size;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + dp_rank);
  const auto x = at::randint(0, kVocab, {kBatch, kBlock}, gen, at::kLong);
  const auto y = at::randint(0, kVocab, {kBatch, kBlock}, gen, at::kLong);
  const int warmup = 2, steps = quick ? 4 : 10;
  double loss = 0;
  // --phases: this process's seconds in each part of the timed steps.
  double forward_s = 0, backward_s = 0, step_s = 0, zero_s = 0;
  auto lap = [](Clock::time_point& t) {
    const auto now = Clock::now();
    const double s = std::chrono::duration<double>(now - t).count();
    t = now;
    return s;
  };
  Clock::time_point start;
  for (int s = 0; s < warmup + steps; ++s) {
    if (s == warmup) {
      accelerator.wait_for_everyone();
      start = Clock::now();
      forward_s = backward_s = step_s = zero_s = 0;
    }
    auto t = Clock::now();
    auto out = torch::nn::functional::cross_entropy(model(x).reshape({-1, kVocab}), y.reshape({-1}));
    forward_s += lap(t);
    accelerator.backward(out);
    backward_s += lap(t);
    optimizer.step();
    loss = out.item<double>();
    step_s += lap(t);
    if (s + 1 < warmup + steps) optimizer.zero_grad();
    zero_s += lap(t);
  }
  accelerator.wait_for_everyone();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // What this process holds: its parameters (pieces, shards), their gradients, the AdamW moments.
  double state_bytes = 0;
  for (const auto& p : net->parameters()) {
    state_bytes += static_cast<double>(p.numel() * p.element_size());
    if (p.grad().defined()) state_bytes += static_cast<double>(p.grad().numel() * p.grad().element_size());
  }
  for (const auto& [key, state] : adamw->state()) {
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*state);
    state_bytes += static_cast<double>(adam.exp_avg().numel() + adam.exp_avg_sq().numel()) * 4;
  }
  const double peak_mib = status_mib("VmHWM");
  if (accelerator.is_main_process()) {
    std::printf(
        "{\"workload\": \"parallel\", \"mode\": \"%s\", \"side\": \"cpp\", \"processes\": %d, \"params\": %lld, "
        "\"tokens_per_s\": %.1f, \"state_mib\": %.3f, \"peak_mib\": %.1f, \"base_mib\": %.1f, \"last_loss\": %.6f}\n",
        mode.c_str(), world, static_cast<long long>(params), steps * kBatch * kBlock * dp / seconds,
        state_bytes / 1048576.0, peak_mib, base_mib, loss);
    if (phases) {
      std::printf("{\"phases\": \"%s\", \"side\": \"cpp\", \"forward_ms\": %.2f, \"backward_ms\": %.2f, "
                  "\"step_ms\": %.2f, \"zero_grad_ms\": %.2f}\n",
                  mode.c_str(), 1e3 * forward_s / steps, 1e3 * backward_s / steps, 1e3 * step_s / steps,
                  1e3 * zero_s / steps);
    }
    std::fflush(stdout);
  }
  return 0;
}
