// A program for the fully sharded launcher tests. It reads its settings from the environment that
// `accelerate launch --use_fsdp --fsdp_* [--gradient_accumulation_steps N] [--mixed_precision
// bf16]` gives it, trains a small model of three blocks with AdamW through the Accelerator — every
// process on its own rows of each batch — and checks it ends where one process ends when it
// trains the same model on the whole batches (the same accumulation, the same autocast). It also
// checks that the processes hold only shards (unless NO_SHARD) and that save_model writes the
// whole model. With "save" it also saves the state halfway (OUTPUT_FOLDER/checkpoint) and goes
// on; with "resume" it starts from that checkpoint instead — possibly with another number of
// processes — and must end at the same place. On a GPU machine everything trains on the GPU.
// MP_FSDP_REDUCE_DTYPE=fp32 gives the plugin the policy param_dtype bf16, reduce_dtype fp32.
// MP_FSDP_FP16=1 gives it fp16 for parameters, reduction and buffers, and scales the loss as a
// GradScaler does (65536, halved after a step whose gradients overflowed, which is skipped), in
// the job and in one process computing in fp16 on the whole batches: the job must skip the same
// steps. It runs on the CPU where LibTorch has CPU fp16 kernels (2.x).
// Prints "fsdp: OK" on the main process; anything else throws.
//
//   mp_fsdp OUTPUT_FOLDER [save|resume]
#include "accelerate/accelerate.h"

#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace acc = accelerate;

namespace {

// A block of one Linear(24, 24), or with `hidden` > 0 a wide one: Linear(24, hidden) and a weight
// `mix` of 24 × hidden, each using 24 of the hidden features, spread from the first to the last
// (so that every process's rows of both weights get gradients, while no sum runs over `hidden`
// terms, whose rounding AdamW would magnify).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t hidden = 0) {
    if (hidden == 0) {
      fc = register_module("fc", torch::nn::Linear(24, 24));
      return;
    }
    up = register_module("up", torch::nn::Linear(24, hidden));
    mix = register_parameter("mix", torch::zeros({24, hidden}));
    used = torch::linspace(0, static_cast<double>(hidden - 1), 24).to(torch::kLong);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    if (fc) return torch::tanh(fc(x)) + x;
    auto h = torch::tanh(acc::forward(up, x)).index_select(1, used.to(x.device()));
    return torch::tanh(h.matmul(mix.index_select(1, used.to(x.device())).t())) + x;
  }
  torch::nn::Linear fc{nullptr}, up{nullptr};
  torch::Tensor mix, used;
};
TORCH_MODULE(Block);

// Row counts that 2 and 4 processes do not divide evenly (24 and 5 rows, 21 and 3 in the biases).
// The last block's two weights are just over 1 MiB each, so each is reduced on its own, from the
// buffer lent as its gradient: `up`'s 11001 rows divide by neither, `mix`'s 24 by both.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : embed(register_module("embed", torch::nn::Linear(7, 24))),
        blocks(register_module("blocks", torch::nn::Sequential(Block(), Block(), Block(11001)))),
        head(register_module("head", torch::nn::Linear(24, 5))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(acc::forward(blocks, embed(x))); }
  torch::nn::Linear embed;
  torch::nn::Sequential blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

Net make_net() {
  Net net;
  torch::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : net->parameters()) p.copy_(torch::sin(torch::arange(p.numel()).reshape(p.sizes()) * 0.37 + i++) * 0.3);
  return net;
}

constexpr int64_t kRows = 16;  // of every batch, split over the processes
constexpr int kSteps = 4;

// Batch `b` of the whole job (all processes' rows).
std::pair<torch::Tensor, torch::Tensor> whole_batch(int b) {
  const int64_t rows = kRows;
  auto x = torch::cos(torch::arange(rows * 7, torch::kFloat).reshape({rows, 7}) * (0.11 + 0.01 * b));
  auto y = torch::remainder(torch::arange(rows) * 3 + b, 5);
  return {x, y};
}

