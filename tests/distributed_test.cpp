// Prepared models with two ranks as threads: gradient synchronisation through the Reducer, the
// guards that control it (no_sync, accumulate, sync_each_batch, trigger_sync_in_backward), and
// joining uneven inputs.
#include "accelerate/accelerator.h"
#include "accelerate/big_modeling.h"
#include "accelerate/distributed.h"
#include "accelerate/utils/communication.h"
#include "accelerate/utils/environment.h"
#include "detail/torch_compat.h"
#include "support/accelerators.h"
#include "support/test_support.h"

#include <ATen/autocast_mode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace accelerate::testing {
namespace {

constexpr int kRanks = 2;
constexpr int64_t kPerRank = 4;

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int64_t width = 3, int64_t in = 4)
      : fc1(register_module("fc1", torch::nn::Linear(in, width))),
        fc2(register_module("fc2", torch::nn::Linear(width, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Net);

// Parameters that differ per `seed`, without touching the global generator.
void fill(torch::nn::Module& module, int seed, double scale = 1.0) {
  torch::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : module.parameters()) {
    p.copy_((torch::linspace(-0.5, 0.5, p.numel()).reshape(p.sizes()) * (1 + 0.1 * i++) + 0.05 * seed) * scale);
  }
}

Net make_net(int seed, int64_t width = 3) {
  Net net(width);
  fill(*net, seed, 3.0 / static_cast<double>(width));
  return net;
}

torch::Tensor inputs(int64_t rows = kRanks * kPerRank, int64_t in = 4) {
  return torch::linspace(-1, 1, rows * in).reshape({rows, in});
}
torch::Tensor targets(const torch::Tensor& x) { return torch::sin(x.sum(1, true)); }
torch::Tensor rows_of(const torch::Tensor& t, int rank) { return t.narrow(0, rank * kPerRank, kPerRank); }

std::vector<torch::Tensor> grads_of(const torch::nn::Module& module) {
  std::vector<torch::Tensor> grads;
  for (const auto& p : module.parameters()) grads.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
  return grads;
}

torch::Tensor flat(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> parts;
  for (const auto& t : tensors) parts.push_back(t.reshape(-1));
  return torch::cat(parts);
}

// Whether every rank holds the same values (a collective).
bool same_on_all_ranks(const Accelerator& acc, const torch::Tensor& t) {
  auto all = acc.gather(t.reshape({1, -1}).contiguous());
  return torch::equal(all[0], all[1]);
}

// Gradients of one full-batch step of the reference model (a copy of rank 0's initial model).
std::vector<torch::Tensor> reference_gradients(int steps = 1) {
  Net ref = make_net(0);
  auto x = inputs();
  for (int s = 0; s < steps; ++s) torch::mse_loss(ref(x), targets(x)).backward();
  return grads_of(*ref);
}

TEST(DistributedDataParallel, BroadcastsRankZeroParametersWhenPrepared) {
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    Net net = make_net(rank);
    ASSERT_EQ(same_on_all_ranks(acc, flat(net->parameters())), false);
    auto model = acc.prepare(net);
    EXPECT_TRUE(same_on_all_ranks(acc, flat(net->parameters())));
    EXPECT_TRUE(torch::equal(flat(net->parameters()), flat(make_net(0)->parameters())));
    EXPECT_TRUE(model.ddp().is_distributed());
    EXPECT_EQ(acc.unwrap_model(model).ptr(), net.ptr());
  });
}

TEST(DistributedDataParallel, GradientsEqualTheSingleProcessFullBatchGradients) {
  const auto expected = flat(reference_gradients());
  run_accelerators(kRanks, [&](const Accelerator& acc, int rank) {
    auto model = acc.prepare(make_net(rank));
    auto x = rows_of(inputs(), rank);
    acc.backward(torch::mse_loss(model(x), targets(x)));
    auto grads = flat(grads_of(*model.module()));
    EXPECT_TRUE(same_on_all_ranks(acc, grads));
    EXPECT_TRUE(torch::allclose(grads, expected, 1e-6, 1e-7)) << grads << expected;
  });
}

// Training over several steps exercises the bucket rebuild after the first step and the
// gradients-as-views path; the model is wide enough to need several 1 MiB buckets.
class DdpKwargsTraining : public ::testing::TestWithParam<DistributedDataParallelKwargs> {};

