// Training-step throughput: steady-state optimizer steps per second of a loop written with the
// Accelerator (`prepare`, `backward`, `AcceleratedOptimizer`), gradients synchronised by the
// prepared model's Reducer over Gloo. Workloads: "mlp" (W1: 512→1024→1024→10 with ReLU, batch 64
// per process, cross-entropy: compute and a 6 MiB gradient allreduce), "mlp_accum4" (the same
// with `accumulate` and gradient_accumulation_steps 4: three of four backward passes skip the
// allreduce), "transformer" (W2: a 2-layer transformer-encoder classifier, d_model 256, 4 heads,
// feed-forward 2048, no dropout, sequences of 64, batch 16 per process, mean-pooled into
// Linear(256, 10)), "gpt2" (W12: a GPT-2-shaped decoder, GPT-2 small by default, batch 8 of
// 1024 tokens, AdamW with lr 3e-4 and weight decay 0.1, causal attention through
// accelerate::scaled_dot_product_attention; the --gpt_* flags size it), "tiny" (W3: Linear(32, 32), batch 8 per process, MSE: per-step overhead and
// small-message latency) and "startup" (W5: one step of "mlp", then the wall-clock time, so a
// runner can measure launch to end of the first optimizer step). SGD with lr 0.01, one fixed random
// batch per process. Each step is timed by phase (forward with the loss, backward with the
// allreduce, optimizer step, zero_grad) on process 0. bf16 autocast comes from the launcher's
// `--mixed_precision bf16`, which the prepared model applies to its forward pass.
// Run through the launcher: `accelerate launch -n 2 bench_training [--quick]
// [--workloads mlp,mlp_accum4,tiny,transformer] [--warmup_steps 20] [--mlp_steps 200]
// [--tiny_steps 2000] [--transformer_warmup_steps 3] [--transformer_steps 40] [--gpt_layers 12]
// [--gpt_heads 12] [--gpt_embd 768] [--gpt_seq 1024] [--gpt_vocab 50304] [--gpt_batch 8]
// [--gpt_warmup_steps 3] [--gpt_steps 20]`; process 0 prints
// one JSON object per workload, as bench/training_twin.py does for PyTorch DDP, and
// bench/run_training compares them. On a CUDA machine the model and the batch live on the GPU
// (the accelerator's device) and the clock is read after the GPU finished (scripts/gpu_check.sh
// compares with `training_twin.py --device cuda`); the per-phase times then measure the launches.
#include "device_memory.h"
#include "training_models.h"

#include <accelerate/accelerate.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

namespace acc = accelerate;
using Clock = std::chrono::steady_clock;

at::Tensor bench::causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return acc::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, /*is_causal=*/true);
}

namespace {

using bench::EncoderClassifier;
using bench::init_transformer;
using bench::Mlp;
using bench::Tiny;

// The benchmark side this run stands for: C++ on the default back-end, or on MPI.
const char* side(const acc::Accelerator& accelerator) {
  return accelerator.state().partial_state().backend() == "mpi" ? "cpp-mpi" : "cpp";
}

bench::StepFlags parse_flags(int argc, char** argv) {
  bench::StepFlags f;
  f.workloads = {"mlp", "mlp_accum4", "tiny", "transformer"};
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      TORCH_CHECK_VALUE(i + 1 < argc, "[bench_training] ", a, " expects a value");
      return argv[++i];
    };
    if (a == "--quick") {
      quick = true;
    } else {
      TORCH_CHECK_VALUE(bench::parse_step_flag(f, a, value), "[bench_training] unknown flag ", a);
    }
  }
  if (quick) {
    f.mlp_steps = std::max(1, f.mlp_steps / 4);
    f.tiny_steps = std::max(1, f.tiny_steps / 4);
    f.transformer_steps = std::max(1, f.transformer_steps / 4);
  }
  return f;
}

// Median and mean of `v` (sorted in place).
std::pair<double, double> median_mean(std::vector<double>& v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size())};
}

double us(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::micro>(b - a).count(); }

// The process's peak resident memory (VmHWM), in MiB, and its reset (Linux: "5" written to
// clear_refs), so that each workload of the run reports its own peak.
double peak_mib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}
void reset_peak() { std::ofstream("/proc/self/clear_refs") << "5"; }

// GPU work runs asynchronously: waits for this process's GPU before the clock is read.
void synchronize_device(const acc::Accelerator& accelerator) {
  if (accelerator.device().is_cuda()) torch::cuda::synchronize(accelerator.device().index());
}

// What a workload trains with beyond its batch: the optimizer (SGD with lr 0.01, or W12's AdamW)
// and, for a language model, its tokens per sample and FLOPs per token (reported as tokens/s).
struct Training {
  int accumulation = 1;
  bool adamw = false;
  int64_t tokens_per_sample = 0;
  double flops_per_token = 0;
};

// The optimizer `training` asks for, over `net`'s parameters.
template <typename Net>
std::shared_ptr<torch::optim::Optimizer> make_optimizer(Net& net, const Training& training) {
  if (training.adamw) {
    return std::make_shared<torch::optim::AdamW>(net->parameters(),
                                                 torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
  }
  return std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01));
}