std::map<std::string, torch::Tensor> named(const acc::StateDictMap& state) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : state) out[item.key()] = item.value().detach().to(torch::kCPU).clone();
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  TORCH_CHECK(argc == 2 || argc == 3, "usage: mp_fsdp OUTPUT_FOLDER [save|resume]");
  const std::string mode = argc == 3 ? argv[2] : "";
  const std::string checkpoint = std::string(argv[1]) + "/checkpoint";
  acc::AcceleratorOptions options;
  const bool fp16_policy = acc::get_env("MP_FSDP_FP16").value_or("") == "1";
  if (fp16_policy) {
    options.fsdp_plugin = acc::FullyShardedDataParallelPlugin{.mixed_precision_policy = {"fp16", "fp16", "fp16"}};
  }
  if (auto reduce = acc::get_env("MP_FSDP_REDUCE_DTYPE")) {
    options.fsdp_plugin = acc::FullyShardedDataParallelPlugin{.mixed_precision_policy = {"bf16", *reduce, "bf16"}};
  }
  acc::Accelerator accelerator(options);
  TORCH_CHECK(accelerator.fsdp_plugin().has_value(), "the job was not launched with --use_fsdp");
  const int n = accelerator.num_processes();
  const int rank = accelerator.process_index();
  const int micro = accelerator.gradient_accumulation_steps();
  const bool low_precision = accelerator.mixed_precision() != "no" || fp16_policy;  // bf16, or fp16

  // One process on the whole batches, on the same device as the job (autocast's kernels and the
  // ops it casts differ between the CPU and CUDA).
  const auto device = accelerator.device();
  Net baseline = make_net();
  baseline->to(device);
  torch::optim::AdamW baseline_opt(baseline->parameters(), torch::optim::AdamWOptions(0.02));
  // Under fp16 the loss is scaled as a prepared optimizer scales it (the default scaler), and a
  // step whose gradients overflowed is skipped: the job must skip the same steps.
  acc::GradScaler scaler(acc::GradScalerKwargs{.enabled = accelerator.mixed_precision() == "fp16"});
  std::vector<bool> baseline_skipped;
  double baseline_scale = 65536;  // MP_FSDP_FP16: the loss scale, the same in the job
  Net half_copy = make_net();  // MP_FSDP_FP16: the baseline's fp16 copy, which computes
  half_copy->to(torch::kHalf);
  const auto overflowed = [](const std::vector<torch::Tensor>& params) {
    for (const auto& p : params) {
      if (p.grad().defined() && !torch::isfinite(p.grad()).all().item<bool>()) return true;
    }
    return false;
  };
  for (int step = 0; step < kSteps && fp16_policy; ++step) {
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < half_copy->parameters().size(); ++i) {
        half_copy->parameters()[i].copy_(baseline->parameters()[i]);
      }
    }
    half_copy->zero_grad();
    for (int m = 0; m < micro; ++m) {
      auto [x, y] = whole_batch(step * micro + m);
      auto out = half_copy(x.to(torch::kHalf)).to(torch::kFloat);
      (torch::nn::functional::cross_entropy(out, y) * (baseline_scale / micro)).backward();
    }
    baseline_skipped.push_back(overflowed(half_copy->parameters()));
    if (baseline_skipped.back()) {
      baseline_scale /= 2;
      continue;
    }
    for (size_t i = 0; i < half_copy->parameters().size(); ++i) {
      baseline->parameters()[i].mutable_grad() = half_copy->parameters()[i].grad().to(torch::kFloat) / baseline_scale;
    }
    baseline_opt.step();
  }
  for (int step = 0; step < kSteps && !fp16_policy; ++step) {
    baseline_opt.zero_grad();
    for (int m = 0; m < micro; ++m) {
      auto [x, y] = whole_batch(step * micro + m);
      // As a prepared model does: the forward under autocast, its output in fp32.
      auto out = [&] {
        auto guard = accelerator.autocast();
        return baseline(x.to(device));
      }();
      scaler.scale(torch::nn::functional::cross_entropy(out.to(torch::kFloat), y.to(device)) / micro).backward();
    }
    baseline_skipped.push_back(!scaler.step(baseline_opt));
    scaler.update();
  }

  Net net = mode == "resume" ? Net() : make_net();  // a resumed job starts from other values
  int64_t whole = 0;
  for (const auto& p : net->parameters()) whole += p.numel();
  auto adamw = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.02));
  auto [model, optimizer] = accelerator.prepare(net, adamw);
  int64_t mine = 0;
  for (const auto& p : net->parameters()) mine += p.numel();
  const auto strategy = acc::get_env("FSDP_SHARDING_STRATEGY").value_or("FULL_SHARD");
  if (strategy == "NO_SHARD") {
    TORCH_CHECK(mine == whole, "NO_SHARD: process ", rank, " holds ", mine, " of ", whole, " parameters");
  } else {
    TORCH_CHECK(mine < whole, strategy, ": process ", rank, " holds ", mine, " of ", whole,
                " parameters: nothing was sharded");
  }
  TORCH_CHECK(kRows % n == 0, "run with a number of processes that divides ", kRows);
  const int64_t per = kRows / n;
  const int half = kSteps / 2 * micro;
  if (mode == "resume") accelerator.load_state(checkpoint);
  double scale = 65536;  // MP_FSDP_FP16
  for (int b = mode == "resume" ? half : 0; b < kSteps * micro; ++b) {
    if (mode == "save" && b == half) accelerator.save_state(checkpoint);
    auto guard = accelerator.accumulate(model);
    auto [x, y] = whole_batch(b);
    auto loss = torch::nn::functional::cross_entropy(model(x.narrow(0, rank * per, per).to(device)).to(torch::kFloat),
                                                     y.narrow(0, rank * per, per).to(device));
    if (fp16_policy) {
      TORCH_CHECK(mode.empty(), "MP_FSDP_FP16 does not save or resume");
      accelerator.backward(loss * scale);
      if (accelerator.sync_gradients()) {
        // The processes agree on an overflow in any of their shards' gradients, as the job's scaler does.
        auto found = accelerator.reduce(torch::tensor({overflowed(net->parameters()) ? 1.f : 0.f}), "sum");
        const bool skipped = found.item<float>() > 0;
        const auto step = static_cast<size_t>(b / micro);
        TORCH_CHECK(skipped == baseline_skipped.at(step), "step ", step, ": the job ", skipped ? "skipped" : "took",
                    " it, one process ", baseline_skipped.at(step) ? "skipped" : "took", " it (fp16 overflow at scale ",
                    scale, ")");
        if (skipped) {
          scale /= 2;
        } else {
          for (auto& p : net->parameters()) p.mutable_grad().div_(scale);
          optimizer.step();
        }
      }
      optimizer.zero_grad();
      continue;
    }
    accelerator.backward(loss);
    optimizer.step();
    if (accelerator.sync_gradients()) {
      const bool skipped = optimizer.step_was_skipped();
      const auto step = static_cast<size_t>(b / micro);
      TORCH_CHECK(skipped == baseline_skipped.at(step), "step ", step, ": the job ", skipped ? "skipped" : "took",
                  " it, one process ", baseline_skipped.at(step) ? "skipped" : "took", " it (fp16 overflow)");
    }
    optimizer.zero_grad();
  }

  if (acc::get_env("FSDP_OFFLOAD_PARAMS").value_or("false") == "true") {
    // cpu_offload: the shards, their gradients and AdamW's state live on the CPU between steps,
    // whatever device computes.
    auto last = model(torch::zeros({2, 7}).to(device)).sum();
    accelerator.backward(last);
    for (const auto& item : net->named_parameters()) {
      TORCH_CHECK(item.value().is_cpu(), "cpu_offload: ", item.key(), " is on ", item.value().device());
      TORCH_CHECK(item.value().grad().is_cpu(), "cpu_offload: the gradient of ", item.key(), " is on ",
                  item.value().grad().device());
    }
    TORCH_CHECK(adamw->state().size() == net->parameters().size(), "AdamW holds state for ", adamw->state().size(),
                " of ", net->parameters().size(), " parameters");
    for (const auto& entry : adamw->state()) {
      const auto& moments = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
      TORCH_CHECK(moments.exp_avg().is_cpu() && moments.exp_avg_sq().is_cpu(), "cpu_offload: AdamW's state is on ",
                  moments.exp_avg().device());
    }
    optimizer.zero_grad();
  }
  const auto got = named(accelerator.get_state_dict(model));
  const auto want = named(baseline->named_parameters());
  const auto initial = named(make_net()->named_parameters());
  for (const auto& [name, value] : want) {
    TORCH_CHECK(got.count(name), "the whole state dict has no ", name);
    const auto diff = got.at(name) - value;
    if (low_precision) {
      // bf16 (or fp16) rounds the gradients, and AdamW turns the rounding of a tiny one into a
      // whole step of the learning rate the other way: single elements may differ by a few steps.
      // What must agree is where training took each tensor: the difference stays within 10% of
      // the distance it moved (3% or less in these jobs; 40-70% when a pass's gradients are lost).
      const double moved = (value - initial.at(name)).norm().item<double>();
      const double off = diff.norm().item<double>();
      TORCH_CHECK(off <= 0.1 * moved, name, " differs from one process's by ", off, " (norm), against ", moved,
                  " that training moved it");
    } else {
      // On a GPU, sharded products sum in another order than whole ones.
      const double tolerance = device.is_cuda() ? 1e-4 : 1e-5;
      const double largest = diff.abs().max().item<double>();
      TORCH_CHECK(largest <= tolerance + 1e-5 * value.abs().max().item<double>(), name,
                  " differs from one process's by ", largest);
    }
  }
  accelerator.save_model(model, std::string(argv[1]) + "/model");
  accelerator.wait_for_everyone();
  Net reloaded;
  acc::load_checkpoint_in_model(*reloaded, std::string(argv[1]) + "/model/model.safetensors", {.strict = true});
  for (const auto& [name, value] : named(reloaded->named_parameters())) {
    TORCH_CHECK(torch::equal(value, got.at(name)), "save_model wrote another ", name);
  }
  accelerator.print("fsdp: OK (" + strategy + ", " + std::to_string(n) + " processes, " + std::to_string(mine) +
                    " of " + std::to_string(whole) + " parameters on the main process)");
  return 0;
}