TEST_P(DdpKwargsTraining, ThreeSgdStepsMatchTheSingleProcessRun) {
  const int64_t width = 600;  // fc1 holds 4*600 floats, fc2 600: with 1 MiB buckets that is one bucket each
  auto x_all = inputs();
  Net ref = make_net(0, width);
  torch::optim::SGD ref_opt(ref->parameters(), 0.1);
  for (int s = 0; s < 3; ++s) {
    ref_opt.zero_grad();
    torch::mse_loss(ref(x_all), targets(x_all)).backward();
    ref_opt.step();
  }
  const auto expected = flat(ref->parameters()).detach();
  AcceleratorOptions options;
  options.ddp_kwargs = GetParam();
  run_accelerators(kRanks, [&](const Accelerator& acc, int rank) {
    Net net = make_net(rank, width);
    auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
    auto x = rows_of(x_all, rank);
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      acc.backward(torch::mse_loss(model(x), targets(x)));
      opt.step();
    }
    auto params = flat(net->parameters()).detach();
    EXPECT_TRUE(same_on_all_ranks(acc, params));
    EXPECT_TRUE(torch::allclose(params, expected, 1e-5, 1e-6)) << (params - expected).abs().max();
  }, options);
}

std::string kwargs_name(const ::testing::TestParamInfo<DistributedDataParallelKwargs>& info) {
  const auto& k = info.param;
  std::string name = "Cap" + std::to_string(k.bucket_cap_mb) + "Mb";
  if (k.gradient_as_bucket_view) name += "BucketViews";
  if (k.find_unused_parameters) name += "FindUnused";
  if (k.static_graph) name += "StaticGraph";
  return name;
}

INSTANTIATE_TEST_SUITE_P(
    Kwargs, DdpKwargsTraining,
    ::testing::Values(DistributedDataParallelKwargs{}, DistributedDataParallelKwargs{.gradient_as_bucket_view = true},
                      DistributedDataParallelKwargs{.bucket_cap_mb = 1, .find_unused_parameters = true},
                      DistributedDataParallelKwargs{.static_graph = true},
                      DistributedDataParallelKwargs{.bucket_cap_mb = 1, .gradient_as_bucket_view = true,
                                                    .static_graph = true}),
    kwargs_name);

// Each process's gradient rounded to 16 bits and halved, the two summed and rounded to 16 bits:
// what the fp16/bf16 hooks promise, the same bits on every back-end and LibTorch release.
torch::Tensor compressed_mean(at::ScalarType type) {
  torch::Tensor sum;
  for (int rank = 0; rank < kRanks; ++rank) {
    Net local = make_net(0);
    auto x = rows_of(inputs(), rank);
    torch::mse_loss(local(x), targets(x)).backward();
    auto part = flat(grads_of(*local)).to(type).div_(kRanks).to(torch::kFloat);
    sum = rank == 0 ? part : sum + part;
  }
  return sum.to(type).to(torch::kFloat);
}

TEST(DistributedDataParallel, CompressionHooksAverageInReducedPrecision) {
  const auto expected = flat(reference_gradients());
  for (auto hook : {DDPCommunicationHookType::kFp16, DDPCommunicationHookType::kBf16}) {
    const auto type = hook == DDPCommunicationHookType::kFp16 ? torch::kHalf : torch::kBFloat16;
    const auto rounded = compressed_mean(type);
    AcceleratorOptions options;
    options.ddp_kwargs.comm_hook = hook;
    run_accelerators(kRanks, [&](const Accelerator& acc, int rank) {
      auto model = acc.prepare(make_net(rank));
      auto x = rows_of(inputs(), rank);
      acc.backward(torch::mse_loss(model(x), targets(x)));
      auto grads = flat(grads_of(*model.module()));
      EXPECT_TRUE(same_on_all_ranks(acc, grads));
      // Rounded through 16 bits: close, but not the fp32 result.
      EXPECT_TRUE(torch::allclose(grads, expected, 1e-2, 1e-3)) << to_string(hook);
      EXPECT_FALSE(torch::equal(grads, expected)) << to_string(hook);
      EXPECT_TRUE(torch::equal(grads, rounded)) << to_string(hook) << (grads - rounded).abs().max();
    }, options);
  }
}

// The process's communication counters across a synchronised backward pass: each bucket's
// allreduce counted at a ring's bytes (two processes: each sends its whole gradient once), the
// compression hooks at half of them, and at least one collective per process.
TEST(CommunicationCounters, CountTheBucketAllreducesOfABackwardPassAtTheirRingBytes) {
  for (auto hook : {DDPCommunicationHookType::kNo, DDPCommunicationHookType::kFp16, DDPCommunicationHookType::kBf16}) {
    AcceleratorOptions options;
    options.ddp_kwargs.comm_hook = hook;
    CommunicationCounters before, after;
    int64_t gradient_bytes = 0;
    run_accelerators(kRanks, [&](const Accelerator& acc, int rank) {
      auto model = acc.prepare(make_net(rank, 64));
      auto x = rows_of(inputs(), rank);
      if (rank == 0) {
        for (const auto& p : model.module()->parameters()) gradient_bytes += p.numel() * 4;
      }
      acc.wait_for_everyone();
      if (rank == 0) before = communication_counters();
      acc.wait_for_everyone();
      acc.backward(torch::mse_loss(model(x), targets(x)));
      acc.wait_for_everyone();
      if (rank == 0) after = communication_counters();
      acc.wait_for_everyone();
    }, options);
    const auto expected = static_cast<uint64_t>(kRanks * gradient_bytes / (hook == DDPCommunicationHookType::kNo ? 1 : 2));
    EXPECT_EQ(after.bytes_sent - before.bytes_sent, expected) << to_string(hook);
    // A bucket's allreduce on each process, and the barriers between the readings (no bytes).
    EXPECT_GE(after.collectives - before.collectives, static_cast<uint64_t>(kRanks)) << to_string(hook);
  }
}

