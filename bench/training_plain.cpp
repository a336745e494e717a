// The limit of the training benchmarks: the loops of bench/training.cpp (W1 "mlp", W2
// "transformer", W3 "tiny", W12 "gpt2") written in plain LibTorch, without this library, on one
// process (W12's attention LibTorch's scaled_dot_product_attention, written out on 1.13):
// the model and the batch on the device, autocast set by hand around the forward pass (outputs
// back to float32, as the prepared model does), fp16 with LibTorch's own loss-scaling kernels
// (the ones PyTorch's GradScaler calls), SGD with lr 0.01 (W12: AdamW). What the Accelerator's loop costs
// beyond it is the library's overhead. Prints one JSON object per workload with the fields of
// bench/training.cpp, side "plain".
// Usage: bench_training_plain [--device cpu|cuda] [--mixed_precision no|bf16|fp16] [--threads N]
//        [--workloads mlp,transformer,tiny] [--warmup_steps 20] [--mlp_steps 200] [--tiny_steps 2000]
//        [--transformer_warmup_steps 3] [--transformer_steps 40] [--gpt_* as bench/training.cpp]
#include "device_memory.h"
#include "training_models.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

at::Tensor bench::causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  return at::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, /*is_causal=*/true);
#else
  auto scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  auto future = at::ones({q.size(-2), k.size(-2)}, q.options().dtype(at::kBool)).triu(1);
  return at::matmul(scores.masked_fill(future, -std::numeric_limits<double>::infinity()).softmax(-1), v);
#endif
}

namespace {

using Clock = std::chrono::steady_clock;

struct Flags : bench::StepFlags {
  c10::Device device = torch::cuda::is_available() ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  std::string precision = "no";
  int threads = 1;
};

Flags parse_flags(int argc, char** argv) {
  Flags f;
  f.workloads = {"mlp", "transformer"};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      TORCH_CHECK_VALUE(i + 1 < argc, "[bench_training_plain] ", a, " expects a value");
      return argv[++i];
    };
    if (a == "--device") {
      f.device = c10::Device(value());
    } else if (a == "--mixed_precision") {
      f.precision = value();
      TORCH_CHECK_VALUE(f.precision == "no" || f.precision == "bf16" || f.precision == "fp16",
                        "[bench_training_plain] --mixed_precision takes no, bf16 or fp16, got ", f.precision);
    } else if (a == "--threads") {
      f.threads = std::stoi(value());
    } else {
      TORCH_CHECK_VALUE(bench::parse_step_flag(f, a, value), "[bench_training_plain] unknown flag ", a);
    }
  }
  TORCH_CHECK_VALUE(f.precision != "fp16" || f.device.is_cuda(),
                    "[bench_training_plain] fp16 needs --device cuda (LibTorch's loss-scaling kernels are CUDA's)");
  return f;
}

// Autocast of `device` on or off, by hand. LibTorch 2.x has per-device functions; 1.x had one
// pair for CUDA and one for the CPU.
void set_autocast(c10::DeviceType device, bool enabled, c10::ScalarType dtype) {
#if TORCH_VERSION_MAJOR >= 2
  at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::set_autocast_enabled(device, enabled);
#else
  if (device == c10::kCUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
    at::autocast::set_cpu_enabled(enabled);
  }
#endif
  if (!enabled) at::autocast::clear_cache();
}

