// W13: training across machines at a link's speed. W9's model (pre-norm MLP blocks: LayerNorm,
// Linear d→4d, GELU, Linear 4d→d, residual; 8 blocks of d 768 make 38M parameters), AdamW, on the
// processes `accelerate launch` starts on each machine of a job, under one of:
//   ddp            DDP over every process (--comm_hook fp16|bf16 compresses its buckets);
//   full_shard     FULL_SHARD over every process, each block a unit;
//   shard_grad_op  SHARD_GRAD_OP over every process;
//   hybrid_shard   HYBRID_SHARD: shards within a machine, replicas across machines;
//   tp_ddp         tensor parallelism over pairs of consecutive processes (up by columns, down by
//                  rows: each machine's pair when machines run two), DDP across the pairs;
//   compute        DDP's steps under no_sync: the same work without communication.
// Process 0 prints one JSON object: samples/s and seconds per step over the timed steps, the
// bytes each process counted as sent per step (accelerate::communication_counters) and the sum
// over machine 0's processes, the bytes the link's interface sent per step (--link: its name on
// this machine, read from /sys/class/net), the bytes of every other interface of this machine
// (loopback: what stays on the machine), the collectives per step, for DDP how many collectives
// had started before the backward pass reached the first block's parameters (buckets that went on
// the wire while the backward pass went on), the CPU seconds all processes used per step (user and
// system, summed), how busy the computer's processors were over the timed steps (/proc/stat: the
// test bed's machines share them), its peak resident memory (VmHWM) and the final loss.
// Usage: accelerate launch … bench_multihost MODE [--width 768] [--blocks 8] [--rows 64] [--steps 6]
//        [--warmup 2] [--bucket_cap_mb 25] [--comm_hook no|fp16|bf16] [--link DEV]
#include <accelerate/accelerate.h>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <utility>

#include <sys/resource.h>

namespace acc = accelerate;
using Clock = std::chrono::steady_clock;

namespace {

int64_t width = 768;
int blocks = 8;

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : norm(register_module("norm", acc::nn::LayerNorm(torch::nn::LayerNormOptions({width})))),
        up(register_module("up", acc::nn::Linear(width, 4 * width))),
        down(register_module("down", acc::nn::Linear(4 * width, width))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + down(torch::gelu(up(norm(x)))); }
  acc::nn::LayerNorm norm;
  acc::nn::Linear up, down;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module, acc::nn::TensorParallelPlanned {
  NetImpl() : head(register_module("head", torch::nn::Linear(width, 16))) {
    for (int i = 0; i < blocks; ++i) stack->push_back(Block());
    register_module("blocks", stack);
  }
  std::vector<std::pair<std::string, std::string>> tp_plan() const override {
    return {{"blocks.*.up", "colwise"}, {"blocks.*.down", "rowwise"}};
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(acc::forward(stack, x)); }
  torch::nn::Sequential stack;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

double status_mib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stod(line.substr(field.size() + 1)) / 1024.0;
  }
  return 0;
}

// Bytes sent by `device` on this machine (its network namespace), or by every interface but it.
double tx_bytes(const std::string& device, bool all_but) {
  double total = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/sys/class/net", ec)) {
    const std::string name = entry.path().filename().string();
    if ((name == device) == all_but) continue;
    std::ifstream in(entry.path() / "statistics" / "tx_bytes");
    double value = 0;
    if (in >> value) total += value;
  }
  return total;
}

// CPU seconds this process has used, in user and system time, all its threads together.
double cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// The computer's processor time so far, in clock ticks: {busy, all} over every processor
// (/proc/stat's first line; idle and waiting for I/O are not busy).
std::pair<double, double> processor_ticks() {
  std::ifstream in("/proc/stat");
  std::string cpu;
  in >> cpu;
  double busy = 0, all = 0, value = 0;
  for (int field = 0; field < 8 && in >> value; ++field) {
    all += value;
    if (field != 3 && field != 4) busy += value;  // idle, iowait
  }
  return {busy, all};
}

}  // namespace