TEST(DistributedDataParallel, ACommWrapperCastsEachBucketBeforeTheHooksOwnCast) {
  // bf16 first, then fp16: every gradient passes through both roundings (upstream wraps the
  // hook in the wrapper).
  const auto expected = flat(reference_gradients());
  const auto fp16_only = compressed_mean(torch::kHalf);
  AcceleratorOptions options;
  options.ddp_kwargs.comm_hook = DDPCommunicationHookType::kFp16;
  options.ddp_kwargs.comm_wrapper = DDPCommunicationHookType::kBf16;
  run_accelerators(kRanks, [&](const Accelerator& acc, int rank) {
    auto model = acc.prepare(make_net(rank));
    auto x = rows_of(inputs(), rank);
    acc.backward(torch::mse_loss(model(x), targets(x)));
    auto grads = flat(grads_of(*model.module()));
    EXPECT_TRUE(same_on_all_ranks(acc, grads));
    EXPECT_TRUE(torch::allclose(grads, expected, 3e-2, 1e-2));
    EXPECT_FALSE(torch::equal(grads, fp16_only)) << "the wrapper's bf16 rounding is missing";
  }, options);
}

TEST(DistributedDataParallel, KwargsThatCannotApplyAreRefusedByNameAndCheckReductionWarns) {
  const auto refused = [](DistributedDataParallelKwargs kwargs, const std::string& message) {
    EXPECT_THROWS_WITH(run_accelerators(kRanks, [](const Accelerator& acc, int rank) { (void)acc.prepare(make_net(rank)); },
                                        AcceleratorOptions{.ddp_kwargs = kwargs}),
                       message);
  };
  refused({.dim = 1}, "dim 1 is not supported: each process drives one device");
  refused({.comm_wrapper = DDPCommunicationHookType::kFp16}, "comm_wrapper \"fp16\" wraps comm_hook, which is \"no\"");
  CapturedLines lines;
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) { (void)acc.prepare(make_net(rank)); },
                   AcceleratorOptions{.ddp_kwargs = {.check_reduction = true}});
  EXPECT_TRUE(lines.saw("The `check_reduction` argument of DistributedDataParallel is deprecated"));
}

struct BranchImpl : torch::nn::Module {
  BranchImpl() : used(register_module("used", torch::nn::Linear(4, 1))), unused(register_module("unused", torch::nn::Linear(4, 1))) {}
  torch::Tensor forward(const torch::Tensor& x) { return used(x); }
  torch::nn::Linear used, unused;
};
TORCH_MODULE(Branch);

TEST(DistributedDataParallel, FindUnusedParametersLetsAnUnusedBranchSitOut) {
  AcceleratorOptions options;
  options.ddp_kwargs.find_unused_parameters = true;
  run_accelerators(kRanks, [&](const Accelerator& acc, int rank) {
    Branch net;
    fill(*net, rank);
    auto model = acc.prepare(net);
    for (int step = 0; step < 2; ++step) {
      auto x = rows_of(inputs(), rank);
      acc.backward(torch::mse_loss(model(x), targets(x)));
      EXPECT_TRUE(same_on_all_ranks(acc, flat(grads_of(*net->used))));
      EXPECT_EQ(net->unused->weight.grad().defined() ? net->unused->weight.grad().abs().sum().item<float>() : 0.f, 0.f);
    }
  }, options);
}

TEST(DistributedDataParallel, AModelThatDiffersBetweenProcessesIsRefused) {
  std::vector<std::string> errors(kRanks);
  run_accelerators(kRanks, [&](const Accelerator& acc, int rank) {
    errors[rank] = error_of([&] { (void)acc.prepare(Net(rank == 0 ? 3 : 5)); });
  });
  for (const auto& e : errors) EXPECT_THAT(e, ::testing::HasSubstr("the model differs between processes"));
}

TEST(DistributedDataParallel, ANonPositiveBucketCapIsRefused) {
  AcceleratorOptions options;
  options.ddp_kwargs.bucket_cap_mb = 0;
  run_accelerators(1, [](const Accelerator& acc, int) {
    EXPECT_THROWS_WITH((void)acc.prepare(Net()), "bucket_cap_mb must be positive, got 0");
  }, options);
  EXPECT_THROWS_WITH(DistributedDataParallel(nullptr, PartialState::standalone({.process_index = 0, .num_processes = 1,
                                                                                .store = Store::in_memory()})),
                     "expected a module, got null");
}

