// Fully sharded data parallelism with ranks as threads: training equals the single-process run
// for every sharding strategy and wrapping policy, parameters and optimizer state hold only
// shards, gradient accumulation, the global gradient norm, frozen parameters, the whole state
// dict, and every setting that is refused.
#include "accelerate/accelerator.h"
#include "accelerate/commands/merge.h"
#include "accelerate/big_modeling.h"
#include "accelerate/hooks.h"
#include "accelerate/nn.h"
#include "accelerate/utils/environment.h"
#include "distributed_impl.h"
#include "fsdp/engine.h"
#include "grad_scaler_impl.h"
#include "detail/torch_compat.h"
#include "support/accelerators.h"
#include "support/test_support.h"

#include <atomic>
#include <limits>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace accelerate::testing {
namespace {

constexpr int64_t kRows = 8;  // the whole batch; every rank takes kRows / ranks of it

thread_local int block_forwards = 0;  // ranks are threads: each counts its own

struct BlockImpl : torch::nn::Module {
  BlockImpl() : fc(register_module("fc", torch::nn::Linear(6, 6))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    ++block_forwards;
    return torch::tanh(fc(x)) + x;
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(Block);

// 6 and 3 rows do not divide by 4 processes; with 4, one process holds no row of `embed`.
struct TinyImpl : torch::nn::Module {
  TinyImpl()
      : embed(register_module("embed", torch::nn::Linear(5, 6))),
        blocks(register_module("blocks", torch::nn::Sequential(Block(), Block()))),
        head(register_module("head", torch::nn::Linear(6, 3))) {
    scale = register_parameter("scale", torch::ones({}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return head(accelerate::forward(blocks, embed(x))) * scale;
  }
  torch::nn::Linear embed;
  torch::nn::Sequential blocks;
  torch::nn::Linear head;
  torch::Tensor scale;
};
TORCH_MODULE(Tiny);

Tiny make_tiny() {
  Tiny net;
  torch::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : net->parameters()) {
    p.copy_(torch::linspace(-0.4, 0.6, p.numel()).reshape(p.sizes()) * (1 + 0.1 * i++));
  }
  return net;
}

torch::Tensor batch() { return torch::linspace(-1, 1, kRows * 5).reshape({kRows, 5}); }
torch::Tensor labels() { return torch::tensor({0, 1, 2, 1, 0, 2, 2, 1}, torch::kLong); }

std::map<std::string, torch::Tensor> as_map(const StateDictMap& state) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : state) out[item.key()] = item.value().detach().clone();
  return out;
}

// What `steps` AdamW steps on the whole batch give on one process (`micro` batches per step).
std::map<std::string, torch::Tensor> reference(int steps, int micro = 1, std::function<void(Tiny&)> change = {}) {
  Tiny net = make_tiny();
  if (change) change(net);
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(0.05));
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    for (int m = 0; m < micro; ++m) {
      auto x = batch() * (1 + 0.5 * (s * micro + m));
      (torch::nn::functional::cross_entropy(net(x), labels()) / micro).backward();
    }
    opt.step();
  }
  return as_map(net->named_parameters());
}

void expect_close(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, value] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_EQ(got.at(name).sizes(), value.sizes()) << name;
    EXPECT_TRUE(torch::allclose(got.at(name), value, 1e-5, 1e-6)) << name << "\n" << got.at(name) << "\n" << value;
  }
}

struct Setting {
  const char* name;
  int ranks;
  FsdpShardingStrategy strategy;
  FsdpAutoWrapPolicy wrap;
};

class FullyShardedTraining : public ::testing::TestWithParam<Setting> {};

TEST_P(FullyShardedTraining, ThreeAdamWStepsEqualTheSingleProcessRun) {
  const auto setting = GetParam();
  const auto expected = reference(3);
  AcceleratorOptions options;
  options.fsdp_plugin = FullyShardedDataParallelPlugin{.sharding_strategy = setting.strategy,
                                                       .auto_wrap_policy = setting.wrap,
                                                       .transformer_cls_names_to_wrap = {"Block"}};
  const int64_t per_rank = kRows / setting.ranks;
  run_accelerators(
      setting.ranks,
      [&](const Accelerator& acc, int rank) {
        Tiny net = make_tiny();
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05)));
        ASSERT_TRUE(model.ddp().is_fully_sharded());
        const size_t units = setting.wrap == FsdpAutoWrapPolicy::kNoWrap ? 1 : 3;
        EXPECT_EQ(detail::fsdp_engine(model.ddp())->unit_names().size(), units);
        for (int s = 0; s < 3; ++s) {
          opt.zero_grad();
          auto x = (batch() * (1 + 0.5 * s)).narrow(0, rank * per_rank, per_rank);
          acc.backward(torch::nn::functional::cross_entropy(model(x), labels().narrow(0, rank * per_rank, per_rank)));
          opt.step();
        }
        expect_close(as_map(acc.get_state_dict(model)), expected);
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, FullyShardedTraining,
    ::testing::Values(Setting{"FullShard2", 2, FsdpShardingStrategy::kFullShard, FsdpAutoWrapPolicy::kNoWrap},
                      Setting{"FullShard2Blocks", 2, FsdpShardingStrategy::kFullShard,
                              FsdpAutoWrapPolicy::kTransformerBasedWrap},
                      Setting{"FullShard4Blocks", 4, FsdpShardingStrategy::kFullShard,
                              FsdpAutoWrapPolicy::kTransformerBasedWrap},
                      Setting{"ShardGradOp2Blocks", 2, FsdpShardingStrategy::kShardGradOp,
                              FsdpAutoWrapPolicy::kTransformerBasedWrap},
                      Setting{"ShardGradOp4", 4, FsdpShardingStrategy::kShardGradOp, FsdpAutoWrapPolicy::kNoWrap},
                      Setting{"NoShard2Blocks", 2, FsdpShardingStrategy::kNoShard,
                              FsdpAutoWrapPolicy::kTransformerBasedWrap},
                      Setting{"NoShard4", 4, FsdpShardingStrategy::kNoShard, FsdpAutoWrapPolicy::kNoWrap}),
    [](const ::testing::TestParamInfo<Setting>& info) { return std::string(info.param.name); });

TEST(FullyShardedDataParallel, ParametersAndAdamWStateHoldOnlyThisProcesssRows) {
  run_accelerators(
      4,
      [](const Accelerator& acc, int rank) {
        Tiny net = make_tiny();
        auto adamw = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05));
        auto [model, opt] = acc.prepare(net, adamw);
        // embed.weight is 6 x 5: pieces of 2 rows, the last process has none.
        EXPECT_EQ(net->embed->weight.sizes(), (rank < 3 ? std::vector<int64_t>{2, 5} : std::vector<int64_t>{0, 5}));
        EXPECT_EQ(net->head->weight.sizes(), (rank < 3 ? std::vector<int64_t>{1, 6} : std::vector<int64_t>{0, 6}));
        EXPECT_EQ(net->scale.sizes(), (rank == 0 ? std::vector<int64_t>{1} : std::vector<int64_t>{0}));
        auto x = batch().narrow(0, rank * 2, 2);
        acc.backward(torch::nn::functional::cross_entropy(model(x), labels().narrow(0, rank * 2, 2)));
        EXPECT_EQ(net->embed->weight.grad().sizes(), net->embed->weight.sizes());
        opt.step();
        auto& state = adamw->state();
        ASSERT_FALSE(state.empty());
        for (const auto& p : net->parameters()) {
          auto it = state.find(detail::compat::optimizer_state_key(p));
          ASSERT_NE(it, state.end());
          auto& adam = static_cast<torch::optim::AdamWParamState&>(*it->second);
          EXPECT_EQ(adam.exp_avg().sizes(), p.sizes());
        }
        int64_t mine = 0;
        for (const auto& p : net->parameters()) mine += p.numel();
        auto total = acc.reduce(torch::tensor({mine}), "sum");
        EXPECT_EQ(total.item<int64_t>(), 36 + 2 * 42 + 21 + 1);  // every parameter once
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{}});
}

TEST(FullyShardedDataParallel, AccumulationOverTwoBatchesEqualsTheSingleProcessRun) {
  const auto expected = reference(2, /*micro=*/2);
  AcceleratorOptions options;
  options.gradient_accumulation_steps = 2;
  options.fsdp_plugin = FullyShardedDataParallelPlugin{.auto_wrap_policy = FsdpAutoWrapPolicy::kTransformerBasedWrap,
                                                       .transformer_cls_names_to_wrap = {"Block"}};
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        Tiny net = make_tiny();
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05)));
        for (int b = 0; b < 4; ++b) {
          auto guard = acc.accumulate(model);
          EXPECT_EQ(acc.sync_gradients(), b % 2 == 1);
          auto x = (batch() * (1 + 0.5 * b)).narrow(0, rank * 4, 4);
          acc.backward(torch::nn::functional::cross_entropy(model(x), labels().narrow(0, rank * 4, 4)));
          if (b == 0) {
            // Nothing reduced yet: the shards have no gradient.
            EXPECT_FALSE(net->embed->weight.grad().defined());
          }
          opt.step();
          opt.zero_grad();
        }
        expect_close(as_map(acc.get_state_dict(model)), expected);
      },
      options);
}

TEST(FullyShardedDataParallel, ClipGradNormClipsByTheNormOverAllShards) {
  Tiny ref = make_tiny();
  torch::nn::functional::cross_entropy(ref(batch()), labels()).backward();
  const double expected_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.01);
  std::map<std::string, torch::Tensor> expected;
  for (const auto& item : ref->named_parameters()) expected[item.key()] = item.value().grad().clone();
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        Tiny net = make_tiny();
        auto model = acc.prepare(net);
        auto x = batch().narrow(0, rank * 4, 4);
        acc.backward(torch::nn::functional::cross_entropy(model(x), labels().narrow(0, rank * 4, 4)));
        const double norm = acc.clip_grad_norm_(net->parameters(), 0.01);
        EXPECT_NEAR(norm, expected_norm, 1e-5);
        // This process's rows of the clipped gradients.
        const auto& want = expected.at("embed.weight");
        EXPECT_TRUE(torch::allclose(net->embed->weight.grad(), want.narrow(0, rank * 3, 3), 1e-5, 1e-7));
        const double inf = acc.clip_grad_norm_(net->parameters(), 1e9, std::numeric_limits<double>::infinity());
        double want_inf = 0;
        for (const auto& [name, g] : expected) want_inf = std::max(want_inf, g.abs().max().item<double>());
        EXPECT_NEAR(inf, want_inf, 1e-6);
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{}});
}

