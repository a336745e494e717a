// The process's pool of large CPU buffers (Note [One pool for the process's large CPU buffers]):
// freed buffers served again by size, the bound it keeps to when it must allocate, a training
// loop that in its steady state takes no fresh large buffer, the process's peak memory over the
// pool switched off, the switch that turns it off, and the buffers below the pool's size served
// again from glibc's heap without fresh pages (Note [Small buffers from the heap]).
#include "accelerate/accelerator.h"
#include "detail/buffer_pool.h"
#include "support/accelerators.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <sys/resource.h>

#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace accelerate::testing {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

// Installs the pool, as every PartialState does.
detail::HostPoolStats pool_now() {
  detail::install_host_pool();
  return detail::host_pool_stats();
}

TEST(HostPool, LargeBuffersFreedAreServedAgainBySize) {
  ASSERT_TRUE(pool_now().installed);
  void* first = nullptr;
  {
    auto t = at::empty({3 * kMiB}, at::kByte);
    t.fill_(7);
    first = t.data_ptr();
  }
  const auto before = detail::host_pool_stats();
  auto again = at::empty({3 * kMiB}, at::kByte);
  const auto after = detail::host_pool_stats();
  EXPECT_EQ(again.data_ptr(), first) << "a freed buffer of the same size was not served again";
  EXPECT_EQ(after.reused, before.reused + 1);
  EXPECT_EQ(after.fresh, before.fresh);
  // A size just below it falls into the same size class (a sixteenth of its power of two).
  again = at::Tensor();
  auto near = at::empty({3 * kMiB - 1000}, at::kByte);
  EXPECT_EQ(near.data_ptr(), first);
  // Small buffers are the system allocator's, and the counts do not move.
  const auto small_before = detail::host_pool_stats();
  { auto small = at::empty({kMiB / 2}, at::kByte); }
  const auto small_after = detail::host_pool_stats();
  EXPECT_EQ(small_after.fresh, small_before.fresh);
  EXPECT_EQ(small_after.reused, small_before.reused);
}

TEST(HostPool, ABufferWithNoMatchLetsGoOfAllButTheBoundFirst) {
  ASSERT_TRUE(pool_now().installed);
  detail::empty_host_pool();
  std::vector<at::Tensor> held;
  for (int64_t mib : {20, 24, 28}) held.push_back(at::empty({mib * kMiB}, at::kByte));
  for (auto& t : held) t = at::Tensor();  // freed in this order: 28 MiB last
  EXPECT_EQ(detail::host_pool_stats().kept_bytes, size_t{72 * kMiB});
  const auto before = detail::host_pool_stats();
  auto fresh = at::empty({40 * kMiB}, at::kByte);  // no kept buffer of this size
  const auto after = detail::host_pool_stats();
  EXPECT_EQ(after.fresh, before.fresh + 1);
  EXPECT_LE(after.kept_bytes, detail::kPoolKeepsOnMissBytes)
      << "fresh memory was taken on top of more than the bound of kept buffers";
  // The most recently freed buffer is the one kept.
  auto kept = at::empty({28 * kMiB}, at::kByte);
  EXPECT_EQ(detail::host_pool_stats().reused, after.reused + 1);
  detail::empty_host_pool();
  EXPECT_EQ(detail::host_pool_stats().kept_bytes, 0u);
}

struct WideNetImpl : torch::nn::Module {
  WideNetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(1024, 1024))),
        fc2(register_module("fc2", torch::nn::Linear(1024, 512))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(WideNet);

// Steps of a training loop: AdamW's temporaries, gradients made again after zero_grad, a reduced
// and a gathered metric of 4 MiB. After the first steps, every large buffer comes from the pool.
// (tests/multiprocess/process_group_test.cpp checks the same on 2 processes, with DDP's Reducer.)
TEST(HostPool, SteadyTrainingStepsTakeNoFreshLargeBuffer) {
  ASSERT_TRUE(pool_now().installed);
  run_accelerators(1, [&](const Accelerator& acc, int) {
    torch::manual_seed(0);
    WideNet net;
    auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), 1e-3));
    auto step = [&](int i) {
      auto x = torch::randn({8, 1024});
      opt.zero_grad();
      acc.backward(model(x).pow(2).mean());
      opt.step();
      auto metric = torch::full({kMiB}, static_cast<float>(i));
      auto summed = acc.reduce(metric);
      auto gathered = acc.gather(metric);
      ASSERT_EQ(gathered.size(0), kMiB);
      ASSERT_EQ(summed[0].item<float>(), static_cast<float>(i));
    };
    for (int i = 0; i < 3; ++i) step(i);
    const auto warm = detail::host_pool_stats();
    for (int i = 3; i < 8; ++i) step(i);
    const auto steady = detail::host_pool_stats();
    EXPECT_EQ(steady.fresh, warm.fresh) << "steps in the steady state took fresh large buffers";
    // Per step at least: 2 gradients, AdamW's temporaries, the metric and its reduced copy.
    EXPECT_GE(steady.reused - warm.reused, 5u * 4u);
  });
}