TEST(DistributedDataParallel, AModelWithoutTrainableParametersIsRefused) {
  run_accelerators(kRanks, [&](const Accelerator& acc, int) {
    Net net;
    for (auto& p : net->parameters()) p.requires_grad_(false);
    EXPECT_THROWS_WITH((void)acc.prepare(net), "no parameter that requires a gradient");
  });
}

struct ScaledImpl : torch::nn::Module {
  ScaledImpl() : fc(register_module("fc", torch::nn::Linear(4, 1))) { scale = register_buffer("scale", torch::ones({1})); }
  torch::Tensor forward(const torch::Tensor& x) { return fc(x) * scale; }
  torch::nn::Linear fc;
  torch::Tensor scale;
};
TORCH_MODULE(Scaled);

TEST(DistributedDataParallel, BuffersFollowRankZeroBeforeEachSynchronisingForward) {
  for (bool broadcast : {true, false}) {
    AcceleratorOptions options;
    options.ddp_kwargs.broadcast_buffers = broadcast;
    run_accelerators(kRanks, [&](const Accelerator& acc, int rank) {
      Scaled net;
      auto model = acc.prepare(net);
      net->scale.fill_(10.0 + rank);  // diverges after prepare, as running statistics do
      (void)model(rows_of(inputs(), rank));
      EXPECT_EQ(net->scale.item<float>(), broadcast ? 10.f : 10.f + rank);
    }, options);
  }
}

TEST(SyncControl, NoSyncKeepsGradientsLocalUntilASynchronisedStep) {
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    auto model = acc.prepare(make_net(0));
    auto x = rows_of(inputs(), rank);
    {
      auto guard = acc.no_sync(model);
      acc.backward(torch::mse_loss(model(x), targets(x)));
    }
    auto local = flat(grads_of(*model.module()));
    EXPECT_FALSE(same_on_all_ranks(acc, local));
    Net alone = make_net(0);
    torch::mse_loss(alone(x), targets(x)).backward();
    EXPECT_TRUE(torch::allclose(local, flat(grads_of(*alone)), 1e-6, 1e-7));
    // The next synchronised backward averages everything accumulated so far.
    acc.backward(torch::mse_loss(model(x), targets(x)));
    auto synced = flat(grads_of(*model.module()));
    EXPECT_TRUE(same_on_all_ranks(acc, synced));
    EXPECT_TRUE(torch::allclose(synced, flat(reference_gradients(2)), 1e-5, 1e-7));
  });
}

TEST(SyncControl, AccumulateSynchronisesEveryNthBatch) {
  AcceleratorOptions options;
  options.gradient_accumulation_steps = 2;
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    auto model = acc.prepare(make_net(0));
    auto x = rows_of(inputs(), rank);
    std::vector<bool> synced_steps, equal_grads;
    for (int step = 0; step < 4; ++step) {
      auto guard = acc.accumulate(model);
      acc.backward(torch::mse_loss(model(x), targets(x)));
      synced_steps.push_back(acc.sync_gradients());
      equal_grads.push_back(same_on_all_ranks(acc, flat(grads_of(*model.module()))));
    }
    EXPECT_EQ(synced_steps, (std::vector<bool>{false, true, false, true}));
    EXPECT_EQ(equal_grads, (std::vector<bool>{false, true, false, true}));
    EXPECT_EQ(acc.step(), 4);
  }, options);
}

TEST(SyncControl, BackwardDividesTheLossByTheAccumulationSteps) {
  AcceleratorOptions options;
  options.gradient_accumulation_steps = 2;
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    auto model = acc.prepare(make_net(0));
    auto x = rows_of(inputs(), rank);
    for (int step = 0; step < 2; ++step) {
      auto guard = acc.accumulate(model);
      acc.backward(torch::mse_loss(model(x), targets(x)));
    }
    // Two halves of one full-batch gradient each: the sum equals one full-batch gradient.
    EXPECT_TRUE(torch::allclose(flat(grads_of(*model.module())), flat(reference_gradients()), 1e-5, 1e-7));
  }, options);
}

TEST(SyncControl, SyncEachBatchSynchronisesEveryBackwardWhileAccumulating) {
  AcceleratorOptions options;
  options.gradient_accumulation_plugin = GradientAccumulationPlugin{.num_steps = 2, .sync_each_batch = true};
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    auto model = acc.prepare(make_net(0));
    auto x = rows_of(inputs(), rank);
    auto guard = acc.accumulate(model);
    acc.backward(torch::mse_loss(model(x), targets(x)));
    EXPECT_FALSE(acc.sync_gradients());
    EXPECT_TRUE(same_on_all_ranks(acc, flat(grads_of(*model.module()))));
  }, options);
}

TEST(SyncControl, TriggerSyncInBackwardSynchronisesAForwardRunUnderNoSync) {
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    auto model = acc.prepare(make_net(0));
    auto x = rows_of(inputs(), rank);
    auto no_sync = acc.no_sync(model);
    auto loss = torch::mse_loss(model(x), targets(x));
    {
      auto trigger = acc.trigger_sync_in_backward(model);
      acc.backward(loss);
    }
    EXPECT_TRUE(same_on_all_ranks(acc, flat(grads_of(*model.module()))));
    EXPECT_FALSE(model.ddp().require_backward_grad_sync());  // no_sync is back in force
  });
}