TEST(FullyShardedDataParallel, FrozenParametersStayAsTheyWereAndTheRestTrainsAsOnOneProcess) {
  const auto freeze = [](Tiny& net) { net->embed->bias.set_requires_grad(false); };
  const auto expected = reference(2, 1, freeze);
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        Tiny net = make_tiny();
        freeze(net);
        std::vector<torch::Tensor> trainable;
        for (const auto& p : net->parameters()) {
          if (p.requires_grad()) trainable.push_back(p);
        }
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(trainable, torch::optim::AdamWOptions(0.05)));
        for (int s = 0; s < 2; ++s) {
          opt.zero_grad();
          auto x = (batch() * (1 + 0.5 * s)).narrow(0, rank * 4, 4);
          acc.backward(torch::nn::functional::cross_entropy(model(x), labels().narrow(0, rank * 4, 4)));
          opt.step();
        }
        EXPECT_FALSE(net->embed->bias.grad().defined());
        expect_close(as_map(acc.get_state_dict(model)), expected);
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{}});
}

// A weighted sum that uses its second parameter only when asked to.
struct SometimesImpl : torch::nn::Module {
  explicit SometimesImpl(int64_t numel = 2) {
    w = register_parameter("w", torch::ones({numel}));
    spare = register_parameter("spare", torch::ones({numel}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return use_spare ? (x * w + x * spare).sum() : (x * w).sum(); }
  torch::Tensor w, spare;
  bool use_spare = false;
};
TORCH_MODULE(Sometimes);

// Whether every element of `grad` is `value` (false when there is no gradient).
bool all_equal(const torch::Tensor& grad, float value) {
  return grad.defined() && grad.numel() > 0 && grad.eq(value).all().item<bool>();
}

// Parameters of 2 elements, and of 2^18 + 3 (just over 1 MiB: each is reduced on its own, from the
// buffer lent as its gradient, and its rows do not divide by 2).
class FullyShardedGradients : public ::testing::TestWithParam<int64_t> {};

TEST_P(FullyShardedGradients, AParameterThatTookNoPartInAPassGetsNoGradientAndTheOptimizerLeavesIt) {
  // As under `fully_shard` and on one process, a parameter that no process used in a pass gets
  // no gradient, and AdamW leaves it alone (no decay, no momentum); one that some process used
  // gets the average on every process. (The engine lends every parameter a zeroed gradient
  // buffer before its unit's backward: one that autograd did not add into must not count.)
  const int64_t numel = GetParam();
  std::vector<int> spare_grad(2, -1), w_grad(2, -1), spare_after_step(2, -1), spare_used(2, -1), spare_one(2, -1);
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        Sometimes net(numel);
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.1)));
        const auto before = net->spare.detach().clone();
        const auto x = torch::full({numel}, 3.f);
        acc.backward(model(x));
        w_grad[rank] = all_equal(net->w.grad(), 3.f) ? 1 : 0;
        spare_grad[rank] = net->spare.grad().defined() ? 1 : 0;
        opt.step();
        spare_after_step[rank] = torch::equal(net->spare, before) ? 1 : 0;
        opt.zero_grad();
        net->use_spare = true;  // the next pass does use it
        acc.backward(model(x));
        spare_used[rank] = all_equal(net->spare.grad(), 3.f) ? 1 : 0;
        opt.zero_grad();
        net->use_spare = rank == 0;  // one process uses it: both get the average, (3 + 0) / 2
        acc.backward(model(x));
        spare_one[rank] = all_equal(net->spare.grad(), 1.5f) ? 1 : 0;
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{}});
  EXPECT_EQ(w_grad, std::vector<int>(2, 1)) << "the used parameter's gradient is the average of the processes'";
  EXPECT_EQ(spare_grad, std::vector<int>(2, 0)) << "the unused parameter got a gradient";
  EXPECT_EQ(spare_after_step, std::vector<int>(2, 1)) << "AdamW stepped the unused parameter";
  EXPECT_EQ(spare_used, std::vector<int>(2, 1)) << "its gradient in the pass that used it";
  EXPECT_EQ(spare_one, std::vector<int>(2, 1)) << "used by one process: both processes hold its gradient";
}

TEST_P(FullyShardedGradients, ABackwardThatBuildsAGraphGivesTheSameAveragedGradients) {
  // With create_graph autograd replaces a parameter's `.grad` instead of adding into the buffer
  // the engine lent: the replacement is what gets reduced.
  const int64_t numel = GetParam();
  std::vector<int> w_grad(2, -1), spare_grad(2, -1);
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        Sometimes net(numel);
        net->use_spare = true;
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.1)));
        // Process r's input is r + 1: the average is 1.5 for both parameters.
        model(torch::full({numel}, static_cast<float>(rank + 1))).backward({}, /*retain_graph=*/false, /*create_graph=*/true);
        w_grad[rank] = all_equal(net->w.grad(), 1.5f) ? 1 : 0;
        spare_grad[rank] = all_equal(net->spare.grad(), 1.5f) ? 1 : 0;
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{}});
  EXPECT_EQ(w_grad, std::vector<int>(2, 1));
  EXPECT_EQ(spare_grad, std::vector<int>(2, 1));
}

// Keeps what its parameter's `.grad` is when the backward pass reaches its input: by then autograd
// has added into the buffer the engine lent (Note [Lending gradient buffers]).
struct KeepsGradImpl : torch::nn::Module {
  explicit KeepsGradImpl(int64_t numel) { w = register_parameter("w", torch::ones({numel})); }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = x * 1;
    y.register_hook([this](const torch::Tensor&) { kept = w.grad(); });
    return (w * y).sum();
  }
  torch::Tensor w, kept;
};
TORCH_MODULE(KeepsGrad);

TEST_P(FullyShardedGradients, AGradientAHookKeptIsNotOverwrittenByLaterPasses) {
  // The engine reuses its gradient buffers from pass to pass; one that user code still holds once
  // the pass is reduced must stay the user's, with what it held, while later passes train as usual.
  const int64_t numel = GetParam();
  std::vector<int> kept_unchanged(2, -1), later_grad(2, -1), kept_defined(2, -1);
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        KeepsGrad net(numel);
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1)));
        acc.backward(model(torch::full({numel}, 3.f, torch::requires_grad())));
        const torch::Tensor kept = net->kept;
        net->kept = torch::Tensor();
        kept_defined[rank] = kept.defined() && kept.numel() >= numel ? 1 : 0;
        // Every process runs the later passes (their collectives pair up) whatever the hook saw.
        const torch::Tensor snapshot = kept_defined[rank] ? kept.clone() : torch::Tensor();
        bool averaged = true;
        for (int pass = 0; pass < 3; ++pass) {
          opt.zero_grad();
          // Process r's input is 5 + r + pass: the average is 5.5 + pass.
          acc.backward(model(torch::full({numel}, 5.f + rank + pass, torch::requires_grad())));
          averaged = averaged && all_equal(net->w.grad(), 5.5f + pass);
          net->kept = torch::Tensor();
        }
        later_grad[rank] = averaged ? 1 : 0;
        kept_unchanged[rank] = snapshot.defined() && torch::equal(kept, snapshot) ? 1 : 0;
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{}});
  EXPECT_EQ(kept_defined, std::vector<int>(2, 1)) << "the hook saw no gradient buffer";
  EXPECT_EQ(later_grad, std::vector<int>(2, 1)) << "the later passes' gradients are the processes' average";
  EXPECT_EQ(kept_unchanged, std::vector<int>(2, 1)) << "a later pass wrote into the gradient the hook kept";
}

INSTANTIATE_TEST_SUITE_P(SmallAndLarge, FullyShardedGradients, ::testing::Values(int64_t{2}, (int64_t{1} << 18) + 3));

TEST(FullyShardedDataParallel, AnOptimizerWithStateFromBeforePrepareIsRefusedNamingWhy) {
  // Its moments have the whole parameters' shapes; after prepare the parameters hold shards.
  std::vector<std::string> errors(2);
  const size_t count = make_tiny()->parameters().size();
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        Tiny net = make_tiny();
        auto adamw = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05));
        torch::nn::functional::cross_entropy(net(batch()), labels()).backward();
        adamw->step();
        errors[rank] = error_of([&] { (void)acc.prepare(net, adamw); });
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{}});
  for (const auto& error : errors) {
    EXPECT_THAT(error, ::testing::HasSubstr("the optimizer already holds state for " + std::to_string(count) +
                                            " parameter(s)"));
    EXPECT_THAT(error, ::testing::HasSubstr("create the optimizer's state after prepare"));
  }
}

TEST(FullyShardedDataParallel, EvaluationWithoutGradientsGivesTheWholeModelsOutputAndLeavesShards) {
  Tiny ref = make_tiny();
  torch::NoGradGuard outer;
  const auto expected = ref(batch());
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        Tiny net = make_tiny();
        auto model = acc.prepare(net);
        torch::NoGradGuard no_grad;
        EXPECT_TRUE(torch::allclose(model(batch()), expected, 1e-6, 1e-7));
        EXPECT_EQ(net->blocks->ptr(0)->as<BlockImpl>()->fc->weight.size(0), 3);
        (void)rank;
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{.auto_wrap_policy = FsdpAutoWrapPolicy::kTransformerBasedWrap,
                                                     .transformer_cls_names_to_wrap = {"Block"}}});
}

TEST(FullyShardedDataParallel, ProcessesWithAMetaDeviceModelGetProcessZerosValues) {
  const auto expected = as_map(make_tiny()->named_parameters());
  for (bool with_init_fn : {false, true}) {
    std::atomic<int> initialised{0};
    FullyShardedDataParallelPlugin plugin{.cpu_ram_efficient_loading = true};
    if (with_init_fn) {
      plugin.param_init_fn = [&](torch::nn::Module& m) {
        ++initialised;
        for (const auto& item : m.named_parameters(/*recurse=*/false)) {
          set_module_tensor_to_device(m, item.key(), torch::kCPU, torch::zeros(item.value().sizes()));
        }
      };
    }
    run_accelerators(
        2,
        [&](const Accelerator& acc, int rank) {
          Tiny net = rank == 0 ? make_tiny() : init_empty_weights([] { return Tiny(); });
          auto model = acc.prepare(net);
          expect_close(as_map(acc.get_state_dict(model)), expected);
        },
        {.fsdp_plugin = plugin});
    // Process 1's modules that hold parameters: embed, the two blocks' fc, head, and the root (scale).
    EXPECT_EQ(initialised.load(), with_init_fn ? 5 : 0);
  }
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        Tiny net = rank == 0 ? Tiny() : init_empty_weights([] { return Tiny(); });
        // Process 0 has nothing on the meta device, and fails with its peer instead of waiting for it.
        EXPECT_THROWS_WITH(acc.prepare(net),
                           "process 1: the model has tensors on the meta device: set sync_module_states");
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{.sync_module_states = false}});
  // A param_init_fn that leaves the parameters where they were is named on every process.
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        Tiny net = rank == 0 ? make_tiny() : init_empty_weights([] { return Tiny(); });
        EXPECT_THROWS_WITH(acc.prepare(net), "process 1: param_init_fn left a parameter on the meta device");
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{.sync_module_states = false,
                                                     .param_init_fn = [](torch::nn::Module&) {}}});
}