int main(int argc, char** argv) {
  TORCH_CHECK(argc >= 2, "usage: bench_multihost ddp|full_shard|shard_grad_op|hybrid_shard|tp_ddp|compute [flags]");
  const std::string mode = argv[1];
  std::map<std::string, std::string> flags{{"--rows", "64"},   {"--steps", "6"},        {"--warmup", "2"},
                                           {"--width", "768"}, {"--blocks", "8"},       {"--bucket_cap_mb", "25"},
                                           {"--link", ""},     {"--comm_hook", "no"}};
  for (int i = 2; i < argc; i += 2) {
    TORCH_CHECK(flags.count(argv[i]) && i + 1 < argc, "unknown flag or missing value: ", argv[i]);
    flags[argv[i]] = argv[i + 1];
  }
  width = std::stoll(flags["--width"]);
  blocks = std::stoi(flags["--blocks"]);
  const int64_t rows = std::stoll(flags["--rows"]);
  const int steps = std::stoi(flags["--steps"]), warmup = std::stoi(flags["--warmup"]);
  const std::string link = flags["--link"], hook = flags["--comm_hook"];

  const acc::PartialState state;
  const int world = state.num_processes(), per_machine = state.local_num_processes();
  acc::AcceleratorOptions options;
  options.ddp_kwargs.bucket_cap_mb = std::stod(flags["--bucket_cap_mb"]);
  TORCH_CHECK(hook == "no" || hook == "fp16" || hook == "bf16", "--comm_hook is no, fp16 or bf16, not ", hook);
  if (hook == "fp16") options.ddp_kwargs.comm_hook = acc::DDPCommunicationHookType::kFp16;
  if (hook == "bf16") options.ddp_kwargs.comm_hook = acc::DDPCommunicationHookType::kBf16;
  int tp_size = 1;
  if (mode == "full_shard" || mode == "shard_grad_op" || mode == "hybrid_shard") {
    options.fsdp_plugin = acc::FullyShardedDataParallelPlugin{
        .sharding_strategy = mode == "full_shard"      ? acc::FsdpShardingStrategy::kFullShard
                             : mode == "shard_grad_op" ? acc::FsdpShardingStrategy::kShardGradOp
                                                       : acc::FsdpShardingStrategy::kHybridShard,
        .auto_wrap_policy = acc::FsdpAutoWrapPolicy::kTransformerBasedWrap,
        .transformer_cls_names_to_wrap = {"Block"}};
  } else if (mode == "tp_ddp") {
    TORCH_CHECK(world % 2 == 0, "tp_ddp needs an even number of processes, not ", world);
    tp_size = 2;
    options.parallelism_config = acc::ParallelismConfig{.dp_replicate_size = world / 2, .tp_size = 2};
  } else {
    TORCH_CHECK(mode == "ddp" || mode == "compute", "unknown mode ", mode);
  }
  acc::Accelerator accelerator(options);
  torch::manual_seed(0);
  Net net;
  int64_t params = 0;
  for (const auto& p : net->parameters()) params += p.numel();
  auto adamw = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(1e-4));
  auto [model, optimizer] = accelerator.prepare(net, adamw);

  const int rank = accelerator.process_index(), dp_rank = rank / tp_size;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + dp_rank);
  const auto x = at::randn({rows, width}, gen);
  const auto y = at::randint(0, 16, {rows}, gen);

  // The collectives entered before the backward pass reaches the first block's parameters.
  uint64_t started_at_backward = 0, before_first_block = 0;
  auto first = net->stack->ptr(0)->parameters().front();
  if (mode == "ddp") {
    first.register_hook([&](const torch::Tensor& g) {
      before_first_block = acc::communication_counters().collectives - started_at_backward;
      return g;
    });
  }

  double loss = 0;
  Clock::time_point start;
  acc::CommunicationCounters counted{};
  double link_at_start = 0, other_at_start = 0;
  uint64_t started_before_end = 0;
  double cpu_at_start = 0;
  std::pair<double, double> ticks_at_start{};
  for (int s = 0; s < warmup + steps; ++s) {
    if (s == warmup) {
      accelerator.wait_for_everyone();
      start = Clock::now();
      counted = acc::communication_counters();
      link_at_start = tx_bytes(link, false);
      other_at_start = tx_bytes(link, true);
      cpu_at_start = cpu_seconds();
      ticks_at_start = processor_ticks();
    }
    torch::Tensor out;
    auto pass = [&] {
      out = torch::nn::functional::cross_entropy(model(x), y);
      started_at_backward = acc::communication_counters().collectives;
      accelerator.backward(out);
    };
    if (mode == "compute") {  // no_sync around the forward pass too: DDP decides there
      auto local = accelerator.no_sync(model);
      pass();
    } else {
      pass();
    }
    if (s >= warmup) started_before_end += before_first_block;
    optimizer.step();
    optimizer.zero_grad();
    loss = out.item<double>();
  }
  accelerator.wait_for_everyone();  // the job's time: under no_sync the processes drift apart
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const double cpu_per_step = (cpu_seconds() - cpu_at_start) / steps;
  const auto ticks = processor_ticks();
  const double busy = (ticks.first - ticks_at_start.first) / std::max(1.0, ticks.second - ticks_at_start.second);
  const auto now = acc::communication_counters();
  const double link_sent = tx_bytes(link, false) - link_at_start, other_sent = tx_bytes(link, true) - other_at_start;
  const double sent = static_cast<double>(now.bytes_sent - counted.bytes_sent) / steps;
  // Machine 0's processes together (the first `per_machine` of the job).
  auto all = accelerator.gather(torch::tensor({sent}, torch::kDouble));
  const double machine_sent = all.narrow(0, 0, per_machine).sum().item<double>();
  const double cpu_all = accelerator.gather(torch::tensor({cpu_per_step}, torch::kDouble)).sum().item<double>();
  accelerator.wait_for_everyone();
  if (accelerator.is_main_process()) {
    std::printf(
        "{\"workload\": \"multihost\", \"mode\": \"%s\", \"side\": \"cpp\", \"comm_hook\": \"%s\", "
        "\"processes\": %d, \"per_machine\": %d, \"params\": %lld, \"bucket_cap_mb\": %s, \"samples_per_s\": %.2f, "
        "\"step_s\": %.4f, \"counted_sent_per_step\": %.0f, \"counted_machine_sent_per_step\": %.0f, "
        "\"link_tx_per_step\": %.0f, \"loopback_tx_per_step\": %.0f, \"collectives_per_step\": %.1f, "
        "\"started_before_backward_end\": %.1f, \"cpu_s_per_step\": %.3f, \"processors\": %u, "
        "\"processors_busy\": %.3f, \"peak_mib\": %.1f, \"last_loss\": %.6f}\n",
        mode.c_str(), hook.c_str(), world, per_machine, static_cast<long long>(params),
        flags["--bucket_cap_mb"].c_str(), static_cast<double>(steps * rows * (world / tp_size)) / seconds,
        seconds / steps, sent, machine_sent, link.empty() ? -1.0 : link_sent / steps, other_sent / steps,
        static_cast<double>(now.collectives - counted.collectives) / steps,
        static_cast<double>(started_before_end) / steps, cpu_all, std::thread::hardware_concurrency(), busy,
        status_mib("VmHWM"), loss);
    std::fflush(stdout);
  }
  return 0;
}