TEST(SyncControl, AccumulateSynchronisesOnTheLastBatchOfTheDataLoader) {
  AcceleratorOptions options;
  options.gradient_accumulation_steps = 2;
  run_accelerators(kRanks, [](const Accelerator& acc, int) {
    auto x = inputs(12);
    auto loader = acc.prepare(DataLoader(std::make_shared<TensorDataset>(x, targets(x)), {.batch_size = 2}));
    auto model = acc.prepare(make_net(0));
    std::vector<bool> synced;
    for (auto& batch : loader) {
      auto guard = acc.accumulate(model);
      acc.backward(torch::mse_loss(model(batch.data), batch.target));
      synced.push_back(acc.sync_gradients());
    }
    EXPECT_EQ(synced, (std::vector<bool>{false, true, true}));  // 3 batches per process
  }, options);
}

TEST(SyncControl, ModelsPreparedForEvaluationDoNotSynchronise) {
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    auto model = acc.prepare_model(make_net(0), std::nullopt, /*evaluation_mode=*/true);
    EXPECT_FALSE(model.ddp().is_distributed());
    auto x = rows_of(inputs(), rank);
    acc.backward(torch::mse_loss(model(x), targets(x)));
    EXPECT_FALSE(same_on_all_ranks(acc, flat(grads_of(*model.module()))));
  });
}

TEST(MixedPrecision, Bf16ForwardRunsUnderAutocastAndReturnsFp32) {
  AcceleratorOptions options;
  options.mixed_precision = "bf16";
  run_accelerators(1, [](const Accelerator& acc, int) {
    torch::nn::Linear linear(4, 3);
    auto model = acc.prepare(linear);
    auto x = inputs(2);
    auto out = model(x);
    EXPECT_EQ(out.scalar_type(), torch::kFloat);
    auto in_bf16 = torch::nn::functional::linear(x.to(torch::kBFloat16), linear->weight.to(torch::kBFloat16),
                                                 linear->bias.to(torch::kBFloat16))
                       .to(torch::kFloat);
    EXPECT_TRUE(torch::equal(out, in_bf16));
    EXPECT_FALSE(torch::equal(out, linear(x)));
    EXPECT_FALSE(detail::compat::is_autocast_enabled(c10::kCPU));  // the region ended with the call
  }, options);
}

TEST(MixedPrecision, AutocastGuardRestoresThePreviousState) {
  AcceleratorOptions options;
  options.mixed_precision = "bf16";
  run_accelerators(1, [](const Accelerator& acc, int) {
    {
      auto guard = acc.autocast();
      EXPECT_TRUE(detail::compat::is_autocast_enabled(c10::kCPU));
      EXPECT_EQ(detail::compat::get_autocast_dtype(c10::kCPU), at::kBFloat16);
      {
        auto off = acc.autocast(AutocastKwargs{.enabled = false});
        EXPECT_FALSE(detail::compat::is_autocast_enabled(c10::kCPU));
      }
      EXPECT_TRUE(detail::compat::is_autocast_enabled(c10::kCPU));
    }
    EXPECT_FALSE(detail::compat::is_autocast_enabled(c10::kCPU));
  }, options);
  EXPECT_THROWS_WITH(AutocastGuard(c10::kCPU, PrecisionType::kFp16), "fp16 autocast needs a CUDA device");
  EXPECT_THROWS_WITH(AutocastGuard(c10::kMeta, PrecisionType::kBf16), "autocast needs a CPU or CUDA device, got META");
}

// ---- joining uneven inputs ---------------------------------------------------------------------

// A batch that differs per rank and step.
torch::Tensor uneven_batch(int rank, int step) {
  return torch::sin(torch::arange(16, torch::kFloat).reshape({4, 4}) * (0.3 + 0.1 * step) + rank);
}

// What joined training must produce: at each step every rank that still has a batch adds its
// gradient, and the sum is divided by the full number of ranks (finished ranks count as zeros).
torch::Tensor joined_reference(const std::vector<int>& batches, int64_t width, double lr) {
  Net ref = make_net(0, width);
  torch::optim::SGD opt(ref->parameters(), lr);
  const int steps = *std::max_element(batches.begin(), batches.end());
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    for (int rank = 0; rank < kRanks; ++rank) {
      if (step >= batches[rank]) continue;
      auto x = uneven_batch(rank, step);
      (torch::mse_loss(ref(x), targets(x)) / kRanks).backward();
    }
    opt.step();
  }
  return flat(ref->parameters()).detach();
}

// Wide enough for three 1 MiB buckets once they are rebuilt: [fc2], [fc1.bias], [fc1.weight].
constexpr int64_t kWide = 300000;