TEST(FullyShardedDataParallel, WrappingPoliciesChooseTheirUnits) {
  run_accelerators(2, [](const Accelerator& acc, int rank) {
    (void)acc;
    (void)rank;
    const auto units = [&](FullyShardedDataParallelPlugin plugin) {
      Tiny net = make_tiny();
      detail::fsdp::FsdpEngine engine(net.ptr(), acc.state().partial_state(),
                                detail::fsdp::resolve_fsdp_plugin(plugin, torch::kCPU));
      return engine.unit_names();
    };
    using V = std::vector<std::string>;
    EXPECT_EQ(units({}), V{""});
    EXPECT_EQ(units({.auto_wrap_policy = FsdpAutoWrapPolicy::kTransformerBasedWrap,
                     .transformer_cls_names_to_wrap = {"Block"}}),
              (V{"", "blocks.0", "blocks.1"}));
    // 42 parameters per block, 36 in the rest: blocks first (post-order), then what is left is too small.
    EXPECT_EQ(units({.auto_wrap_policy = FsdpAutoWrapPolicy::kSizeBasedWrap, .min_num_params = 40}),
              (V{"", "blocks.0.fc", "blocks.1.fc"}));
    EXPECT_EQ(units({.auto_wrap_callable = [](const std::string& name, const torch::nn::Module&, int64_t) {
                return name == "head";
              }}),
              (V{"", "head"}));
    EXPECT_EQ(units({.auto_wrap_policy = FsdpAutoWrapPolicy::kTransformerBasedWrap,
                     .transformer_cls_names_to_wrap = {"Block"},
                     .ignored_modules = {"blocks.1"}}),
              (V{"", "blocks.0"}));
  });
}

TEST(FullyShardedDataParallel, IgnoredModulesStayWholeAndAreNotReduced) {
  run_accelerators(
      2,
      [](const Accelerator& acc, int rank) {
        Tiny net = make_tiny();
        auto model = acc.prepare(net);
        EXPECT_EQ(net->head->weight.sizes(), (std::vector<int64_t>{3, 6}));
        EXPECT_EQ(net->embed->weight.size(0), 3);
        auto x = batch().narrow(0, rank * 4, 4);
        acc.backward(torch::nn::functional::cross_entropy(model(x), labels().narrow(0, rank * 4, 4)));
        // Each process keeps its own gradient of the ignored module.
        auto all = acc.gather(net->head->weight.grad().reshape({1, -1}).contiguous());
        EXPECT_FALSE(torch::equal(all[0], all[1]));
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{.ignored_modules = {"head"}}});
}

TEST(FullyShardedDataParallel, SaveModelWritesTheWholeModel) {
  TempDir dir;
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        Tiny net = make_tiny();
        auto model = acc.prepare(net);
        (void)rank;
        acc.save_model(model, dir.path().string());
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{}});
  Tiny fresh;
  load_checkpoint_in_model(*fresh, (dir.path() / "model.safetensors").string(), {.strict = true});
  expect_close(as_map(fresh->named_parameters()), as_map(make_tiny()->named_parameters()));
}

TEST(FullyShardedDataParallel, TheLossScalerSkipsTheStepOnEveryProcessWhenOneProcessesRowsOverflow) {
  for (bool shared : {false, true}) {
    std::vector<int> stepped(2, -1);
    run_accelerators(2, [&](const Accelerator& acc, int rank) {
      GradScaler scaler({.init_scale = 8.0});
      if (shared) detail::share_inf_checks(scaler, acc.state().partial_state());
      auto weight = torch::ones({2}, torch::requires_grad());
      torch::optim::SGD sgd({weight}, 0.1);
      // Process 1's rows overflowed; process 0's did not.
      weight.mutable_grad() = rank == 1 ? torch::tensor({1.f, std::numeric_limits<float>::infinity()})
                                        : torch::tensor({1.f, 2.f});
      stepped[rank] = scaler.step(sgd) ? 1 : 0;
      scaler.update();
      EXPECT_EQ(scaler.get_scale(), shared || rank == 1 ? 4.0 : 8.0);
    });
    EXPECT_EQ(stepped, (shared ? std::vector<int>{0, 0} : std::vector<int>{1, 0}));
  }
}

// Two units that share one weight (tied parameters): the shared weight belongs to the root.
struct TiedBlockImpl : torch::nn::Module {
  explicit TiedBlockImpl(torch::Tensor shared) {
    weight = register_parameter("weight", std::move(shared));
    bias = register_parameter("bias", torch::zeros({6}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(torch::nn::functional::linear(x, weight, bias)) + x; }
  torch::Tensor weight, bias;
};
TORCH_MODULE(TiedBlock);

struct TiedImpl : torch::nn::Module {
  TiedImpl() : embed(register_module("embed", torch::nn::Linear(5, 6))), head(register_module("head", torch::nn::Linear(6, 3))) {
    auto shared = torch::linspace(-0.3, 0.3, 36).reshape({6, 6});
    blocks = register_module("blocks", torch::nn::Sequential(TiedBlock(shared), TiedBlock(shared)));
    torch::NoGradGuard no_grad;
    int i = 0;
    for (auto& p : parameters()) p.copy_(torch::linspace(-0.4, 0.6, p.numel()).reshape(p.sizes()) * (1 + 0.1 * i++));
  }
  torch::Tensor forward(const torch::Tensor& x) { return head(accelerate::forward(blocks, embed(x))); }
  torch::nn::Linear embed, head;
  torch::nn::Sequential blocks{nullptr};
};
TORCH_MODULE(Tied);

// Each parameter once (LibTorch's `parameters()` lists a tied one under each of its names).
std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& p : m.parameters()) {
    const bool seen = std::any_of(out.begin(), out.end(), [&](const torch::Tensor& q) { return q.is_same(p); });
    if (!seen) out.push_back(p);
  }
  return out;
}

TEST(FullyShardedDataParallel, AWeightTiedBetweenTwoUnitsTrainsAsOnOneProcessAndStaysTied) {
  Tied single;
  ASSERT_EQ(unique_parameters(*single).size(), 7u) << "the two blocks must share one weight";
  torch::optim::AdamW reference_opt(unique_parameters(*single), torch::optim::AdamWOptions(0.05));
  for (int s = 0; s < 3; ++s) {
    reference_opt.zero_grad();
    torch::nn::functional::cross_entropy(single(batch() * (1 + 0.5 * s)), labels()).backward();
    reference_opt.step();
  }
  const auto expected = as_map(single->named_parameters());
  AcceleratorOptions options;
  options.fsdp_plugin = FullyShardedDataParallelPlugin{.auto_wrap_policy = FsdpAutoWrapPolicy::kTransformerBasedWrap,
                                                       .transformer_cls_names_to_wrap = {"TiedBlock"}};
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        Tied net;
        auto [model, opt] = acc.prepare(
            net, std::make_shared<torch::optim::AdamW>(unique_parameters(*net), torch::optim::AdamWOptions(0.05)));
        EXPECT_EQ(detail::fsdp_engine(model.ddp())->unit_names().size(), 3u);
        for (int s = 0; s < 3; ++s) {
          opt.zero_grad();
          auto x = (batch() * (1 + 0.5 * s)).narrow(0, rank * 4, 4);
          acc.backward(torch::nn::functional::cross_entropy(model(x), labels().narrow(0, rank * 4, 4)));
          opt.step();
        }
        const auto got = as_map(acc.get_state_dict(model));
        expect_close(got, expected);
        // Both names of the tied weight hold the same values after training.
        EXPECT_TRUE(torch::equal(net->blocks[0]->as<TiedBlockImpl>()->weight, net->blocks[1]->as<TiedBlockImpl>()->weight));
      },
      options);
}

// A unit that records the dtypes it computes in.
struct ProbeImpl : torch::nn::Module {
  ProbeImpl() : fc(register_module("fc", torch::nn::Linear(6, 6))) { offset = register_buffer("offset", torch::full({6}, 0.25)); }
  torch::Tensor forward(const torch::Tensor& x) {
    input_dtype = x.scalar_type();
    weight_dtype = fc->weight.scalar_type();
    buffer_dtype = offset.scalar_type();
    return torch::tanh(fc(x)) + x + offset;
  }
  torch::nn::Linear fc;
  torch::Tensor offset;
  c10::ScalarType input_dtype = c10::kLong, weight_dtype = c10::kLong, buffer_dtype = c10::kLong;
};
TORCH_MODULE(Probe);