void synchronize(const c10::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

// W12's additions: AdamW instead of SGD, and tokens/s with the FLOPs per token.
struct LanguageModel {
  bool adamw = false;
  int64_t tokens_per_sample = 0;
  double flops_per_token = 0;
};

template <typename Net, typename LossFn>
void run(const Flags& flags, const char* workload, Net net, const at::Tensor& x, const at::Tensor& y, LossFn loss_fn,
         int warmup_steps, int steps, const LanguageModel& lm = {}) {
  net->to(flags.device);
  const int gpu = flags.device.is_cuda() ? flags.device.index() : -1;
  if (gpu >= 0) {
    (void)at::empty({1}, at::TensorOptions().device(flags.device));  // the allocator knows the device
    bench::reset_device_peaks(gpu);
  }
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (lm.adamw) {
    optimizer = std::make_unique<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
  } else {
    optimizer = std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01));
  }
  auto& optim = *optimizer;
  const bool autocast = flags.precision != "no";
  const auto autocast_dtype = flags.precision == "bf16" ? at::kBFloat16 : at::kHalf;
  // PyTorch's GradScaler's defaults: scale 2^16, doubled after 2000 clean steps, halved on inf/NaN.
  const bool scaled = flags.precision == "fp16";
  const auto float_options = at::TensorOptions().device(flags.device).dtype(at::kFloat);
  auto scale = at::full({1}, 65536.0, float_options);
  auto growth_tracker = at::zeros({1}, float_options.dtype(at::kInt));
  auto found_inf = at::zeros({1}, float_options);

  at::Tensor loss;
  double first_loss = std::nan("");
  auto step = [&] {
    if (autocast) set_autocast(flags.device.type(), true, autocast_dtype);
    auto out = net->forward(x);
    if (autocast) {
      set_autocast(flags.device.type(), false, autocast_dtype);
      out = out.to(at::kFloat);
    }
    loss = loss_fn(out, y);
    if (std::isnan(first_loss)) first_loss = loss.item<double>();
    if (!scaled) {
      loss.backward();
      optim.step();
    } else {
      (loss * scale).backward();
      std::vector<at::Tensor> grads;
      for (auto& p : net->parameters()) {
        if (p.grad().defined()) grads.push_back(p.grad());
      }
      found_inf.zero_();
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, scale.reciprocal());
      if (found_inf.item<float>() == 0.0f) optim.step();
      at::_amp_update_scale_(scale, growth_tracker, found_inf, 2.0, 0.5, 2000);
    }
    optim.zero_grad();
  };
  for (int i = 0; i < warmup_steps; ++i) step();
  synchronize(flags.device);
  std::vector<double> step_us(static_cast<size_t>(steps));
  const auto start = Clock::now();
  for (int i = 0; i < steps; ++i) {
    const auto t0 = Clock::now();
    step();
    step_us[static_cast<size_t>(i)] = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  }
  synchronize(flags.device);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::sort(step_us.begin(), step_us.end());
  const int64_t batch = x.dim() == 3 ? x.size(1) : x.size(0);  // the transformer's input is [sequence, batch, d]
  std::string extra;
  if (lm.tokens_per_sample > 0) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), ", \"tokens_per_s\": %.1f, \"flops_per_token\": %.6g",
                  steps / seconds * static_cast<double>(batch * lm.tokens_per_sample), lm.flops_per_token);
    extra += buf;
  }
  extra += bench::device_peaks_json(gpu);
  std::printf("{\"side\": \"plain\", \"workload\": \"%s\", \"device\": \"%s\", \"processes\": 1, \"threads\": %d, "
              "\"mixed_precision\": \"%s\", \"batch_size\": %lld, \"warmup_steps\": %d, \"steps\": %d, "
              "\"steps_per_s\": %.3f, \"samples_per_s\": %.1f, \"step_median_us\": %.1f%s, \"first_loss\": %.6f, "
              "\"last_loss\": %.6f}\n",
              workload, flags.device.str().c_str(), at::get_num_threads(), flags.precision.c_str(),
              static_cast<long long>(batch), warmup_steps, steps, steps / seconds, steps / seconds * batch,
              step_us[step_us.size() / 2], extra.c_str(), first_loss, loss.item<double>());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Flags flags = parse_flags(argc, argv);
    at::set_num_threads(flags.threads);
    auto cross_entropy = [](const at::Tensor& out, const at::Tensor& t) { return torch::cross_entropy_loss(out, t); };
    for (const auto& workload : flags.workloads) {
      // The seeds of bench/training.cpp's process 0, so both sides train the same numbers.
      torch::manual_seed(0);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1000);
      if (workload == "mlp") {
        bench::Mlp net;
        const auto x = at::randn({64, 512}, gen).to(flags.device);
        const auto y = at::randint(0, 10, {64}, gen, at::kLong).to(flags.device);
        run(flags, "mlp", net, x, y, cross_entropy, flags.warmup_steps, flags.mlp_steps);
      } else if (workload == "tiny") {
        bench::Tiny net;
        const auto x = at::randn({8, 32}, gen).to(flags.device);
        const auto y = at::randn({8, 32}, gen).to(flags.device);
        auto mse = [](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out, t); };
        run(flags, "tiny", net, x, y, mse, flags.warmup_steps, flags.tiny_steps);
      } else if (workload == "transformer") {
        bench::EncoderClassifier net;
        bench::init_transformer(*net);
        const auto x = at::randn({64, 16, 256}, gen).to(flags.device);
        const auto y = at::randint(0, 10, {16}, gen, at::kLong).to(flags.device);
        run(flags, "transformer", net, x, y, cross_entropy, flags.transformer_warmup_steps, flags.transformer_steps);
      } else if (workload == "gpt2") {
        bench::Gpt net(flags.gpt);
        bench::init_transformer(*net);
        auto [x, y] = bench::gpt_batch(flags, gen);
        run(flags, "gpt2", net, x.to(flags.device), y.to(flags.device), bench::gpt_loss, flags.gpt_warmup_steps,
            flags.gpt_steps, LanguageModel{true, flags.gpt.seq, net->flops_per_token(flags.gpt)});
      } else {
        TORCH_CHECK_VALUE(false, "[bench_training_plain] unknown workload ", workload,
                          " (expected mlp, transformer, tiny or gpt2)");
      }
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "bench_training_plain: error: %s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