struct JoinCase {
  std::string name;
  DistributedDataParallelKwargs kwargs;
  std::vector<int> batches;  // per rank
  int64_t width = 3;
};

class JoinUnevenInputs : public ::testing::TestWithParam<JoinCase> {};

TEST_P(JoinUnevenInputs, TrainingMatchesTheHandComputedModelOnEveryRank) {
  const auto& c = GetParam();
  const auto expected = joined_reference(c.batches, c.width, 0.1);
  AcceleratorOptions options;
  options.ddp_kwargs = c.kwargs;
  run_accelerators(kRanks, [&](const Accelerator& acc, int rank) {
    Net net = make_net(rank, c.width);
    auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
    const int done = acc.join_uneven_inputs({model.ddp()}, [&] {
      EXPECT_TRUE(model.ddp().join_enabled());
      for (int step = 0; step < c.batches[rank]; ++step) {
        opt.zero_grad();
        auto x = uneven_batch(rank, step);
        acc.backward(torch::mse_loss(model(x), targets(x)));
        opt.step();
      }
      return c.batches[rank];
    }, /*even_batches=*/false);
    EXPECT_EQ(done, c.batches[rank]);
    EXPECT_FALSE(model.ddp().join_enabled());
    auto params = flat(net->parameters()).detach();
    EXPECT_TRUE(same_on_all_ranks(acc, params));
    EXPECT_TRUE(torch::allclose(params, expected, 1e-5, 1e-6)) << (params - expected).abs().max();
  }, options);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, JoinUnevenInputs,
    ::testing::Values(JoinCase{"ThreeAndFiveBatches", {}, {3, 5}},
                      JoinCase{"FirstRankLasts", {}, {5, 3}},
                      JoinCase{"ARankWithoutBatches", {}, {0, 4}},
                      JoinCase{"OneBatchThenJoin", {}, {1, 4}},
                      JoinCase{"BucketViews", {.gradient_as_bucket_view = true}, {3, 5}},
                      JoinCase{"SeveralBuckets", {.bucket_cap_mb = 1}, {2, 5}, kWide},
                      // Rank 0 joins before the rebuild, and its bucket order is the one broadcast.
                      JoinCase{"SeveralBucketsRankZeroWithoutBatches", {.bucket_cap_mb = 1}, {0, 3}, kWide},
                      JoinCase{"FindUnused", {.find_unused_parameters = true}, {2, 5}},
                      JoinCase{"StaticGraph", {.static_graph = true}, {1, 5}},
                      JoinCase{"StaticGraphBeforeTheFirstIteration", {.static_graph = true}, {0, 5}}),
    [](const ::testing::TestParamInfo<JoinCase>& info) { return info.param.name; });

TEST(JoinUnevenInputs, AStaticGraphModelUntrainedOnSomeRankIsRefusedAfterwards) {
  AcceleratorOptions options;
  options.ddp_kwargs.static_graph = true;
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    auto model = acc.prepare(make_net(0));
    acc.join_uneven_inputs({model.ddp()}, [&] {
      for (int step = 0; step < 2 * rank; ++step) {
        auto x = uneven_batch(rank, step);
        acc.backward(torch::mse_loss(model(x), targets(x)));
      }
    }, /*even_batches=*/false);
    auto x = uneven_batch(rank, 0);
    EXPECT_THROWS_WITH((void)model(x), "process 0 ran out of inputs inside join before the first synchronising");
    torch::NoGradGuard no_grad;  // evaluation still works
    EXPECT_EQ(model(x).size(0), 4);
  }, options);
}

TEST(JoinUnevenInputs, AFinishedProcessDoesNotMarkUnusedParametersAsUsed) {
  AcceleratorOptions options;
  options.ddp_kwargs.find_unused_parameters = true;
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    Branch net;
    fill(*net, 0);
    auto model = acc.prepare(net);
    acc.join_uneven_inputs({model.ddp()}, [&] {
      for (int step = 0; step < 1 + 2 * rank; ++step) {
        auto x = uneven_batch(rank, step);
        acc.backward(torch::mse_loss(model(x), targets(x)));
      }
    }, /*even_batches=*/false);
    EXPECT_FALSE(net->unused->weight.grad().defined());
    EXPECT_TRUE(net->used->weight.grad().defined());
  }, options);
}

TEST(JoinUnevenInputs, BuffersComeFromARunningProcessAndTheLastToFinish) {
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    Scaled net;
    auto model = acc.prepare(net);
    const int batches = rank == 0 ? 5 : 3;
    std::vector<float> seen;
    acc.join_uneven_inputs({model.ddp()}, [&] {
      for (int step = 0; step < batches; ++step) {
        net->scale.fill_(10.0 * rank + step);  // running statistics drifting apart
        auto x = uneven_batch(rank, step);
        acc.backward(torch::mse_loss(model(x), targets(x)));
        seen.push_back(net->scale.item<float>());
      }
    }, /*even_batches=*/false);
    // The highest running rank is the root: rank 1 while it runs, then rank 0 alone.
    const auto expected = rank == 0 ? std::vector<float>{10, 11, 12, 3, 4} : std::vector<float>{10, 11, 12};
    EXPECT_EQ(seen, expected);
    EXPECT_EQ(net->scale.item<float>(), 4.f);  // rank 0 finished last
  });
}