struct ProbedImpl : torch::nn::Module {
  ProbedImpl()
      : embed(register_module("embed", torch::nn::Linear(5, 6))),
        blocks(register_module("blocks", torch::nn::Sequential(Probe(), Probe()))),
        head(register_module("head", torch::nn::Linear(6, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    root_input_dtype = x.scalar_type();
    return head(accelerate::forward(blocks, embed(x)));
  }
  torch::nn::Linear embed;
  torch::nn::Sequential blocks;
  torch::nn::Linear head;
  c10::ScalarType root_input_dtype = c10::kLong;
};
TORCH_MODULE(Probed);

Probed make_probed() {
  Probed net;
  torch::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : net->parameters()) p.copy_(torch::linspace(-0.4, 0.6, p.numel()).reshape(p.sizes()) * (1 + 0.1 * i++));
  return net;
}

// Three SGD steps of the probed model, on one process or sharded over `ranks`; the whole model after.
std::map<std::string, torch::Tensor> probed_run(int ranks, FullyShardedDataParallelPlugin plugin,
                                                std::function<void(const Accelerator&, Probed&)> check = {}) {
  std::map<std::string, torch::Tensor> out;
  AcceleratorOptions options;
  options.fsdp_plugin = plugin;
  run_accelerators(
      ranks,
      [&](const Accelerator& acc, int rank) {
        Probed net = make_probed();
        auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
        const int64_t per = kRows / ranks;
        for (int s = 0; s < 3; ++s) {
          opt.zero_grad();
          auto x = (batch() * (1 + 0.5 * s)).narrow(0, rank * per, per);
          auto logits = model(x).to(torch::kFloat);
          acc.backward(torch::nn::functional::cross_entropy(logits, labels().narrow(0, rank * per, per)));
          opt.step();
        }
        if (check) check(acc, net);
        auto whole = as_map(acc.get_state_dict(model));
        if (rank == 0) out = whole;
      },
      options);
  return out;
}

TEST(FullyShardedMixedPrecision, UnitsComputeInTheParamDtypeWhileShardsGradientsAndBuffersKeepTheirOwn) {
  const auto fp32 = probed_run(2, {.auto_wrap_policy = FsdpAutoWrapPolicy::kTransformerBasedWrap,
                                   .transformer_cls_names_to_wrap = {"Probe"}});
  for (auto strategy : {FsdpShardingStrategy::kFullShard, FsdpShardingStrategy::kNoShard}) {
    SCOPED_TRACE(to_string(strategy));
    FullyShardedDataParallelPlugin plugin{.sharding_strategy = strategy,
                                          .mixed_precision_policy = {"bf16", "", "bf16"},
                                          .auto_wrap_policy = FsdpAutoWrapPolicy::kTransformerBasedWrap,
                                          .transformer_cls_names_to_wrap = {"Probe"}};
    const auto got = probed_run(2, plugin, [](const Accelerator&, Probed& net) {
      EXPECT_EQ(net->root_input_dtype, c10::kBFloat16) << "the model's call did not cast its input";
      for (const auto& block : *net->blocks) {
        const auto& probe = *block.ptr()->as<ProbeImpl>();
        EXPECT_EQ(probe.input_dtype, c10::kBFloat16);
        EXPECT_EQ(probe.weight_dtype, c10::kBFloat16);
        EXPECT_EQ(probe.buffer_dtype, c10::kBFloat16);
      }
      // At rest: the shards, their gradients (what SGD stepped) and the root's in their own dtype.
      for (const auto& p : net->parameters()) {
        EXPECT_EQ(p.scalar_type(), c10::kFloat);
        EXPECT_EQ(p.grad().scalar_type(), c10::kFloat);
      }
    });
    ASSERT_EQ(got.size(), fp32.size());
    bool all_equal = true;
    for (const auto& [name, value] : fp32) {
      EXPECT_EQ(got.at(name).scalar_type(), c10::kFloat) << name;  // buffers too, as saved
      // bf16 rounds the forward and backward passes; SGD's steps stay close to fp32's.
      EXPECT_TRUE(torch::allclose(got.at(name), value, 0, 2e-2)) << name << "\n" << got.at(name) << "\n" << value;
      all_equal = all_equal && torch::equal(got.at(name), value);
    }
    EXPECT_FALSE(all_equal) << "bf16 computed exactly what fp32 did: the policy had no effect";
  }
}

TEST(FullyShardedMixedPrecision, AReduceDtypeOfFp16OverflowsWhereTheParametersOwnDtypeDoesNot) {
  for (const char* reduce : {"", "fp16"}) {
    std::vector<int> finite(2, -1);
    AcceleratorOptions options;
    options.fsdp_plugin = FullyShardedDataParallelPlugin{.mixed_precision_policy = {.reduce_dtype = reduce}};
    run_accelerators(
        2,
        [&](const Accelerator& acc, int rank) {
          Tiny net = make_tiny();
          auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
          auto x = batch().narrow(0, rank * 4, 4);
          // Gradients of about 1e6: beyond fp16's largest value, 65504.
          acc.backward(1e6 * torch::nn::functional::cross_entropy(model(x), labels().narrow(0, rank * 4, 4)));
          bool ok = true;
          for (const auto& p : net->parameters()) {
            EXPECT_EQ(p.grad().scalar_type(), c10::kFloat);
            ok = ok && torch::isfinite(p.grad()).all().item<bool>();
          }
          finite[rank] = ok ? 1 : 0;
        },
        options);
    EXPECT_EQ(finite, (std::string(reduce).empty() ? std::vector<int>{1, 1} : std::vector<int>{0, 0}))
        << "reduce_dtype \"" << reduce << "\"";
  }
}

// The sum of its weights times its input: the weights' gradient is the input.
struct WeightedSumImpl : torch::nn::Module {
  WeightedSumImpl() { w = register_parameter("w", torch::ones({2})); }
  torch::Tensor forward(const torch::Tensor& x) { return (x * w).sum(); }
  torch::Tensor w;
};
TORCH_MODULE(WeightedSum);

TEST(FullyShardedMixedPrecision, InsideNoSyncGradientsAccumulateInTheReduceDtypeWhenItIsWiderThanTheParamDtype) {
  // Gradients of 256, then 1 four times: bf16 (8 significant bits) cannot hold 257, so summed in
  // bf16 each 1 is rounded away (256), while fp32 sums them (260, which bf16 holds).
  // - param_dtype bf16, reduce_dtype fp32: the passes accumulate in fp32, as `fully_shard` does;
  // - param_dtype bf16, reduce_dtype bf16: in bf16, as upstream's FSDP1 and FSDP2 do;
  // - fp32 parameters reduced in bf16: in fp32, the sum is only cast for the reduction.
  struct Case {
    std::string param, reduce;
    float want;
  };
  for (const auto& c : {Case{"bf16", "fp32", 260}, Case{"bf16", "bf16", 256}, Case{"", "bf16", 260}}) {
    SCOPED_TRACE("param_dtype '" + c.param + "', reduce_dtype " + c.reduce);
    std::vector<float> grads(2, -1);
    AcceleratorOptions options;
    options.fsdp_plugin = FullyShardedDataParallelPlugin{.mixed_precision_policy = {c.param, c.reduce, ""}};
    run_accelerators(
        2,
        [&](const Accelerator& acc, int rank) {
          WeightedSum net;
          auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
          const auto pass = [&](float x) { acc.backward(model(torch::full({2}, x))); };
          {
            auto guard = acc.no_sync(model);
            pass(256);
            pass(1);
            pass(1);
            pass(1);
            EXPECT_FALSE(net->w.grad().defined()) << "a pass inside no_sync reduced";
          }
          pass(1);
          ASSERT_EQ(net->w.grad().numel(), 1);
          EXPECT_EQ(net->w.grad().scalar_type(), c10::kFloat);
          grads[rank] = net->w.grad().item<float>();
        },
        options);
    EXPECT_EQ(grads, std::vector<float>(2, c.want));
  }
}

TEST(FullyShardedMixedPrecision, AnFp16ReductionOfGradientsThatFitDoesNotOverflowInTheSum) {
  // 40000 and 49984 are fp16 values (below 65504), their sum is not: summed first and divided
  // afterwards the mean would be inf. Divided by 2 before the sum, it is exact: 44992.
  std::vector<float> grads(2, -1);
  AcceleratorOptions options;
  options.fsdp_plugin = FullyShardedDataParallelPlugin{.mixed_precision_policy = {"", "fp16", ""}};
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        WeightedSum net;
        auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
        acc.backward(model(torch::full({2}, rank == 0 ? 40000.f : 49984.f)));
        ASSERT_EQ(net->w.grad().numel(), 1);
        grads[rank] = net->w.grad().item<float>();
      },
      options);
  EXPECT_EQ(grads, std::vector<float>(2, 44992.f));
}

TEST(FullyShardedMixedPrecision, TheAcceleratorsMixedPrecisionFillsAnEmptyPolicyAndLeavesAGivenOne) {
  std::vector<FsdpMixedPrecisionPolicy> seen(2);
  for (bool given : {false, true}) {
    AcceleratorOptions options;
    options.mixed_precision = "bf16";
    options.fsdp_plugin = FullyShardedDataParallelPlugin{};
    if (given) options.fsdp_plugin->mixed_precision_policy.param_dtype = "fp32";
    run_accelerators(
        2, [&](const Accelerator& acc, int rank) { seen[rank] = acc.fsdp_plugin()->mixed_precision_policy; },
        options);
    for (const auto& policy : seen) {
      EXPECT_EQ(policy.param_dtype, given ? "fp32" : "bf16");
      EXPECT_EQ(policy.reduce_dtype, given ? "" : "bf16");
      EXPECT_EQ(policy.buffer_dtype, given ? "" : "bf16");
    }
  }
}

TEST(FullyShardedDataParallel, ParsesUpstreamsSpellingsAndNumbers) {
  EXPECT_EQ(parse_fsdp_sharding_strategy("full_shard"), FsdpShardingStrategy::kFullShard);
  EXPECT_EQ(parse_fsdp_sharding_strategy("2"), FsdpShardingStrategy::kShardGradOp);
  EXPECT_EQ(parse_fsdp_sharding_strategy("NO_SHARD"), FsdpShardingStrategy::kNoShard);
  EXPECT_EQ(to_string(FsdpShardingStrategy::kHybridShardZero2), "_HYBRID_SHARD_ZERO2");
  EXPECT_EQ(parse_fsdp_state_dict_type("3"), FsdpStateDictType::kShardedStateDict);
  EXPECT_EQ(parse_fsdp_auto_wrap_policy("transformer_based_wrap"), FsdpAutoWrapPolicy::kTransformerBasedWrap);
  EXPECT_EQ(parse_fsdp_backward_prefetch("NO_PREFETCH"), FsdpBackwardPrefetch::kNoPrefetch);
  EXPECT_THROWS_WITH(parse_fsdp_sharding_strategy("6"), "expected one of FULL_SHARD");
  EXPECT_THROWS_WITH(parse_fsdp_auto_wrap_policy("1"), "got '1'");
}

TEST(FullyShardedDataParallel, TheEnvironmentFillsTheFieldsLeftEmpty) {
  auto env = patch_environment({{"FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP"},
                                {"FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP"},
                                {"FSDP_TRANSFORMER_CLS_TO_WRAP", "Block, Other"},
                                {"FSDP_VERSION", "2"}});
  auto s = detail::fsdp::resolve_fsdp_plugin({}, torch::kCPU);
  EXPECT_EQ(s.sharding_strategy, FsdpShardingStrategy::kShardGradOp);
  EXPECT_FALSE(s.reshard_after_forward);
  EXPECT_EQ(s.fsdp_version, 2);
  EXPECT_EQ(s.transformer_cls_names_to_wrap, (std::vector<std::string>{"Block", "Other"}));
  // What the user set wins over the environment.
  auto given = detail::fsdp::resolve_fsdp_plugin({.reshard_after_forward = true, .auto_wrap_policy = FsdpAutoWrapPolicy::kNoWrap},
                                           torch::kCPU);
  EXPECT_EQ(given.sharding_strategy, FsdpShardingStrategy::kFullShard);
  EXPECT_EQ(given.auto_wrap_policy, FsdpAutoWrapPolicy::kNoWrap);
}