// Trains `net` on one fixed batch (`x`, `y`) for warm-up then timed steps; process 0 prints the
// throughput, the per-step and per-phase times and the first and last loss. With accumulation
// > 1 each step runs inside `accumulate`, so the optimizer steps (and gradients synchronise)
// every `accumulation`-th step.
template <typename Net, typename LossFn>
void run(const acc::Accelerator& accelerator, const char* workload, Net net, const at::Tensor& x, const at::Tensor& y,
         LossFn loss_fn, int warmup_steps, int steps, const Training& training = {}) {
  reset_peak();
  const int accumulation = training.accumulation;
  const int gpu = accelerator.device().is_cuda() ? accelerator.device().index() : -1;
  if (gpu >= 0) {
    (void)at::empty({1}, at::TensorOptions().device(accelerator.device()));  // the allocator knows the device
    bench::reset_device_peaks(gpu);
  }
  auto [model, opt] = accelerator.prepare(net, make_optimizer(net, training));
  accelerator.set_gradient_accumulation_steps(accumulation);
  at::Tensor loss;
  double first_loss = std::nan("");
  for (int i = 0; i < warmup_steps; ++i) {
    std::unique_ptr<acc::SyncGuard> sync;  // the guard can neither move nor copy: built in place
    if (accumulation > 1) sync.reset(new acc::SyncGuard(accelerator.accumulate(model)));
    loss = loss_fn(model(x), y);
    if (i == 0) first_loss = loss.item<double>();
    accelerator.backward(loss);
    opt.step();
    opt.zero_grad();
  }

  constexpr int kPhases = 4;
  std::vector<std::vector<double>> phase(kPhases, std::vector<double>(static_cast<size_t>(steps)));
  std::vector<double> step_us(static_cast<size_t>(steps));
  synchronize_device(accelerator);
  accelerator.wait_for_everyone();
  const auto start = Clock::now();
  for (int i = 0; i < steps; ++i) {
    const auto t0 = Clock::now();
    std::unique_ptr<acc::SyncGuard> sync;  // the guard can neither move nor copy: built in place
    if (accumulation > 1) sync.reset(new acc::SyncGuard(accelerator.accumulate(model)));
    loss = loss_fn(model(x), y);
    if (i == 0 && warmup_steps == 0) first_loss = loss.item<double>();
    const auto t1 = Clock::now();
    accelerator.backward(loss);
    const auto t2 = Clock::now();
    opt.step();
    const auto t3 = Clock::now();
    opt.zero_grad();
    const auto t4 = Clock::now();
    const auto s = static_cast<size_t>(i);
    phase[0][s] = us(t0, t1);
    phase[1][s] = us(t1, t2);
    phase[2][s] = us(t2, t3);
    phase[3][s] = us(t3, t4);
    step_us[s] = us(t0, t4);
  }
  synchronize_device(accelerator);
  accelerator.wait_for_everyone();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const double last_loss = loss.item<double>();

  // Where a synchronising step's time goes: the same steps with no communication (every process
  // computing at once, inside no_sync); the difference is what synchronising costs.
  std::string breakdown;
  if (accelerator.num_processes() > 1 && std::string(workload).rfind("mlp", 0) == 0) {
    std::vector<double> local_us;
    const int samples = std::max(10, steps / 4);
    accelerator.wait_for_everyone();
    for (int i = 0; i < samples; ++i) {
      const auto t0 = Clock::now();
      {
        acc::SyncGuard off = accelerator.no_sync(model);
        loss = loss_fn(model(x), y);
        accelerator.backward(loss);
      }
      opt.step();
      opt.zero_grad();
      local_us.push_back(us(t0, Clock::now()));
    }
    accelerator.wait_for_everyone();
    char buf[128];
    std::snprintf(buf, sizeof(buf), ", \"step_without_communication_median_us\": %.1f", median_mean(local_us).first);
    breakdown = buf;
  }
  // The next workload steps without `accumulate`: every step synchronises again.
  accelerator.set_gradient_accumulation_steps(1);
  accelerator.gradient_state().set_sync_gradients(true);
  if (!accelerator.is_main_process()) return;

  const double steps_per_s = steps / seconds;
  const auto [step_median, step_mean] = median_mean(step_us);
  std::string phases;
  const char* names[kPhases] = {"forward", "backward", "step", "zero_grad"};
  for (int p = 0; p < kPhases; ++p) {
    const auto [median, mean] = median_mean(phase[static_cast<size_t>(p)]);
    char buf[128];
    std::snprintf(buf, sizeof(buf), "%s\"%s\": [%.1f, %.1f]", p ? ", " : "", names[p], median, mean);
    phases += buf;
  }
  const int64_t batch = x.dim() == 3 ? x.size(1) : x.size(0);  // the transformer's input is [sequence, batch, d]
  std::string extra;
  if (training.tokens_per_sample > 0) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), ", \"tokens_per_s\": %.1f, \"flops_per_token\": %.6g",
                  steps_per_s * static_cast<double>(batch * accelerator.num_processes() * training.tokens_per_sample),
                  training.flops_per_token);
    extra += buf;
  }
  extra += bench::device_peaks_json(gpu);
  std::printf("{\"side\": \"%s\", \"workload\": \"%s\", \"device\": \"%s\", \"processes\": %d, \"threads\": %d, "
              "\"mixed_precision\": \"%s\", \"batch_size\": %lld, \"warmup_steps\": %d, \"steps\": %d, "
              "\"steps_per_s\": %.3f, \"samples_per_s\": %.1f, \"step_median_us\": %.1f, \"step_mean_us\": %.1f, "
              "\"phase_median_mean_us\": {%s}%s%s, \"peak_mib\": %.1f, \"first_loss\": %.6f, \"last_loss\": %.6f}\n",
              side(accelerator), workload, accelerator.device().str().c_str(), accelerator.num_processes(),
              at::get_num_threads(),
              accelerator.mixed_precision().c_str(),
              static_cast<long long>(batch), warmup_steps, steps, steps_per_s,
              steps_per_s * static_cast<double>(batch * accelerator.num_processes()), step_median, step_mean,
              phases.c_str(), breakdown.c_str(), extra.c_str(), peak_mib(), first_loss, last_loss);
  std::fflush(stdout);
}

