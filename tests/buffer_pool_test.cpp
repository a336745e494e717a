// The process's pool of large CPU buffers (Note [One pool for the process's large CPU buffers]):
// freed buffers served again by size, the bound it keeps to when it must allocate, a training
// loop that in its steady state takes no fresh large buffer, and the switch that turns it off.
#include "accelerate/accelerator.h"
#include "detail/buffer_pool.h"
#include "support/accelerators.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

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

}  // namespace
}  // namespace accelerate::testing