TEST(FullyShardedDataParallel, UseFsdpInTheEnvironmentShardsPreparedModels) {
  auto env = patch_environment({{"ACCELERATE_USE_FSDP", "true"}, {"FSDP_RESHARD_AFTER_FORWARD", "false"}});
  run_accelerators(2, [](const Accelerator& acc, int rank) {
    (void)rank;
    ASSERT_TRUE(acc.fsdp_plugin().has_value());
    auto model = acc.prepare(make_tiny());
    EXPECT_TRUE(model.ddp().is_fully_sharded());
    EXPECT_EQ(detail::fsdp_engine(model.ddp())->settings().sharding_strategy, FsdpShardingStrategy::kShardGradOp);
  });
}

TEST(FullyShardedDataParallel, UnsupportedOrContradictorySettingsAreRefusedByName) {
  const auto refuse = [](FullyShardedDataParallelPlugin plugin, const std::string& message) {
    EXPECT_THROWS_WITH(detail::fsdp::resolve_fsdp_plugin(plugin, torch::kCPU), message);
  };
  refuse({.fsdp_version = 3}, "fsdp_version must be 1 or 2, got 3");
  refuse({.sharding_strategy = FsdpShardingStrategy::kFullShard, .reshard_after_forward = false}, "contradict");
  refuse({.mixed_precision_policy = {.reduce_dtype = "int8"}},
         "mixed_precision_policy.reduce_dtype must be one of fp32, bf16, fp16 or fp64 (or empty for the "
         "parameters' own dtype), got \"int8\"");
  refuse({.auto_wrap_policy = FsdpAutoWrapPolicy::kTransformerBasedWrap}, "needs transformer_cls_names_to_wrap");
  refuse({.min_num_params = 0}, "min_num_params must be positive");
  refuse({.sync_module_states = false, .cpu_ram_efficient_loading = true}, "needs sync_module_states");
  refuse({.use_orig_params = false}, "use_orig_params=false");
  refuse({.auto_wrap_policy = FsdpAutoWrapPolicy::kNoWrap,
          .auto_wrap_callable = [](const std::string&, const torch::nn::Module&, int64_t) { return false; }},
         "give either auto_wrap_policy or auto_wrap_callable, not both");
  // cpu_offload applies on every device (Note [Offloading to the CPU]); on the CPU it moves nothing.
  for (const auto& device : {c10::Device(c10::kCUDA, 0), c10::Device(c10::kCPU)}) {
    EXPECT_TRUE(detail::fsdp::resolve_fsdp_plugin({.cpu_offload = true}, device).cpu_offload) << device;
  }
}

TEST(FullyShardedDataParallel, LimitAllGathersOffAndRank0OnlyOfAShardedStateAreRefused) {
  EXPECT_THROWS_WITH(detail::fsdp::resolve_fsdp_plugin({.limit_all_gathers = false}, torch::kCPU),
                     "limit_all_gathers=false (any number of gathers ahead of their units) is not supported");
  {
    auto env = patch_environment({{"FSDP_LIMIT_ALL_GATHERS", "false"}});
    EXPECT_THROWS_WITH(detail::fsdp::resolve_fsdp_plugin({}, torch::kCPU), "limit_all_gathers=false");
  }
  EXPECT_THROWS_WITH(detail::fsdp::resolve_fsdp_plugin({.state_dict_type = FsdpStateDictType::kShardedStateDict,
                                                        .optim_state_dict_config = FsdpStateDictConfig{.rank0_only = true}},
                                                       torch::kCPU),
                     "optim_state_dict_config.rank0_only applies to FULL_STATE_DICT only");
}

TEST(FullyShardedPluginSetters, SetStateDictTypeFillsTheTypeAndUpstreamsConfigs) {
  FullyShardedDataParallelPlugin plugin;
  plugin.set_state_dict_type();
  EXPECT_EQ(plugin.state_dict_type, FsdpStateDictType::kFullStateDict);
  EXPECT_TRUE(plugin.state_dict_config->offload_to_cpu && plugin.state_dict_config->rank0_only);
  EXPECT_TRUE(plugin.optim_state_dict_config->offload_to_cpu && plugin.optim_state_dict_config->rank0_only);
  {
    auto env = patch_environment({{"FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"}});
    FullyShardedDataParallelPlugin from_env;
    from_env.set_state_dict_type();
    EXPECT_EQ(from_env.state_dict_type, FsdpStateDictType::kShardedStateDict);
    EXPECT_TRUE(from_env.state_dict_config->offload_to_cpu);
    EXPECT_FALSE(from_env.state_dict_config->rank0_only);
  }
  // The argument wins (train sharded, save full); configs already set stay.
  FullyShardedDataParallelPlugin given{.state_dict_type = FsdpStateDictType::kShardedStateDict,
                                       .state_dict_config = FsdpStateDictConfig{.offload_to_cpu = false}};
  given.set_state_dict_type(FsdpStateDictType::kFullStateDict);
  EXPECT_EQ(given.state_dict_type, FsdpStateDictType::kFullStateDict);
  EXPECT_FALSE(given.state_dict_config->offload_to_cpu);
  EXPECT_FALSE(given.state_dict_config->rank0_only);
  EXPECT_TRUE(given.optim_state_dict_config->rank0_only);
}

TEST(FullyShardedPluginSetters, SetMixedPrecisionFillsAnEmptyPolicyAndKeepsAGivenOneUnlessOverridden) {
  FullyShardedDataParallelPlugin plugin;
  plugin.set_mixed_precision("bf16");
  EXPECT_EQ(plugin.mixed_precision_policy.param_dtype, "bf16");
  EXPECT_EQ(plugin.mixed_precision_policy.reduce_dtype, "bf16");
  EXPECT_EQ(plugin.mixed_precision_policy.buffer_dtype, "bf16");
  plugin.set_mixed_precision("fp16");
  EXPECT_EQ(plugin.mixed_precision_policy.param_dtype, "bf16") << "a policy already set is kept";
  plugin.set_mixed_precision("fp16", /*buffer_autocast=*/true, /*override=*/true);
  EXPECT_EQ(plugin.mixed_precision_policy.param_dtype, "fp16");
  EXPECT_EQ(plugin.mixed_precision_policy.buffer_dtype, "fp32");
  FullyShardedDataParallelPlugin v2{.fsdp_version = 2};
  v2.set_mixed_precision("bf16");
  EXPECT_EQ(v2.mixed_precision_policy.buffer_dtype, "") << "version 2's policy has no buffer dtype";
  EXPECT_THROWS_WITH(v2.set_mixed_precision("int8", false, true), "invalid mixed precision \"int8\"");
  EXPECT_THROWS_WITH(v2.set_mixed_precision("fp8", false, true), "fp8 is not available");
  // What resolving reads is what the setter wrote.
  EXPECT_EQ(detail::fsdp::resolve_fsdp_plugin(plugin, torch::kCPU).param_dtype, c10::optional<at::ScalarType>(at::kHalf));
  FullyShardedDataParallelPlugin bad{.mixed_precision_policy = {.buffer_dtype = "int4"}};
  EXPECT_THROWS_WITH(bad.validate_mixed_precision_policy(), "mixed_precision_policy.buffer_dtype must be one of");
  plugin.validate_mixed_precision_policy();
}

TEST(FullyShardedPluginSetters, SetAutoWrapPolicyMakesTheNamedPolicyACallableForTheModel) {
  run_accelerators(2, [](const Accelerator& acc, int) {
    const auto units = [&](const FullyShardedDataParallelPlugin& plugin) {
      Tiny net = make_tiny();
      detail::fsdp::FsdpEngine engine(net.ptr(), acc.state().partial_state(),
                                      detail::fsdp::resolve_fsdp_plugin(plugin, torch::kCPU));
      return engine.unit_names();
    };
    using V = std::vector<std::string>;
    FullyShardedDataParallelPlugin by_class{.auto_wrap_policy = FsdpAutoWrapPolicy::kTransformerBasedWrap,
                                            .transformer_cls_names_to_wrap = {"Block"}};
    by_class.set_auto_wrap_policy(*make_tiny());
    EXPECT_FALSE(by_class.auto_wrap_policy.has_value());
    ASSERT_TRUE(static_cast<bool>(by_class.auto_wrap_callable));
    EXPECT_EQ(units(by_class), (V{"", "blocks.0", "blocks.1"}));
    FullyShardedDataParallelPlugin by_size{.auto_wrap_policy = FsdpAutoWrapPolicy::kSizeBasedWrap, .min_num_params = 40};
    by_size.set_auto_wrap_policy(*make_tiny());
    EXPECT_EQ(units(by_size), (V{"", "blocks.0.fc", "blocks.1.fc"}));
    FullyShardedDataParallelPlugin none{.auto_wrap_policy = FsdpAutoWrapPolicy::kSizeBasedWrap, .min_num_params = 0};
    none.set_auto_wrap_policy(*make_tiny());
    EXPECT_EQ(none.auto_wrap_policy, FsdpAutoWrapPolicy::kNoWrap) << "0 drops the policy, as upstream";
    EXPECT_EQ(units(none), V{""});
  });
  FullyShardedDataParallelPlugin missing{.auto_wrap_policy = FsdpAutoWrapPolicy::kTransformerBasedWrap,
                                         .transformer_cls_names_to_wrap = {"Block", "Nope"}};
  EXPECT_THROWS_WITH(missing.set_auto_wrap_policy(*make_tiny()),
                     "could not find the transformer layer class Nope in the model");
  // prepare checks the classes too, before it changes anything.
  EXPECT_THROWS_WITH(run_accelerators(2, [](const Accelerator& acc, int) { (void)acc.prepare(make_tiny()); },
                                      AcceleratorOptions{.fsdp_plugin = missing}),
                     "could not find the transformer layer class Nope");
}

TEST(FullyShardedDataParallel, ParallelismConfigSizesAreCheckedAgainstTheProcesses) {
  const auto refused = [](ParallelismConfig config, const std::string& message) {
    Store store = Store::in_memory();
    run_threads(2, [&](int rank) {
      AcceleratorOptions options;
      options.parallelism_config = config;
      options.standalone_state = rank_options(PartialStateOptions{}, rank, 2, store);
      EXPECT_THROWS_WITH((void)Accelerator(options), message);
    });
  };
  refused({.tp_size = 3}, "x tp_size (3) x cp_size (1) must equal the number of processes, 2");
  refused({.cp_size = 4}, "x tp_size (1) x cp_size (4) must equal the number of processes, 2");
  refused({.dp_replicate_size = 2, .dp_shard_size = 2}, "must equal the number of processes, 2");
  run_accelerators(
      2, [](const Accelerator& acc, int) { EXPECT_TRUE(acc.fsdp_plugin().has_value()); },
      {.parallelism_config = ParallelismConfig{.dp_shard_size = 2}});
  run_accelerators(
      2, [](const Accelerator& acc, int) { EXPECT_FALSE(acc.fsdp_plugin().has_value()); },
      {.parallelism_config = ParallelismConfig{.dp_replicate_size = 2}});
}