// A field of /proc/self/status in KiB ("VmRSS", "VmHWM"); -1 when it cannot be read.
int64_t status_kib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  }
  return -1;
}

// Takes a buffer of `bytes` through LibTorch's CPU allocator and touches every page; the tensor
// frees it.
at::Tensor taken_and_touched(int64_t bytes) {
  auto t = at::empty({bytes}, at::kByte);
  auto* data = t.data_ptr<uint8_t>();
  for (int64_t offset = 0; offset < bytes; offset += 4096) data[offset] = 1;
  return t;
}

// The two patterns of Note [One pool for the process's large CPU buffers] whose peak the pool
// once let rise far past its bound; returns the most bytes they hold at once. "classes": 48 size
// classes (1 to 8 MiB) taken in turn, three times over, each freed before the next. "threads":
// two threads taking buffers of 1 to 256 MiB (log-uniform), in step: both take one, touch it and
// free it, then both take the next.
int64_t run_pool_pattern(const std::string& pattern) {
  int64_t most = 0;
  if (pattern == "classes") {
    for (int round = 0; round < 3; ++round) {
      for (int64_t power : {kMiB, 2 * kMiB, 4 * kMiB}) {
        for (int64_t i = 1; i <= 16; ++i) {
          const int64_t bytes = power + i * power / 16;
          (void)taken_and_touched(bytes);
          most = std::max(most, bytes);
        }
      }
    }
  } else if (pattern == "threads") {
    constexpr int kSteps = 60;
    auto sizes = [](unsigned seed) {
      std::mt19937 random(seed);
      std::vector<int64_t> out;
      for (int i = 0; i < kSteps; ++i) {
        out.push_back(static_cast<int64_t>(std::exp2(static_cast<double>(random() % 8001) / 1000.0) * kMiB));
      }
      return out;
    };
    const std::vector<std::vector<int64_t>> taken = {sizes(1), sizes(2)};
    for (int i = 0; i < kSteps; ++i) most = std::max(most, taken[0][i] + taken[1][i]);
    std::barrier step(2);
    auto taker = [&](const std::vector<int64_t>& mine) {
      for (int64_t bytes : mine) {
        {
          auto t = taken_and_touched(bytes);
          step.arrive_and_wait();  // both hold theirs
        }
        step.arrive_and_wait();  // both have freed theirs
      }
    };
    std::thread first(taker, std::cref(taken[0]));
    std::thread second(taker, std::cref(taken[1]));
    first.join();
    second.join();
  }
  return most;
}

// In a process of its own (ACCELERATE_TEST_POOL_PATTERN set) this test runs a pattern and prints
// how far its resident memory rose and the most it held at once; the test itself runs each pattern
// so and checks that the rise stays within kPoolKeepsOnMissBytes of what it held. Without the pool
// the rise is at least what was held, so this is the documented bound over the pool switched off,
// without depending on what malloc happens to keep. Resident memory only: no timing.
TEST(HostPool, PeakMemoryStaysWithinTheBoundOverThePoolSwitchedOff) {
  if (const char* pattern = std::getenv("ACCELERATE_TEST_POOL_PATTERN")) {
    detail::install_host_pool();  // unless ACCELERATE_CPU_BUFFER_POOL=0
    { auto warm = torch::ones({64, 64}).matmul(torch::ones({64, 64})); }  // LibTorch's own first use
    { std::ofstream("/proc/self/clear_refs") << "5"; }  // the peak starts again from here, where allowed
    const int64_t start = status_kib("VmRSS");
    const int64_t most = run_pool_pattern(pattern);
    std::cout << "rose by " << (status_kib("VmHWM") - start) << " KiB holding at most " << (most >> 10) << " KiB\n"
              << std::flush;
    return;
  }
  const std::string self = std::filesystem::read_symlink("/proc/self/exe");
  const double bound_mib = static_cast<double>(detail::kPoolKeepsOnMissBytes >> 20);
  for (const std::string pattern : {"classes", "threads"}) {
    auto child = run({self, "--gtest_filter=HostPool.PeakMemoryStaysWithinTheBoundOverThePoolSwitchedOff"}, 300,
                     {{"ACCELERATE_TEST_POOL_PATTERN", pattern},
                      {"ACCELERATE_CPU_BUFFER_POOL", "1"},
                      {"GTEST_TOTAL_SHARDS", "1"},  // not the shard this test runs in
                      {"GTEST_SHARD_INDEX", "0"}});
    EXPECT_EQ(child->exit_code(), 0) << child->err;
    long long rose_kib = 0, held_kib = 0;
    const size_t at = child->out.find("rose by ");
    ASSERT_NE(at, std::string::npos) << "the " << pattern << " pattern printed no peak: " << child->out << child->err;
    ASSERT_EQ(std::sscanf(child->out.c_str() + at, "rose by %lld KiB holding at most %lld KiB", &rose_kib, &held_kib),
              2);
    const double over_mib = static_cast<double>(rose_kib - held_kib) / 1024;
    // A few MiB for what else moves: page tables, the threads' stacks.
    EXPECT_LE(over_mib, bound_mib + 8) << "the " << pattern << " pattern's resident memory rose " << over_mib
                                       << " MiB over the " << held_kib / 1024 << " MiB it held at once";
  }
}