TEST(JoinUnevenInputs, NoSyncStepsOfTheRunningRankAreNotShadowed) {
  // Steps 0, 2, 4 accumulate locally; steps 1 and 3 synchronise and step the optimizer.
  Net ref = make_net(0);
  torch::optim::SGD ref_opt(ref->parameters(), 0.1);
  const std::vector<int> batches{2, 5};
  for (int step = 0; step < 5; ++step) {
    for (int rank = 0; rank < kRanks; ++rank) {
      if (step >= batches[rank]) continue;
      auto x = uneven_batch(rank, step);
      (torch::mse_loss(ref(x), targets(x)) / kRanks).backward();
    }
    if (step % 2 == 1) {
      ref_opt.step();
      ref_opt.zero_grad();
    }
  }
  const auto expected = flat(ref->parameters()).detach();
  run_accelerators(kRanks, [&](const Accelerator& acc, int rank) {
    Net net = make_net(rank);
    auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
    acc.join_uneven_inputs({model.ddp()}, [&] {
      for (int step = 0; step < batches[rank]; ++step) {
        auto x = uneven_batch(rank, step);
        if (step % 2 == 0) {
          auto guard = acc.no_sync(model);
          acc.backward(torch::mse_loss(model(x), targets(x)));
        } else {
          acc.backward(torch::mse_loss(model(x), targets(x)));
          opt.step();
          opt.zero_grad();
        }
      }
    }, /*even_batches=*/false);
    auto params = flat(net->parameters()).detach();
    EXPECT_TRUE(same_on_all_ranks(acc, params));
    EXPECT_TRUE(torch::allclose(params, expected, 1e-5, 1e-6)) << (params - expected).abs().max();
  });
}

// 5 batches of 2 over 2 ranks: 3 and 3 with even batches, 3 and 2 without.
DataLoader five_batches(const Accelerator& acc) {
  auto x = inputs(10);
  return acc.prepare(DataLoader(std::make_shared<TensorDataset>(x, targets(x)), {.batch_size = 2}));
}

TEST(JoinUnevenInputs, EvenBatchesOverridesTheLoadersWhileTheBodyRuns) {
  for (bool configured : {true, false}) {
    AcceleratorOptions options;
    options.dataloader_config.even_batches = configured;
    run_accelerators(kRanks, [&](const Accelerator& acc, int rank) {
      auto loader = five_batches(acc);
      Net net = make_net(0);
      auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
      const int64_t uneven = rank == 0 ? 3 : 2;
      const bool override_to = !configured;
      int64_t seen = 0;
      acc.join_uneven_inputs({model.ddp()}, [&] {
        EXPECT_EQ(loader.size(), override_to ? 3 : uneven);
        EXPECT_EQ(model.ddp().join_enabled(), !override_to);
        for (auto& b : loader) {
          acc.backward(torch::mse_loss(model(b.data), b.target));
          opt.step();
          opt.zero_grad();
          ++seen;
        }
      }, override_to);
      EXPECT_EQ(seen, override_to ? 3 : uneven);
      EXPECT_EQ(loader.size(), configured ? 3 : uneven);  // restored
      EXPECT_TRUE(same_on_all_ranks(acc, flat(net->parameters()).detach()));
    }, options);
  }
}

TEST(JoinUnevenInputs, AnExceptionFromTheBodyPropagatesAndRestoresTheSettings) {
  run_accelerators(kRanks, [](const Accelerator& acc, int rank) {
    auto loader = five_batches(acc);
    auto model = acc.prepare(make_net(0));
    EXPECT_THROWS_WITH(acc.join_uneven_inputs({model.ddp()}, [&] {
      auto x = uneven_batch(rank, 0);
      acc.backward(torch::mse_loss(model(x), targets(x)));
      throw std::runtime_error("out of memory, say");
    }, /*even_batches=*/false), "out of memory, say");
    EXPECT_FALSE(model.ddp().join_enabled());
    EXPECT_EQ(loader.size(), 3);
  });
}