TEST(FullyShardedDataParallel, JoinUnevenInputsRunsTheBodyWithoutJoiningAndSaysSoAsUpstream) {
  CapturedLines captured;
  std::atomic<int> ran{0};
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        auto model = acc.prepare(make_tiny());
        const int got = acc.join_uneven_inputs({model.ddp()}, [&] { return ++ran; }, /*even_batches=*/false);
        EXPECT_GE(got, 1);
        (void)rank;
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{}});
  EXPECT_EQ(ran.load(), 2);
  bool warned = false;
  for (const auto& line : captured.lines()) {
    warned = warned || line.find("with fully sharded models it has no effect") != std::string::npos;
  }
  EXPECT_TRUE(warned);
}

TEST(FullyShardedDataParallel, AnIgnoredModuleThatIsNotInTheModelAndJoiningAreRefused) {
  run_accelerators(
      2,
      [](const Accelerator& acc, int) {
        EXPECT_THROWS_WITH(acc.prepare(make_tiny()), "ignored_modules names 'blocks.9', which is not a submodule");
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{.ignored_modules = {"blocks.9"}}});
  run_accelerators(
      2,
      [](const Accelerator& acc, int) {
        auto model = acc.prepare(make_tiny());
        EXPECT_THROWS_WITH(model.ddp().join([] {}), "joining uneven inputs is not supported for fully sharded models");
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{}});
}

TEST(FullyShardedDataParallel, ANullModuleOrANegativeShardSizeIsRefused) {
  run_accelerators(
      2,
      [](const Accelerator& acc, int) {
        const PartialState& state = acc.state().partial_state();
        EXPECT_THROWS_WITH(DistributedDataParallel::fully_sharded(make_tiny().ptr(), state, {}, {}, -2),
                           "dp_shard_size must not be negative, got -2");
        EXPECT_THROWS_WITH(DistributedDataParallel::fully_sharded(nullptr, state, {}), "expected a module, got null");
        EXPECT_THROWS_WITH(DistributedDataParallel::fully_sharded(make_tiny().ptr(), state, {}, {}, 3),
                           "dp_shard_size 3 does not divide the number of processes, 2");
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{}});
}

TEST(FullyShardedDataParallel, APluginWithNothingToShardIsRefused) {
  Store store = Store::in_memory();
  run_threads(2, [&](int rank) {
    AcceleratorOptions options;
    options.fsdp_plugin = FullyShardedDataParallelPlugin{};
    options.parallelism_config = ParallelismConfig{.dp_replicate_size = 2};
    options.standalone_state = rank_options(PartialStateOptions{}, rank, 2, store);
    EXPECT_THROWS_WITH((void)Accelerator(options),
                       "dp_shard_size and cp_size are 1, so nothing is sharded, but an fsdp_plugin was given");
  });
}

TEST(FullyShardedDataParallel, DifferentModelsOnTheProcessesAreRefusedNamingTheFirstDifference) {
  run_accelerators(
      2,
      [](const Accelerator& acc, int rank) {
        if (rank == 0) {
          EXPECT_THROWS_WITH(acc.prepare(make_tiny()), "every process must prepare the same model");
        } else {
          EXPECT_THROWS_WITH(acc.prepare(torch::nn::Linear(5, 6)), "every process must prepare the same model");
        }
      },
      {.fsdp_plugin = FullyShardedDataParallelPlugin{}});
}

// AdamW steps [first, last) of the whole-batch run, each process on its rows.
template <typename Model, typename Optimizer>
void train_steps(const Accelerator& acc, Model& model, Optimizer& opt, int first, int last) {
  const int64_t per = kRows / acc.num_processes(), rank = acc.process_index();
  for (int s = first; s < last; ++s) {
    opt.zero_grad();
    auto x = (batch() * (1 + 0.5 * s)).narrow(0, rank * per, per);
    acc.backward(torch::nn::functional::cross_entropy(model(x), labels().narrow(0, rank * per, per)));
    opt.step();
  }
}

AcceleratorOptions sharded_with(FsdpStateDictType type) {
  AcceleratorOptions options;
  options.fsdp_plugin = FullyShardedDataParallelPlugin{.auto_wrap_policy = FsdpAutoWrapPolicy::kTransformerBasedWrap,
                                                       .transformer_cls_names_to_wrap = {"Block"},
                                                       .state_dict_type = type};
  return options;
}

// Saves after 2 of 4 steps with `save_ranks` processes, resumes with `load_ranks`; returns the
// whole model after the resumed run, and (through `uninterrupted`) after 4 steps without a break.
std::map<std::string, torch::Tensor> save_and_resume(const AcceleratorOptions& save_options, int save_ranks,
                                                     const AcceleratorOptions& load_options, int load_ranks,
                                                     const std::string& folder,
                                                     std::map<std::string, torch::Tensor>* uninterrupted = nullptr,
                                                     std::map<std::string, torch::Tensor>* at_save = nullptr) {
  run_accelerators(
      save_ranks,
      [&](const Accelerator& acc, int) {
        Tiny net = make_tiny();
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05)));
        train_steps(acc, model, opt, 0, 2);
        acc.save_state(folder);
        auto saved = as_map(acc.get_state_dict(model));
        if (at_save && acc.is_main_process()) *at_save = saved;
        train_steps(acc, model, opt, 2, 4);
        auto whole = as_map(acc.get_state_dict(model));
        if (uninterrupted && acc.is_main_process()) *uninterrupted = whole;
      },
      save_options);
  std::map<std::string, torch::Tensor> resumed;
  run_accelerators(
      load_ranks,
      [&](const Accelerator& acc, int) {
        Tiny net;  // other values than the checkpoint's, on purpose
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05)));
        acc.load_state(folder);
        train_steps(acc, model, opt, 2, 4);
        auto whole = as_map(acc.get_state_dict(model));
        if (acc.is_main_process()) resumed = whole;
      },
      load_options);
  return resumed;
}

std::map<std::string, torch::Tensor> save_and_resume(FsdpStateDictType save_type, int save_ranks,
                                                     FsdpStateDictType load_type, int load_ranks,
                                                     const std::string& folder,
                                                     std::map<std::string, torch::Tensor>* uninterrupted = nullptr,
                                                     std::map<std::string, torch::Tensor>* at_save = nullptr) {
  return save_and_resume(sharded_with(save_type), save_ranks, sharded_with(load_type), load_ranks, folder,
                         uninterrupted, at_save);
}

void expect_equal(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, value] : want) EXPECT_TRUE(torch::equal(got.at(name), value)) << name;
}

TEST(FullyShardedCheckpoint, AFullStateResumesBitForBitAtTheSameNumberOfProcesses) {
  TempDir dir;
  std::map<std::string, torch::Tensor> uninterrupted;
  const auto resumed = save_and_resume(FsdpStateDictType::kFullStateDict, 2, FsdpStateDictType::kFullStateDict, 2,
                                       (dir.path() / "c").string(), &uninterrupted);
  expect_equal(resumed, uninterrupted);
  // The whole model and optimizer, as a DDP job writes them.
  EXPECT_TRUE(std::filesystem::is_regular_file(dir.path() / "c" / "model.safetensors"));
  EXPECT_TRUE(std::filesystem::is_regular_file(dir.path() / "c" / "optimizer.safetensors"));
  Tiny whole;
  load_checkpoint_in_model(*whole, (dir.path() / "c" / "model.safetensors").string(), {.strict = true});
  EXPECT_EQ(whole->embed->weight.sizes(), (std::vector<int64_t>{6, 5}));
}

TEST(FullyShardedCheckpoint, Rank0OnlyLeavesTheWholeTensorsWithTheWritingProcessOnly) {
  const size_t whole = make_tiny()->named_parameters().size() + make_tiny()->named_buffers().size();
  const auto saved_sizes = [&](std::optional<FsdpStateDictConfig> config, const std::string& folder) {
    std::vector<size_t> sizes(2, 99);
    auto options = sharded_with(FsdpStateDictType::kFullStateDict);
    options.fsdp_plugin->state_dict_config = config;
    run_accelerators(
        2,
        [&](const Accelerator& acc, int rank) {
          Tiny net = make_tiny();
          auto [model, opt] =
              acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05)));
          train_steps(acc, model, opt, 0, 1);
          auto handle = acc.register_save_state_pre_hook(
              [&](const std::vector<DistributedDataParallel>&, std::vector<StateDictMap>& weights, const std::string&) {
                sizes[rank] = weights.at(0).size();
              });
          acc.save_state(folder);
          EXPECT_EQ(acc.get_state_dict(model).size(), whole) << "get_state_dict gives every process the whole model";
        },
        options);
    return sizes;
  };
  TempDir dir;
  // Upstream's default for FULL_STATE_DICT: rank0_only.
  EXPECT_EQ(saved_sizes(std::nullopt, (dir.path() / "a").string()), (std::vector<size_t>{whole, 0}));
  EXPECT_EQ(saved_sizes(FsdpStateDictConfig{.offload_to_cpu = true, .rank0_only = false}, (dir.path() / "b").string()),
            (std::vector<size_t>{whole, whole}));
  for (const auto* name : {"a", "b"}) {
    Tiny whole;
    load_checkpoint_in_model(*whole, (dir.path() / name / "model.safetensors").string(), {.strict = true});
  }
}