// W5: one optimizer step of "mlp", then process 0 prints the wall-clock time (Unix seconds); the
// runner subtracts the time it started the launcher.
void first_step(const acc::Accelerator& accelerator, const at::Tensor& x, const at::Tensor& y) {
  Mlp net;
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01));
  auto [model, opt] = accelerator.prepare(net, sgd);
  auto loss = torch::cross_entropy_loss(model(x), y);
  accelerator.backward(loss);
  opt.step();
  const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  if (!accelerator.is_main_process()) return;
  std::printf("{\"side\": \"%s\", \"workload\": \"startup\", \"processes\": %d, \"first_step_end_unix\": %.6f, "
              "\"last_loss\": %.6f}\n",
              side(accelerator), accelerator.num_processes(), now, loss.item<double>());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const bench::StepFlags flags = parse_flags(argc, argv);
  // BENCH_COMM_HOOK=fp16|bf16: DDP's gradient buckets compressed on the wire (DDPCommunicationHookType).
  acc::AcceleratorOptions options;
  if (const char* hook = std::getenv("BENCH_COMM_HOOK")) options.ddp_kwargs.comm_hook = acc::parse_comm_hook_type(hook);
  acc::Accelerator accelerator(options);
  const int64_t rank = accelerator.process_index();
  const c10::Device device = accelerator.device();  // the prepared models' device: batches go there too
  for (const auto& workload : flags.workloads) {
    // The same parameters on every process (prepare broadcasts process 0's anyway), and a batch
    // of its own per process; the twin draws the same numbers from the same seeds.
    torch::manual_seed(0);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + rank);
    auto cross_entropy = [](const at::Tensor& out, const at::Tensor& t) { return torch::cross_entropy_loss(out, t); };
    if (workload == "mlp" || workload == "mlp_accum4" || workload == "startup") {
      const auto x = at::randn({64, 512}, gen).to(device);
      const auto y = at::randint(0, 10, {64}, gen, at::kLong).to(device);
      if (workload == "startup") {
        first_step(accelerator, x, y);
      } else {
        Mlp net;
        run(accelerator, workload.c_str(), net, x, y, cross_entropy, flags.warmup_steps, flags.mlp_steps,
            Training{.accumulation = workload == "mlp" ? 1 : 4});
      }
    } else if (workload == "tiny") {
      Tiny net;
      const auto x = at::randn({8, 32}, gen).to(device);
      const auto y = at::randn({8, 32}, gen).to(device);
      auto mse = [](const at::Tensor& out, const at::Tensor& t) { return torch::mse_loss(out, t); };
      run(accelerator, "tiny", net, x, y, mse, flags.warmup_steps, flags.tiny_steps);
    } else if (workload == "transformer") {
      EncoderClassifier net;
      init_transformer(*net);
      const auto x = at::randn({64, 16, 256}, gen).to(device);
      const auto y = at::randint(0, 10, {16}, gen, at::kLong).to(device);
      run(accelerator, "transformer", net, x, y, cross_entropy, flags.transformer_warmup_steps, flags.transformer_steps);
    } else if (workload == "gpt2") {
      bench::Gpt net(flags.gpt);
      init_transformer(*net);
      auto [x, y] = bench::gpt_batch(flags, gen);
      run(accelerator, "gpt2", net, x.to(device), y.to(device), bench::gpt_loss, flags.gpt_warmup_steps,
          flags.gpt_steps,
          Training{.adamw = true, .tokens_per_sample = flags.gpt.seq, .flops_per_token = net->flops_per_token(flags.gpt)});
    } else {
      TORCH_CHECK_VALUE(false, "[bench_training] unknown workload ", workload,
                        " (expected mlp, mlp_accum4, tiny, transformer, gpt2 or startup)");
    }
    accelerator.free_memory();
  }
  return 0;
}
