// The limit of the training benchmarks: the loops of bench/training.cpp (W1 "mlp", W2
// "transformer", W3 "tiny") written in plain LibTorch, without this library, on one process:
// the model and the batch on the device, autocast set by hand around the forward pass (outputs
// back to float32, as the prepared model does), fp16 with LibTorch's own loss-scaling kernels
// (the ones PyTorch's GradScaler calls), SGD with lr 0.01. What the Accelerator's loop costs
// beyond it is the library's overhead. Prints one JSON object per workload with the fields of
// bench/training.cpp, side "plain".
// Usage: bench_training_plain [--device cpu|cuda] [--mixed_precision no|bf16|fp16] [--threads N]
//        [--workloads mlp,transformer,tiny] [--warmup_steps 20] [--mlp_steps 200] [--tiny_steps 2000]
//        [--transformer_warmup_steps 3] [--transformer_steps 40]
#include "training_models.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

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

template <typename Net, typename LossFn>
void run(const Flags& flags, const char* workload, Net net, const at::Tensor& x, const at::Tensor& y, LossFn loss_fn,
         int warmup_steps, int steps) {
  net->to(flags.device);
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.01));
  const bool autocast = flags.precision != "no";
  const auto autocast_dtype = flags.precision == "bf16" ? at::kBFloat16 : at::kHalf;
  // PyTorch's GradScaler's defaults: scale 2^16, doubled after 2000 clean steps, halved on inf/NaN.
  const bool scaled = flags.precision == "fp16";
  const auto float_options = at::TensorOptions().device(flags.device).dtype(at::kFloat);
  auto scale = at::full({1}, 65536.0, float_options);
  auto growth_tracker = at::zeros({1}, float_options.dtype(at::kInt));
  auto found_inf = at::zeros({1}, float_options);

  at::Tensor loss;
  auto step = [&] {
    if (autocast) set_autocast(flags.device.type(), true, autocast_dtype);
    auto out = net->forward(x);
    if (autocast) {
      set_autocast(flags.device.type(), false, autocast_dtype);
      out = out.to(at::kFloat);
    }
    loss = loss_fn(out, y);
    if (!scaled) {
      loss.backward();
      sgd.step();
    } else {
      (loss * scale).backward();
      std::vector<at::Tensor> grads;
      for (auto& p : net->parameters()) {
        if (p.grad().defined()) grads.push_back(p.grad());
      }
      found_inf.zero_();
      at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, scale.reciprocal());
      if (found_inf.item<float>() == 0.0f) sgd.step();
      at::_amp_update_scale_(scale, growth_tracker, found_inf, 2.0, 0.5, 2000);
    }
    sgd.zero_grad();
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
  std::printf("{\"side\": \"plain\", \"workload\": \"%s\", \"device\": \"%s\", \"processes\": 1, \"threads\": %d, "
              "\"mixed_precision\": \"%s\", \"batch_size\": %lld, \"warmup_steps\": %d, \"steps\": %d, "
              "\"steps_per_s\": %.3f, \"samples_per_s\": %.1f, \"step_median_us\": %.1f, \"last_loss\": %.6f}\n",
              workload, flags.device.str().c_str(), at::get_num_threads(), flags.precision.c_str(),
              static_cast<long long>(batch), warmup_steps, steps, steps / seconds, steps / seconds * batch,
              step_us[step_us.size() / 2], loss.item<double>());
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
      } else {
        TORCH_CHECK_VALUE(false, "[bench_training_plain] unknown workload ", workload,
                          " (expected mlp, transformer or tiny)");
      }
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "bench_training_plain: error: %s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