TEST(FullyShardedCheckpoint, AShardedStateResumesBitForBitAtTheSameNumberOfProcesses) {
  TempDir dir;
  std::map<std::string, torch::Tensor> uninterrupted, at_save;
  const auto resumed = save_and_resume(FsdpStateDictType::kShardedStateDict, 2, FsdpStateDictType::kShardedStateDict,
                                       2, (dir.path() / "c").string(), &uninterrupted, &at_save);
  expect_equal(resumed, uninterrupted);
  // merge-weights joins the shards into the whole model as it was saved.
  const auto merged = commands::merge_weights((dir.path() / "c").string(), (dir.path() / "merged").string());
  Tiny whole;
  load_checkpoint_in_model(*whole, merged, {.strict = true});
  expect_equal(as_map(whole->named_parameters()), at_save);
  const auto folder = dir.path() / "c";
  for (const char* name : {"pytorch_model_fsdp_0/index.json", "pytorch_model_fsdp_0/shard-0-of-2.safetensors",
                           "pytorch_model_fsdp_0/shard-1-of-2.safetensors", "optimizer_0/index.json",
                           "optimizer_0/shard-1-of-2.safetensors"}) {
    EXPECT_TRUE(std::filesystem::is_regular_file(folder / name)) << name;
  }
  EXPECT_FALSE(std::filesystem::exists(folder / "model.safetensors"));
  // Each file holds its process's rows.
  SafetensorsFile shard((folder / "pytorch_model_fsdp_0" / "shard-1-of-2.safetensors").string());
  EXPECT_EQ(shard.get_tensor("embed.weight").sizes(), (std::vector<int64_t>{3, 5}));
}

TEST(FullyShardedCheckpoint, AShardedStateReshardsOntoAnotherNumberOfProcesses) {
  const auto expected = reference(4);
  for (auto [from, to] : {std::pair{4, 2}, std::pair{2, 4}}) {
    TempDir dir;
    const auto resumed = save_and_resume(FsdpStateDictType::kShardedStateDict, from,
                                         FsdpStateDictType::kShardedStateDict, to, (dir.path() / "c").string());
    expect_close(resumed, expected);
  }
}

TEST(FullyShardedCheckpoint, AFullStateLoadsIntoAnotherNumberOfProcessesAndAnotherStateDictType) {
  TempDir dir;
  const auto resumed = save_and_resume(FsdpStateDictType::kFullStateDict, 2, FsdpStateDictType::kShardedStateDict, 4,
                                       (dir.path() / "c").string());
  expect_close(resumed, reference(4));
}

TEST(FullyShardedCheckpoint, AMissingShardOrABrokenIndexIsNamedWhenLoadingAndMerging) {
  TempDir dir;
  const auto folder = (dir.path() / "c").string();
  run_accelerators(
      2,
      [&](const Accelerator& acc, int) {
        auto model = acc.prepare(make_tiny());
        acc.save_state(folder);
      },
      sharded_with(FsdpStateDictType::kShardedStateDict));
  const auto load_on_four = [&](const std::string& message) {
    run_accelerators(
        4,
        [&](const Accelerator& acc, int) {
          auto model = acc.prepare(make_tiny());
          EXPECT_THROWS_WITH(acc.load_state(folder), message);
        },
        sharded_with(FsdpStateDictType::kShardedStateDict));
  };
  const auto model_folder = dir.path() / "c" / "pytorch_model_fsdp_0";
  std::filesystem::rename(model_folder / "shard-1-of-2.safetensors", dir.path() / "kept.safetensors");
  load_on_four("has no shard-1-of-2.safetensors (saved by 2 processes)");
  EXPECT_THROWS_WITH(commands::merge_weights(model_folder.string(), (dir.path() / "out").string()),
                     "has no shard-1-of-2.safetensors (saved by 2 processes)");
  std::filesystem::rename(dir.path() / "kept.safetensors", model_folder / "shard-1-of-2.safetensors");
  save_state_dict_file({{{"format", "something else"}}, {}}, (model_folder / "index.json").string());
  load_on_four("index.json is not the index of a sharded state");
}

TEST(FullyShardedCheckpoint, ALocalStateOnlyLoadsOnAsManyProcesses) {
  TempDir dir;
  std::map<std::string, torch::Tensor> uninterrupted;
  const auto resumed = save_and_resume(FsdpStateDictType::kLocalStateDict, 2, FsdpStateDictType::kLocalStateDict, 2,
                                       (dir.path() / "c").string(), &uninterrupted);
  expect_equal(resumed, uninterrupted);
  EXPECT_THROWS_WITH(save_and_resume(FsdpStateDictType::kLocalStateDict, 2, FsdpStateDictType::kLocalStateDict, 4,
                                     (dir.path() / "d").string()),
                     "was saved by 2 processes as a LOCAL_STATE_DICT, which only loads on as many; this job has 4");
}

TEST(FullyShardedDataParallel, PrefetchingGathersTheNextUnitAheadAndTrainsAsWithout) {
  const auto expected = reference(3);
  struct Case {
    FsdpBackwardPrefetch backward;
    bool forward;
  };
  for (const auto& c : {Case{FsdpBackwardPrefetch::kBackwardPre, false}, Case{FsdpBackwardPrefetch::kBackwardPost, false},
                        Case{FsdpBackwardPrefetch::kNoPrefetch, true}, Case{FsdpBackwardPrefetch::kBackwardPre, true}}) {
    SCOPED_TRACE(to_string(c.backward) + (c.forward ? " with forward_prefetch" : ""));
    AcceleratorOptions options = sharded_with(FsdpStateDictType::kFullStateDict);
    options.fsdp_plugin->backward_prefetch = c.backward;
    options.fsdp_plugin->forward_prefetch = c.forward;
    run_accelerators(
        2,
        [&](const Accelerator& acc, int) {
          Tiny net = make_tiny();
          auto [model, opt] = acc.prepare(
              net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05)));
          train_steps(acc, model, opt, 0, 3);
          // Two blocks: in each forward after the first, block 0 starts block 1's gather; in each
          // backward, block 1 starts block 0's.
          const auto [forward, backward] = detail::fsdp_engine(model.ddp())->prefetch_counts();
          EXPECT_EQ(forward, c.forward ? 2 : 0);
          EXPECT_EQ(backward, c.backward == FsdpBackwardPrefetch::kNoPrefetch ? 0 : 3);
          expect_close(as_map(acc.get_state_dict(model)), expected);
        },
        options);
  }
}

TEST(FullyShardedDataParallel, ActivationCheckpointingRunsEachUnitAgainInTheBackwardAndTrainsAsWithout) {
  const auto expected = reference(3);
  for (const auto strategy : {FsdpShardingStrategy::kFullShard, FsdpShardingStrategy::kShardGradOp}) {
    SCOPED_TRACE(to_string(strategy));
    AcceleratorOptions options = sharded_with(FsdpStateDictType::kFullStateDict);
    options.fsdp_plugin->sharding_strategy = strategy;
    options.fsdp_plugin->activation_checkpointing = true;
    options.fsdp_plugin->backward_prefetch = FsdpBackwardPrefetch::kBackwardPre;
    options.fsdp_plugin->forward_prefetch = true;
    run_accelerators(
        2,
        [&](const Accelerator& acc, int) {
          Tiny net = make_tiny();
          auto [model, opt] = acc.prepare(
              net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05)));
          block_forwards = 0;
          train_steps(acc, model, opt, 0, 3);
          EXPECT_EQ(block_forwards, 2 * 2 * 3) << "two blocks, each run twice a step, for three steps";
          // The recomputations are not forwards: prefetching follows the forward order as without
          // (SHARD_GRAD_OP keeps the units whole from forward to backward: nothing to prefetch).
          const auto [forward, backward] = detail::fsdp_engine(model.ddp())->prefetch_counts();
          EXPECT_EQ(forward, 2);
          EXPECT_EQ(backward, strategy == FsdpShardingStrategy::kFullShard ? 3 : 0) << to_string(strategy);
          expect_close(as_map(acc.get_state_dict(model)), expected);
          // Evaluation records no gradient, so nothing runs twice.
          block_forwards = 0;
          torch::NoGradGuard no_grad;
          (void)model(batch());
          EXPECT_EQ(block_forwards, 2);
        },
        options);
  }
}

TEST(FullyShardedDataParallel, ActivationCheckpointingWithoutWrappedUnitsIsRefused) {
  AcceleratorOptions options;
  options.fsdp_plugin = FullyShardedDataParallelPlugin{.activation_checkpointing = true};
  run_accelerators(
      2,
      [&](const Accelerator& acc, int) {
        EXPECT_THROWS_WITH((void)acc.prepare(make_tiny()),
                           "activation_checkpointing recomputes the forward of each unit that auto_wrap_policy "
                           "wraps, and the policy wraps no submodule of this model (auto_wrap_policy NO_WRAP)");
      },
      options);
}

// ---- Hybrid sharding ---------------------------------------------------------------------------

AcceleratorOptions hybrid_2x2(FsdpStateDictType type = FsdpStateDictType::kFullStateDict) {
  AcceleratorOptions options = sharded_with(type);
  options.parallelism_config = ParallelismConfig{.dp_replicate_size = 2, .dp_shard_size = 2};
  return options;
}

// A module as every LibTorch example writes it: children called directly (`fc(x)`). `Holder` is
// torch::nn::Linear, or accelerate::nn::Linear whose call runs the unit's hook.
template <typename Holder>
struct DirectMlpImpl : torch::nn::Module {
  DirectMlpImpl()
      : fc1(register_module("fc1", Holder(5, 16))), fc2(register_module("fc2", Holder(16, 16))),
        fc3(register_module("fc3", Holder(16, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc3(torch::tanh(fc2(torch::tanh(fc1(x))))); }
  Holder fc1, fc2, fc3;
};

template <typename Holder>
std::shared_ptr<DirectMlpImpl<Holder>> make_direct_mlp() {
  auto net = std::make_shared<DirectMlpImpl<Holder>>();
  torch::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : net->parameters()) p.copy_(torch::linspace(-0.3, 0.5, p.numel()).reshape(p.sizes()) * (1 + 0.1 * i++));
  return net;
}

FullyShardedDataParallelPlugin every_linear_a_unit() {
  return {.auto_wrap_policy = FsdpAutoWrapPolicy::kSizeBasedWrap, .min_num_params = 16};
}

TEST(FullyShardedNaturalModules, ADirectCallOfAUnitNamesTheUnitsThatRanNoHookAndTheFix) {
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        auto net = make_direct_mlp<torch::nn::Linear>();
        auto model = acc.prepare_model(net);
        EXPECT_EQ(detail::fsdp_engine(model.ddp())->unit_names().size(), 4u);
        const std::string error = error_of([&] { model(batch().narrow(0, rank * 4, 4)); });
        EXPECT_THAT(error, ::testing::HasSubstr("3 wrapped unit(s) had not run their hook in it: fc1, fc2, fc3"));
        EXPECT_THAT(error, ::testing::HasSubstr("accelerate::nn::Linear"));
        EXPECT_THAT(error, ::testing::HasSubstr("The error was: "));  // LibTorch's own words follow
        // The same under no_grad (evaluation).
        torch::NoGradGuard no_grad;
        EXPECT_THAT(error_of([&] { model(batch().narrow(0, rank * 4, 4)); }),
                    ::testing::HasSubstr("had not run their hook in it: fc1, fc2, fc3"));
      },
      {.fsdp_plugin = every_linear_a_unit()});
}