TEST(JoinUnevenInputs, OneModelIsJoinedAtATime) {
  run_accelerators(kRanks, [](const Accelerator& acc, int) {
    auto a = acc.prepare(make_net(0));
    auto b = acc.prepare(make_net(1));
    bool ran = false;
    EXPECT_THROWS_WITH(acc.join_uneven_inputs({a.ddp(), b.ddp()}, [&] { ran = true; }, /*even_batches=*/false),
                       "one prepared model can be joined at a time, got 2");
    EXPECT_THROWS_WITH(acc.join_uneven_inputs({}, [&] { ran = true; }, /*even_batches=*/false),
                       "expected at least one prepared model");
    EXPECT_FALSE(ran);
    // The same model twice, or next to a model prepared for evaluation, is one model.
    auto eval = acc.prepare_model(make_net(2), std::nullopt, /*evaluation_mode=*/true);
    acc.join_uneven_inputs({a.ddp(), a.ddp(), eval.ddp()}, [&] { ran = true; }, /*even_batches=*/false);
    EXPECT_TRUE(ran);
  });
}

TEST(JoinUnevenInputs, OneProcessJustRunsTheBody) {
  run_accelerators(1, [](const Accelerator& acc, int) {
    auto model = acc.prepare(make_net(0));
    const auto answer = acc.join_uneven_inputs({model.ddp()}, [&] {
      EXPECT_FALSE(model.ddp().join_enabled());
      return std::string("done");
    }, /*even_batches=*/false);
    EXPECT_EQ(answer, "done");
  });
}

// ---- extract_model_from_parallel, verify_device_map ------------------------------------------

TEST(ExtractModelFromParallel, RunsTheModuleWithoutSynchronisingAndKeepsOrDropsMixedPrecision) {
  AcceleratorOptions options;
  options.mixed_precision = "bf16";
  run_accelerators(kRanks, [&](const Accelerator& acc, int rank) {
    auto prepared = acc.prepare(make_net(rank));
    auto x = rows_of(inputs(), rank);
    auto kept = extract_model_from_parallel(prepared);
    auto dropped = extract_model_from_parallel(prepared, /*keep_fp32_wrapper=*/false);
    EXPECT_EQ(kept.module().ptr(), prepared.module().ptr());
    EXPECT_FALSE(kept.ddp().is_distributed());
    // With the wrapper: the bf16 forward of the prepared model, returned in fp32.
    torch::Tensor through_prepared;
    {
      torch::NoGradGuard no_grad;
      through_prepared = prepared(x);
    }
    const auto with_wrapper = kept(x);
    EXPECT_EQ(with_wrapper.scalar_type(), torch::kFloat);
    EXPECT_TRUE(torch::equal(with_wrapper, through_prepared));
    // Without it: the module's own fp32 forward.
    const auto without = dropped(x);
    Net module = prepared.module();
    EXPECT_TRUE(torch::equal(without, module->forward(x)));
    EXPECT_FALSE(torch::equal(without, with_wrapper));
    // No gradient synchronisation: each process keeps the gradients of its own rows.
    module->zero_grad();
    torch::mse_loss(dropped(x), targets(x)).backward();
    EXPECT_FALSE(same_on_all_ranks(acc, flat(grads_of(*module))));
  }, options);
  // A module that was never prepared comes back as it is.
  Net net = make_net(0);
  EXPECT_EQ(extract_model_from_parallel(net).ptr(), net.ptr());
}

TEST(VerifyDeviceMap, TrueOnlyForAModelDispatchedOverSeveralEntries) {
  run_accelerators(1, [&](const Accelerator& acc, int) {
    Net plain = make_net(0);
    EXPECT_FALSE(acc.verify_device_map(plain));
    Net whole = make_net(0);
    dispatch_model(*whole, {{"", MapDevice("cpu")}});
    ASSERT_TRUE(hf_device_map(*whole).has_value());
    EXPECT_FALSE(acc.verify_device_map(whole));  // one entry: not split
    Net split = make_net(0);
    dispatch_model(*split, {{"fc1", MapDevice("cpu")}, {"fc2", MapDevice("cpu")}});
    EXPECT_TRUE(acc.verify_device_map(split));
    // A dispatched submodule counts too.
    torch::nn::Sequential outer(split);
    EXPECT_TRUE(acc.verify_device_map(outer));
  });
}

TEST(VerifyDeviceMap, ADispatchedModelIsRefusedByPrepareWithSeveralProcessesUnlessBypassed) {
  std::vector<std::string> errors(kRanks);
  run_accelerators(kRanks, [&](const Accelerator& acc, int rank) {
    Net net = make_net(0);
    dispatch_model(*net, {{"fc1", MapDevice("cpu")}, {"fc2", MapDevice("cpu")}});
    errors[rank] = error_of([&] { (void)acc.prepare(net); });
  });
  for (const auto& e : errors) {
    EXPECT_THAT(e, ::testing::HasSubstr("can't train a model that has been dispatched over several devices"));
  }
  auto env = patch_environment({{"ACCELERATE_BYPASS_DEVICE_MAP", "true"}});
  run_accelerators(kRanks, [&](const Accelerator& acc, int) {
    Net net = make_net(0);
    dispatch_model(*net, {{"fc1", MapDevice("cpu")}, {"fc2", MapDevice("cpu")}});
    EXPECT_TRUE(acc.prepare(net).ddp().is_distributed());
  });
}

}  // namespace
}  // namespace accelerate::testing