// Every state installs the pool, unless the environment turns it off.
TEST(HostPool, AStateInstallsThePoolUnlessTheEnvironmentTurnsItOff) {
  auto on = run({worker_bin(), "pool"});
  EXPECT_EQ(on->exit_code(), 0) << on->err;
  EXPECT_EQ(on->out, "pool on\n");
  for (const char* value : {"0", "false", "OFF"}) {
    auto off = run({worker_bin(), "pool"}, 60, {{"ACCELERATE_CPU_BUFFER_POOL", value}});
    EXPECT_EQ(off->out, "pool off\n") << value;
  }
  auto explicit_on = run({worker_bin(), "pool"}, 60, {{"ACCELERATE_CPU_BUFFER_POOL", "1"}});
  EXPECT_EQ(explicit_on->out, "pool on\n");
  // A value that is not a boolean stops the state, naming the variable and what it got.
  auto bad = run({worker_bin(), "pool"}, 60, {{"ACCELERATE_CPU_BUFFER_POOL", "maybe"}});
  EXPECT_NE(bad->exit_code(), 0);
  EXPECT_NE(bad->err.find("ACCELERATE_CPU_BUFFER_POOL must be a boolean (1/0, true/false, yes/no), got 'maybe'"),
            std::string::npos)
      << bad->err;
}

// Rounds of 40 buffers of 512 KiB (a small model's activations), written and freed: the page
// faults of the later rounds, per round, against the pages each round writes.
TEST(HostPool, BuffersBelowThePoolsSizeComeBackFromTheHeapWithoutFreshPages) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the sanitizer's allocator replaces glibc's malloc, whose thresholds this test checks (the dev "
                  "tier runs it)";
#endif
  constexpr int64_t kBuffers = 40, kFloats = 128 * 1024, kRounds = 12, kCounted = 8;
  const long pages = kBuffers * kFloats * 4 / ::sysconf(_SC_PAGESIZE);
  if (std::getenv("ACCELERATE_TEST_SMALL_BUFFERS") != nullptr) {
    detail::install_host_pool();  // unless ACCELERATE_CPU_BUFFER_POOL=0
    long faults = 0;
    for (int round = 0; round < kRounds; ++round) {
      rusage before{}, after{};
      ::getrusage(RUSAGE_SELF, &before);
      {
        std::vector<at::Tensor> buffers;
        for (int64_t i = 0; i < kBuffers; ++i) buffers.push_back(at::full({kFloats}, static_cast<float>(round)));
      }
      ::getrusage(RUSAGE_SELF, &after);
      if (round >= kRounds - kCounted) faults += after.ru_minflt - before.ru_minflt;
    }
    std::cout << "faults per round " << faults / kCounted << "\n" << std::flush;
    return;
  }
  const std::string self = std::filesystem::read_symlink("/proc/self/exe");
  auto faults_with = [&](std::map<std::string, std::string> env) -> long {
    env["ACCELERATE_TEST_SMALL_BUFFERS"] = "1";
    env["GTEST_TOTAL_SHARDS"] = "1";  // not the shard this test runs in
    env["GTEST_SHARD_INDEX"] = "0";
    auto child = run({self, "--gtest_filter=HostPool.BuffersBelowThePoolsSizeComeBackFromTheHeapWithoutFreshPages"},
                     120, env);
    EXPECT_EQ(child->exit_code(), 0) << child->err;
    long faults = -1;
    const size_t at = child->out.find("faults per round ");
    if (at == std::string::npos || std::sscanf(child->out.c_str() + at, "faults per round %ld", &faults) != 1) {
      ADD_FAILURE() << "the child printed no count: " << child->out << child->err;
    }
    return faults;
  };
  // With the pool: the heap keeps the 20 MiB each round frees, and the next round writes into it.
  const long pooled = faults_with({{"ACCELERATE_CPU_BUFFER_POOL", "1"}});
  EXPECT_LT(pooled, pages / 10) << "of " << pages << " pages written per round";
  // Without it glibc is left as it was: each round's buffers are fresh pages again (mapped, or
  // trimmed off the heap's top and faulted back).
  const long unpooled = faults_with({{"ACCELERATE_CPU_BUFFER_POOL", "0"}});
  EXPECT_GT(unpooled, pages / 2) << "of " << pages << " pages written per round";
  // The environment's own threshold wins over the library's: here glibc's start, 128 KiB, fixed.
  for (const auto& [key, value] : std::map<std::string, std::string>{
           {"MALLOC_MMAP_THRESHOLD_", "131072"}, {"GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072"}}) {
    const long own = faults_with({{"ACCELERATE_CPU_BUFFER_POOL", "1"}, {key, value}});
    EXPECT_GT(own, pages / 2) << key << "=" << value << ": of " << pages << " pages written per round";
  }
}

}  // namespace
}  // namespace accelerate::testing