// A torch::nn::Sequential prepared as the model: its call walks the children through their hooks
// (as accelerate::forward does), where SequentialImpl::forward would call them past the hooks.
TEST(FullyShardedNaturalModules, APreparedSequentialRunsEachUnitsHookAndTrainsAsOneProcess) {
  const auto make = [] {
    torch::nn::Sequential seq(torch::nn::Linear(5, 16), torch::nn::Functional(torch::tanh), torch::nn::Linear(16, 16),
                              torch::nn::Functional(torch::tanh), torch::nn::Linear(16, 3));
    torch::NoGradGuard no_grad;
    int i = 0;
    for (auto& p : seq->parameters()) p.copy_(torch::linspace(-0.3, 0.5, p.numel()).reshape(p.sizes()) * (1 + 0.1 * i++));
    return seq;
  };
  std::map<std::string, torch::Tensor> want;
  {
    auto seq = make();
    torch::optim::SGD sgd(seq->parameters(), 0.1);
    torch::nn::functional::cross_entropy(seq->forward(batch()), labels()).backward();
    sgd.step();
    want = as_map(seq->named_parameters());
  }
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        auto seq = make();
        auto [model, opt] = acc.prepare(seq, std::make_shared<torch::optim::SGD>(seq->parameters(), 0.1));
        EXPECT_EQ(detail::fsdp_engine(model.ddp())->unit_names().size(), 4u);  // the root and 3 Linears
        acc.backward(torch::nn::functional::cross_entropy(model(batch().narrow(0, rank * 4, 4)),
                                                          labels().narrow(0, rank * 4, 4)));
        opt.step();
        const auto got = as_map(acc.get_state_dict(model));
        ASSERT_EQ(got.size(), want.size());
        for (const auto& [name, value] : want) EXPECT_TRUE(torch::allclose(got.at(name), value, 1e-5, 1e-6)) << name;
      },
      {.fsdp_plugin = every_linear_a_unit()});
}

TEST(FullyShardedNaturalModules, MembersDeclaredWithHookedHoldersTrainAsOneProcessWithDirectCalls) {
  auto want = [] {
    auto net = make_direct_mlp<torch::nn::Linear>();
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(0.05));
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(batch() * (1 + 0.5 * s)), labels()).backward();
      opt.step();
    }
    return as_map(net->named_parameters());
  }();
  for (int ranks : {2, 4}) {
    run_accelerators(
        ranks,
        [&](const Accelerator& acc, int rank) {
          auto net = make_direct_mlp<accelerate::nn::Linear>();
          auto [model, opt] =
              acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05)));
          EXPECT_EQ(detail::fsdp_engine(model.ddp())->unit_names().size(), 4u);
          EXPECT_EQ(net->fc2->weight.size(0), 16 / ranks);  // at rest: this process's rows
          const int64_t per_rank = kRows / ranks;
          for (int s = 0; s < 3; ++s) {
            opt.zero_grad();
            auto x = (batch() * (1 + 0.5 * s)).narrow(0, rank * per_rank, per_rank);
            acc.backward(torch::nn::functional::cross_entropy(model(x), labels().narrow(0, rank * per_rank, per_rank)));
            opt.step();
          }
          expect_close(as_map(acc.get_state_dict(model)), want);
        },
        {.fsdp_plugin = every_linear_a_unit()});
  }
}

TEST(FullyShardedHybrid, TwoReplicasOfTwoShardsTrainAsOneProcessAndTheReplicasHoldTheSameRows) {
  const auto expected = reference(3);
  Tiny ref = make_tiny();
  torch::nn::functional::cross_entropy(ref(batch()), labels()).backward();
  const double expected_norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 1e9);
  run_accelerators(
      4,
      [&](const Accelerator& acc, int rank) {
        EXPECT_EQ(acc.distributed_type(), DistributedType::kFsdp);
        Tiny net = make_tiny();
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05)));
        auto* engine = detail::fsdp_engine(model.ddp());
        EXPECT_EQ(engine->num_replicas(), 2);
        EXPECT_EQ(engine->replica_index(), rank / 2);
        EXPECT_EQ(engine->shard_group().num_processes(), 2);
        EXPECT_EQ(engine->shard_group().process_index(), rank % 2);
        // 6 rows over the 2 processes of a replica: 3 each.
        EXPECT_EQ(net->embed->weight.sizes(), (std::vector<int64_t>{3, 5}));
        for (int s = 0; s < 3; ++s) {
          opt.zero_grad();
          auto x = (batch() * (1 + 0.5 * s)).narrow(0, rank * 2, 2);
          acc.backward(torch::nn::functional::cross_entropy(model(x), labels().narrow(0, rank * 2, 2)));
          // The norm over one replica's shards (every replica holds the same gradients).
          if (s == 0) {
            EXPECT_NEAR(acc.clip_grad_norm_(net->parameters(), 1e9), expected_norm, 1e-5);
          }
          opt.step();
        }
        // Process r and r + 2 hold the same rows of the same replica's model.
        auto rows = acc.gather(net->embed->weight.detach().reshape({1, -1}));
        EXPECT_TRUE(torch::equal(rows[0], rows[2]));
        EXPECT_TRUE(torch::equal(rows[1], rows[3]));
        EXPECT_FALSE(torch::equal(rows[0], rows[1]));
        expect_close(as_map(acc.get_state_dict(model)), expected);
      },
      hybrid_2x2());
}

class HybridStrategy : public ::testing::TestWithParam<FsdpShardingStrategy> {};

TEST_P(HybridStrategy, ShardsWithinEachMachineAndReplicatesAcrossMachines) {
  const auto expected = reference(3);
  Store store = Store::in_memory();
  run_threads(4, [&](int rank) {
    AcceleratorOptions options = sharded_with(FsdpStateDictType::kFullStateDict);
    options.fsdp_plugin->sharding_strategy = GetParam();
    // Two machines of two processes each.
    PartialStateOptions machine{.local_process_index = rank % 2, .local_num_processes = 2};
    options.standalone_state = rank_options(machine, rank, 4, store);
    Accelerator acc(options);
    Tiny net = make_tiny();
    auto [model, opt] =
        acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05)));
    auto* engine = detail::fsdp_engine(model.ddp());
    EXPECT_EQ(engine->shard_group().num_processes(), 2);
    EXPECT_EQ(engine->num_replicas(), 2);
    EXPECT_EQ(engine->settings().reshard_after_forward, GetParam() == FsdpShardingStrategy::kHybridShard);
    EXPECT_EQ(net->head->weight.sizes(), (std::vector<int64_t>{rank % 2 == 0 ? 2 : 1, 6}));
    train_steps(acc, model, opt, 0, 3);
    expect_close(as_map(acc.get_state_dict(model)), expected);
  });
}

INSTANTIATE_TEST_SUITE_P(Strategies, HybridStrategy,
                         ::testing::Values(FsdpShardingStrategy::kHybridShard, FsdpShardingStrategy::kHybridShardZero2),
                         [](const ::testing::TestParamInfo<FsdpShardingStrategy>& info) {
                           return info.param == FsdpShardingStrategy::kHybridShard ? "HybridShard" : "HybridShardZero2";
                         });

TEST(FullyShardedHybrid, MachinesOfUnequalSizesAreRefusedNamingTheStrategy) {
  Store store = Store::in_memory();
  run_threads(3, [&](int rank) {
    AcceleratorOptions options;
    options.fsdp_plugin = FullyShardedDataParallelPlugin{.sharding_strategy = FsdpShardingStrategy::kHybridShard};
    PartialStateOptions machine{.local_process_index = rank % 2, .local_num_processes = 2};
    if (rank == 2) machine = PartialStateOptions{.local_process_index = 0, .local_num_processes = 1};
    options.standalone_state = rank_options(machine, rank, 3, store);
    Accelerator acc(options);
    EXPECT_THROWS_WITH(acc.prepare(make_tiny()), "HYBRID_SHARD shards within each machine and replicates across "
                                                 "machines, so every machine must run as many processes");
  });
}

TEST(FullyShardedHybrid, AShardedStateIsWrittenByTheFirstReplicaAndLoadsIntoEitherLayout) {
  TempDir dir;
  std::map<std::string, torch::Tensor> uninterrupted;
  const auto folder = (dir.path() / "c").string();
  const auto resumed = save_and_resume(hybrid_2x2(FsdpStateDictType::kShardedStateDict), 4,
                                       hybrid_2x2(FsdpStateDictType::kShardedStateDict), 4, folder, &uninterrupted);
  expect_equal(resumed, uninterrupted);
  // One replica's two shards, not four files.
  for (const char* sub : {"pytorch_model_fsdp_0", "optimizer_0"}) {
    EXPECT_TRUE(std::filesystem::is_regular_file(dir.path() / "c" / sub / "shard-1-of-2.safetensors")) << sub;
    EXPECT_FALSE(std::filesystem::exists(dir.path() / "c" / sub / "shard-0-of-4.safetensors")) << sub;
    EXPECT_FALSE(std::filesystem::exists(dir.path() / "c" / sub / "shard-2-of-2.safetensors")) << sub;
  }
  // Into 2 plainly sharded processes and back out of them into the hybrid layout.
  const auto expected = reference(4);
  TempDir other;
  expect_close(save_and_resume(hybrid_2x2(FsdpStateDictType::kShardedStateDict), 4,
                               sharded_with(FsdpStateDictType::kShardedStateDict), 2, (other.path() / "a").string()),
               expected);
  expect_close(save_and_resume(sharded_with(FsdpStateDictType::kShardedStateDict), 4,
                               hybrid_2x2(FsdpStateDictType::kShardedStateDict), 4, (other.path() / "b").string()),
               expected);
}

TEST(FullyShardedHybrid, AFullStateIsGatheredWithinAReplicaAndResumesBitForBit) {
  TempDir dir;
  std::map<std::string, torch::Tensor> uninterrupted;
  const auto resumed = save_and_resume(hybrid_2x2(), 4, hybrid_2x2(), 4, (dir.path() / "c").string(), &uninterrupted);
  expect_equal(resumed, uninterrupted);
  Tiny whole;
  load_checkpoint_in_model(*whole, (dir.path() / "c" / "model.safetensors").string(), {.strict = true});
  EXPECT_EQ(whole->embed->weight.sizes(), (std::vector<int64_t>{6, 5}));
}

}  // namespace
}  // namespace accelerate::testing
