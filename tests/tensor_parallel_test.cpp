// Tensor parallelism and the device mesh, with ranks as threads: the mesh's layout and groups,
// training over tp × dp (DDP and FSDP) that equals the single-process run, parameters that hold
// only their pieces, the global gradient norm, whole state dicts, the data each rank gets, split
// layers called without their hook, and every setting that is refused.
#include "accelerate/accelerator.h"
#include "accelerate/nn.h"
#include "distributed_impl.h"
#include "checkpoint/sharded_format.h"
#include "fsdp/engine.h"
#include "support/accelerators.h"
#include "support/test_support.h"

#include <atomic>
#include <numeric>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace accelerate::testing {
namespace {

constexpr int64_t kVocab = 16, kDim = 8, kHidden = 16, kBatch = 8, kSeq = 3;

// A block of a transformer's shape: a norm, then an MLP whose first layer is split by columns
// and second by rows. `Holder` is accelerate::nn::Linear (hooks run on `fc(x)`) or torch::nn::Linear.
template <typename Holder>
struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln(register_module("ln", accelerate::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        fc1(register_module("fc1", Holder(kDim, kHidden))), fc2(register_module("fc2", Holder(kHidden, kDim))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::gelu(fc1(ln(x)))); }
  accelerate::nn::LayerNorm ln;
  Holder fc1, fc2;
};

template <typename Holder>
struct NetImpl : torch::nn::Module, accelerate::nn::TensorParallelPlanned {
  NetImpl()
      : embed(register_module("embed", accelerate::nn::Embedding(kVocab, kDim))),
        block0(register_module("block0", std::make_shared<BlockImpl<Holder>>())),
        block1(register_module("block1", std::make_shared<BlockImpl<Holder>>())),
        head(register_module("head", Holder(kDim, kVocab))) {}
  torch::Tensor forward(const torch::Tensor& ids) {
    auto x = embed(ids);
    x = accelerate::forward(block0, x);
    x = accelerate::forward(block1, x);
    return head(x);
  }
  std::vector<std::pair<std::string, std::string>> tp_plan() const override {
    return {{"embed", "rowwise"}, {"*.ln", sequence_parallel ? "sequence_parallel" : "replicate"},
            {"*.fc1", "colwise"}, {"*.fc2", "rowwise"}, {"head", "colwise_rep"}};
  }
  bool sequence_parallel = false;  // the norms run on pieces of the sequence (kSeq = 3: uneven pieces)
  accelerate::nn::Embedding embed;
  std::shared_ptr<BlockImpl<Holder>> block0, block1;
  Holder head;
};

using Net = NetImpl<accelerate::nn::Linear>;
using DirectNet = NetImpl<torch::nn::Linear>;

template <typename N = Net>
std::shared_ptr<N> make_net() {
  auto net = std::make_shared<N>();
  torch::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : net->parameters()) {
    p.copy_(torch::sin(torch::arange(p.numel(), torch::kFloat) * (0.37 + 0.05 * i++)).reshape(p.sizes()) * 0.5);
  }
  return net;
}

torch::Tensor ids(int step) {
  return (torch::arange(kBatch * kSeq, torch::kLong).reshape({kBatch, kSeq}) * (3 + step) + step) % kVocab;
}
torch::Tensor targets(int step) { return (ids(step) * 5 + 1) % kVocab; }

torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), target.reshape({-1}));
}

std::map<std::string, torch::Tensor> as_map(const StateDictMap& state) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : state) out[item.key()] = item.value().detach().clone();
  return out;
}

constexpr double kMaxNorm = 0.5;  // below the gradients' norm: clipping acts on every step

struct Reference {
  std::map<std::string, torch::Tensor> params;
  std::vector<double> norms;
};

// `steps` AdamW steps on the whole batch on one process, the gradient clipped to kMaxNorm.
Reference reference(int steps) {
  auto net = make_net();
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(0.02));
  Reference out;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    loss_of(net->forward(ids(s)), targets(s)).backward();
    out.norms.push_back(torch::nn::utils::clip_grad_norm_(net->parameters(), kMaxNorm));
    opt.step();
  }
  out.params = as_map(net->named_parameters());
  return out;
}

void expect_close(const std::map<std::string, torch::Tensor>& got, const std::map<std::string, torch::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, value] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    ASSERT_EQ(got.at(name).sizes(), value.sizes()) << name;
    EXPECT_TRUE(torch::allclose(got.at(name), value, 1e-4, 1e-5)) << name << "\n" << got.at(name) << "\n" << value;
  }
}

struct Mesh {
  const char* name;
  int replicate, shard, tp;
  bool sequence_parallel = false;
  int ranks() const { return replicate * shard * tp; }
};
void PrintTo(const Mesh& m, std::ostream* os) { *os << m.name; }

AcceleratorOptions mesh_options(const Mesh& m) {
  AcceleratorOptions options;
  options.parallelism_config = ParallelismConfig{.dp_replicate_size = m.replicate, .dp_shard_size = m.shard,
                                                 .tp_size = m.tp};
  return options;
}

class TensorParallelTraining : public ::testing::TestWithParam<Mesh> {};

TEST_P(TensorParallelTraining, ThreeClippedAdamWStepsEqualTheSingleProcessRun) {
  const Mesh m = GetParam();
  const auto want = reference(3);
  run_accelerators(
      m.ranks(),
      [&](const Accelerator& acc, int rank) {
        auto mesh = acc.torch_device_mesh();
        ASSERT_TRUE(mesh.has_value());
        const int dp = mesh->size("dp"), dp_rank = mesh->get_local_rank("dp");
        EXPECT_EQ(dp_rank, rank / m.tp);
        auto net = make_net();
        net->sequence_parallel = m.sequence_parallel;
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.02)));
        EXPECT_TRUE(model.ddp().is_tensor_parallel());
        EXPECT_EQ(model.ddp().is_fully_sharded(), m.shard > 1);
        const int64_t rows = kBatch / dp;
        for (int s = 0; s < 3; ++s) {
          opt.zero_grad();
          auto x = ids(s).narrow(0, dp_rank * rows, rows), y = targets(s).narrow(0, dp_rank * rows, rows);
          acc.backward(loss_of(model(x), y));
          const double norm = acc.clip_grad_norm_(net->parameters(), kMaxNorm);
          EXPECT_NEAR(norm, want.norms[s], 1e-4 * want.norms[s]) << "step " << s;
          opt.step();
        }
        expect_close(as_map(acc.get_state_dict(model)), want.params);
      },
      mesh_options(m));
}

INSTANTIATE_TEST_SUITE_P(Meshes, TensorParallelTraining,
                         ::testing::Values(Mesh{"Tp2", 1, 1, 2}, Mesh{"Tp4", 1, 1, 4}, Mesh{"Tp2Ddp2", 2, 1, 2},
                                           Mesh{"Tp2Fsdp2", 1, 2, 2}, Mesh{"Tp2Fsdp2Ddp2", 2, 2, 2},
                                           // The 3 positions in pieces of 2 and 1, and of 1, 1, 1 and none.
                                           Mesh{"Tp2SequenceParallel", 1, 1, 2, true},
                                           Mesh{"Tp4SequenceParallel", 1, 1, 4, true},
                                           Mesh{"Tp2Fsdp2Ddp2SequenceParallel", 2, 2, 2, true}),
                         [](const ::testing::TestParamInfo<Mesh>& info) { return std::string(info.param.name); });

// FSDP over the pieces with each block a unit whose activations are recomputed in the backward
// pass (the split layers' collectives run again there), and gradients accumulated over 2 batches.
// The norms are sequence-parallel: their gradients, summed over the tp group by a hook, accumulate
// and are then reduced by FSDP.
TEST(TensorParallelTraining, FsdpTimesTpWithActivationCheckpointingAndAccumulationEqualsTheSingleProcessRun) {
  Reference want;
  {
    auto net = make_net();
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(0.02));
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      for (int m = 0; m < 2; ++m) (loss_of(net->forward(ids(2 * s + m)), targets(2 * s + m)) / 2).backward();
      want.norms.push_back(torch::nn::utils::clip_grad_norm_(net->parameters(), kMaxNorm));
      opt.step();
    }
    want.params = as_map(net->named_parameters());
  }
  auto options = mesh_options({"", 1, 2, 2});
  options.gradient_accumulation_steps = 2;
  // The policy counts split parameters whole, as upstream counts a DTensor: a block holds 296
  // parameters (160 of them on this process), each of its layers 144 or fewer, the embedding 128,
  // the head 144: the blocks are the units.
  options.fsdp_plugin = FullyShardedDataParallelPlugin{.auto_wrap_policy = FsdpAutoWrapPolicy::kSizeBasedWrap,
                                                       .min_num_params = 200,
                                                       .activation_checkpointing = true};
  run_accelerators(
      4,
      [&](const Accelerator& acc, int rank) {
        const int dp_rank = rank / 2;
        auto net = make_net();
        net->sequence_parallel = true;
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.02)));
        EXPECT_EQ(detail::fsdp_engine(model.ddp())->unit_names().size(), 3u);  // the root and the 2 blocks
        int synced = 0;
        for (int b = 0; b < 4; ++b) {
          auto guard = acc.accumulate(model);
          auto x = ids(b).narrow(0, dp_rank * 4, 4), y = targets(b).narrow(0, dp_rank * 4, 4);
          acc.backward(loss_of(model(x), y));
          if (acc.sync_gradients()) {
            const double norm = acc.clip_grad_norm_(net->parameters(), kMaxNorm);
            EXPECT_NEAR(norm, want.norms[synced], 1e-4 * want.norms[synced]) << "step " << synced;
            ++synced;
          }
          opt.step();
          opt.zero_grad();
        }
        EXPECT_EQ(synced, 2);
        expect_close(as_map(acc.get_state_dict(model)), want.params);
      },
      options);
}

// bf16 autocast: the split layers' outputs, and so their collectives, are bf16. Training with SGD
// ends within bf16's rounding of the same training on one process.
TEST(TensorParallelTraining, Bf16MixedPrecisionEndsWithinRoundingOfTheSingleProcessRun) {
  const auto train = [](const Accelerator& acc, int dp_rank, int dp) {
    auto net = make_net();
    auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::SGD>(net->parameters(), 0.1));
    std::vector<double> losses;
    const int64_t rows = kBatch / dp;
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      auto x = ids(s).narrow(0, dp_rank * rows, rows), y = targets(s).narrow(0, dp_rank * rows, rows);
      auto logits = model(x);
      EXPECT_EQ(logits.scalar_type(), torch::kFloat);  // outputs come back in fp32, as upstream
      auto loss = loss_of(logits, y);
      losses.push_back(acc.reduce(loss.detach(), "mean").item<double>());
      acc.backward(loss);
      opt.step();
    }
    return std::make_pair(as_map(acc.get_state_dict(model)), losses);
  };
  std::map<std::string, torch::Tensor> want;
  std::vector<double> want_losses;
  run_accelerators(
      1, [&](const Accelerator& acc, int) { std::tie(want, want_losses) = train(acc, 0, 1); },
      {.mixed_precision = "bf16"});
  auto options = mesh_options({"", 2, 1, 2});
  options.mixed_precision = "bf16";
  run_accelerators(
      4,
      [&](const Accelerator& acc, int rank) {
        auto [got, losses] = train(acc, rank / 2, 2);
        for (int s = 0; s < 3; ++s) EXPECT_NEAR(losses[s], want_losses[s], 2e-2 * want_losses[s]) << "step " << s;
        ASSERT_EQ(got.size(), want.size());
        for (const auto& [name, value] : want) {
          EXPECT_TRUE(torch::allclose(got.at(name), value, 2e-2, 2e-2)) << name << "\n" << got.at(name) << "\n" << value;
        }
      },
      options);
}

TEST(DeviceMesh, RanksAreLaidOutWithTensorParallelismInnermostAndEachGroupSumsItsOwn) {
  run_accelerators(
      8,
      [&](const Accelerator& acc, int rank) {
        auto mesh = *acc.torch_device_mesh();
        EXPECT_EQ(mesh.mesh_dim_names(), (std::vector<std::string>{"dp_replicate", "dp_shard", "cp", "tp"}));
        EXPECT_EQ(mesh.shape(), (std::vector<int>{2, 2, 1, 2}));
        const int t = rank % 2, s = (rank / 2) % 2, p = rank / 4;
        EXPECT_EQ(mesh.group_ranks("tp"), (std::vector<int>{rank - t, rank - t + 1}));
        EXPECT_EQ(mesh.group_ranks("dp_shard"), (std::vector<int>{p * 4 + t, p * 4 + 2 + t}));
        EXPECT_EQ(mesh.group_ranks("dp_replicate"), (std::vector<int>{s * 2 + t, 4 + s * 2 + t}));
        EXPECT_EQ(mesh.group_ranks("dp"), (std::vector<int>{t, 2 + t, 4 + t, 6 + t}));
        EXPECT_EQ(mesh.group_ranks("dp_shard_cp"), mesh.group_ranks("dp_shard"));
        EXPECT_EQ(mesh.get_local_rank("tp"), t);
        EXPECT_EQ(mesh.get_local_rank("dp"), rank / 2);
        for (const char* dim : {"tp", "dp_shard", "dp_replicate", "dp"}) {
          auto sum = reduce(mesh.get_group(dim), torch::tensor({int64_t{1} << rank}), "sum");
          int64_t want = 0;
          for (int r : mesh.group_ranks(dim)) want += int64_t{1} << r;
          EXPECT_EQ(sum.item<int64_t>(), want) << dim;
        }
        EXPECT_THAT(error_of([&] { mesh.size("cp_tp"); }), ::testing::HasSubstr("no dimension named \"cp_tp\""));
      },
      mesh_options({"", 2, 2, 2}));
}

TEST(TensorParallel, SplitLayersAndTheirOptimizerStateHoldOnlyThisProcesssPiece) {
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        auto whole = make_net();
        auto net = make_net();
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.02)));
        EXPECT_TRUE(torch::equal(net->embed->weight, whole->embed->weight.narrow(0, rank * 8, 8)));
        EXPECT_TRUE(torch::equal(net->block0->fc1->weight, whole->block0->fc1->weight.narrow(0, rank * 8, 8)));
        EXPECT_TRUE(torch::equal(net->block0->fc1->bias, whole->block0->fc1->bias.narrow(0, rank * 8, 8)));
        EXPECT_TRUE(torch::equal(net->block0->fc2->weight, whole->block0->fc2->weight.narrow(1, rank * 8, 8)));
        EXPECT_TRUE(torch::equal(net->block0->fc2->bias, whole->block0->fc2->bias));  // added once, whole
        EXPECT_TRUE(torch::equal(net->head->weight, whole->head->weight.narrow(0, rank * 8, 8)));
        EXPECT_TRUE(torch::equal(net->block0->ln->weight, whole->block0->ln->weight));
        int64_t mine = 0;
        for (const auto& p : net->parameters()) mine += p.numel();
        int64_t all = 0;
        for (const auto& p : whole->parameters()) all += p.numel();
        // Split: embed 128, fc1 144 and fc2's weight 128 per block, head 144: 816 of 864 (the norms
        // and fc2's bias stay whole).
        EXPECT_EQ(all, 864);
        EXPECT_EQ(mine, all - 816 / 2);
        acc.backward(loss_of(model(ids(0)), targets(0)));
        opt.step();
        EXPECT_EQ(net->block1->fc2->weight.grad().sizes(), net->block1->fc2->weight.sizes());
        // The whole state dict is gathered; the model's own stays in pieces.
        auto state = as_map(acc.get_state_dict(model));
        EXPECT_EQ(state.at("block1.fc2.weight").sizes(), (std::vector<int64_t>{kDim, kHidden}));
        EXPECT_EQ(state.at("embed.weight").sizes(), (std::vector<int64_t>{kVocab, kDim}));
      },
      mesh_options({"", 1, 1, 2}));
}

TEST(TensorParallel, EveryRankOfATpGroupGetsTheSameBatchAndMetricsCountEachSampleOnce) {
  std::vector<std::vector<int64_t>> seen(4);
  run_accelerators(
      4,
      [&](const Accelerator& acc, int rank) {
        auto dataset = std::make_shared<TensorDataset>(torch::arange(10, torch::kLong).reshape({10, 1}),
                                                       torch::arange(10, torch::kLong));
        DataLoader loader = acc.prepare_data_loader(DataLoader(dataset, {.batch_size = 2}));
        std::vector<int64_t> gathered;
        for (const auto& batch : loader) {
          for (int64_t i = 0; i < batch.target.size(0); ++i) seen[rank].push_back(batch.target[i].item<int64_t>());
          auto all = acc.gather_for_metrics(batch.target);
          for (int64_t i = 0; i < all.size(0); ++i) gathered.push_back(all[i].item<int64_t>());
        }
        std::sort(gathered.begin(), gathered.end());
        std::vector<int64_t> every(10);
        std::iota(every.begin(), every.end(), 0);
        EXPECT_EQ(gathered, every);
      },
      mesh_options({"", 2, 1, 2}));
  EXPECT_EQ(seen[0], seen[1]);  // one tp group
  EXPECT_EQ(seen[2], seen[3]);
  EXPECT_NE(seen[0], seen[2]);  // two data-parallel ranks
  // 5 samples each, in batches of 2: the last batch is evened out with a sample repeated, which
  // gather_for_metrics drops.
  EXPECT_EQ(seen[0].size(), 6u);
  EXPECT_EQ(seen[2].size(), 6u);
}

TEST(TensorParallel, ASplitLayerCalledWithoutItsHookStopsThePassNamingIt) {
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        (void)rank;
        auto net = make_net<DirectNet>();
        auto model = acc.prepare_model(net);
        // Called directly, fc1 (colwise) and fc2 (rowwise) agree in shape: only the check sees it.
        const std::string error = error_of([&] { model(ids(0)); });
        EXPECT_THAT(error, ::testing::HasSubstr("block0.fc1, block0.fc2, block1.fc1, block1.fc2, head"));
        EXPECT_THAT(error, ::testing::HasSubstr("accelerate::nn::Linear"));
        torch::NoGradGuard no_grad;
        EXPECT_THAT(error_of([&] { model(ids(0)); }), ::testing::HasSubstr("ran without their hook"));
      },
      mesh_options({"", 1, 1, 2}));
}

// A norm whose member is a plain torch::nn::LayerNorm, called directly.
struct DirectNormNetImpl : torch::nn::Module {
  DirectNormNetImpl()
      : ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        fc(register_module("fc", accelerate::nn::Linear(kDim, kDim))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc(ln(x)); }
  torch::nn::LayerNorm ln;
  accelerate::nn::Linear fc;
};

// A norm whose weight the model also uses outside it.
struct SharedNormNetImpl : torch::nn::Module {
  SharedNormNetImpl() : ln(register_module("ln", accelerate::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))) {
    scale = register_parameter("scale", ln->weight);
  }
  torch::Tensor forward(const torch::Tensor& x) { return ln(x) * scale; }
  accelerate::nn::LayerNorm ln;
  torch::Tensor scale;
};

// A scale whose parameter another module shares.
struct ScaleImpl : torch::nn::Module {
  explicit ScaleImpl(torch::Tensor shared) { w = register_parameter("w", shared); }
  torch::Tensor forward(const torch::Tensor& x) { return x * w; }
  torch::Tensor w;
};
TORCH_MODULE(Scale);

// Two sequence-parallel modules sharing a parameter: its gradient is summed over the group once,
// and equals the single-process one.
TEST(TensorParallel, ASharedParameterOfTwoSequenceParallelModulesGetsTheSingleProcessGradient) {
  const auto make = [] {
    auto w = torch::linspace(0.5, 1.5, kDim);
    auto seq = std::make_shared<torch::nn::SequentialImpl>();
    seq->push_back("a", Scale(w));
    seq->push_back("b", Scale(w));
    return seq;
  };
  const auto x = torch::sin(torch::arange(2 * 5 * kDim, torch::kFloat)).reshape({2, 5, kDim});
  auto one = make();
  (one->forward(x) * x).sum().backward();
  const auto want = one->named_parameters()["a.w"].grad().clone();
  auto options = mesh_options({"", 1, 1, 2});
  options.tp_handler.tp_plan = {{"a", "sequence_parallel"}, {"b", "sequence_parallel"}};
  run_accelerators(
      2,
      [&](const Accelerator& acc, int) {
        auto seq = make();
        auto model = acc.prepare_model(seq);
        acc.backward((model(x) * x).sum());
        const auto got = seq->named_parameters()["a.w"].grad();
        EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-6)) << got << "\n" << want;
      },
      options);
}

TEST(TensorParallel, SequenceParallelModulesAreRefusedWhereTheirPiecesWouldBeWrong) {
  const auto with_plan = [](std::vector<std::pair<std::string, std::string>> plan) {
    auto options = mesh_options({"", 1, 1, 2});
    options.tp_handler.tp_plan = std::move(plan);
    return options;
  };
  // Around a split module, inside one, or sharing a parameter with a module outside it.
  run_accelerators(
      2,
      [&](const Accelerator& acc, int) {
        auto net = make_net();
        EXPECT_THAT(error_of([&] { acc.prepare_model(net); }),
                    ::testing::HasSubstr("module \"block0\" (sequence_parallel) holds module \"block0.fc1\" "
                                         "(colwise)"));
      },
      with_plan({{"block0", "sequence_parallel"}, {"block0.fc1", "colwise"}}));
  run_accelerators(
      2,
      [&](const Accelerator& acc, int) {
        auto shared = std::make_shared<SharedNormNetImpl>();
        EXPECT_THAT(error_of([&] { acc.prepare_model(shared); }),
                    ::testing::HasSubstr("module \"ln\" (sequence_parallel) shares a parameter with \"the model\" "
                                         "(its \"scale\")"));
      },
      with_plan({{"ln", "sequence_parallel"}}));
  // An input without a sequence dimension, and a module that changes the sequence's length.
  run_accelerators(
      2,
      [&](const Accelerator& acc, int) {
        auto seq = std::make_shared<torch::nn::SequentialImpl>();
        seq->push_back("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
        seq->push_back("flat", torch::nn::Flatten());
        auto model = acc.prepare_model(seq);
        EXPECT_THAT(error_of([&] { model(torch::ones({kDim})); }),
                    ::testing::HasSubstr("module \"ln\" (sequence_parallel) splits its input along dimension 1, "
                                         "the sequence; got a tensor of 1 dimension(s)"));
        EXPECT_THAT(error_of([&] { model(torch::ones({2, 5, kDim})); }),
                    ::testing::HasSubstr("module \"flat\" (sequence_parallel) must return a tensor whose dimension 1 "
                                         "is its input's (the sequence): given"));
        // prepare's last collective is a broadcast, which process 0 can leave before the others
        // have received it: no process tears its group down before every one is past it.
        acc.wait_for_everyone();
      },
      with_plan({{"ln", "sequence_parallel"}, {"flat", "sequence_parallel"}}));
  // Called past its hook, it would compute on the whole sequence and have its gradient summed
  // tp_size times: the pass is refused, naming it.
  run_accelerators(
      2,
      [&](const Accelerator& acc, int) {
        auto net = std::make_shared<DirectNormNetImpl>();
        auto model = acc.prepare_model(net);
        const std::string error = error_of([&] { model(torch::ones({2, 3, kDim}, torch::requires_grad())); });
        EXPECT_THAT(error, ::testing::HasSubstr("module(s) ln of the tensor-parallel plan ran without their hook"));
        acc.wait_for_everyone();
      },
      with_plan({{"ln", "sequence_parallel"}}));
}

TEST(TensorParallel, WrongSettingsAreRefusedByNameOnEveryProcess) {
  // Sizes whose product is not the number of processes, checked when the Accelerator is built.
  std::atomic<int> refused{0};
  Store store = Store::in_memory();
  run_threads(4, [&](int rank) {
    AcceleratorOptions options = mesh_options({"", 1, 1, 3});
    options.standalone_state = rank_options(PartialStateOptions{}, rank, 4, store);
    EXPECT_THAT(error_of([&] { Accelerator acc(options); }),
                ::testing::HasSubstr("dp_replicate_size (1) x dp_shard_size (1) x tp_size (3) x cp_size (1) must "
                                     "equal the number of processes, 4"));
    ++refused;
  });
  EXPECT_EQ(refused.load(), 4);
  const auto prepare_refused = [](AcceleratorOptions options, std::function<std::shared_ptr<torch::nn::Module>()> make,
                                  const std::string& message) {
    run_accelerators(
        2,
        [&](const Accelerator& acc, int) {
          auto module = make();
          EXPECT_THAT(error_of([&] { acc.prepare_model(module); }), ::testing::HasSubstr(message));
        },
        options);
  };
  auto plain = [] { return std::shared_ptr<torch::nn::Module>(std::make_shared<BlockImpl<accelerate::nn::Linear>>()); };
  prepare_refused(mesh_options({"", 1, 1, 2}), plain, "the model has no tensor-parallel plan");
  const auto with_plan = [](std::vector<std::pair<std::string, std::string>> plan) {
    auto options = mesh_options({"", 1, 1, 2});
    options.tp_handler.tp_plan = std::move(plan);
    return options;
  };
  prepare_refused(with_plan({{"fc1", "local_colwise"}}), plain, "style \"local_colwise\" is not supported yet");
  prepare_refused(with_plan({{"fc1", "diagonal"}}), plain, "style \"diagonal\" is unknown");
  prepare_refused(with_plan({{"fc3", "colwise"}}), plain, "tp_plan entry \"fc3\" matches no module");
  prepare_refused(with_plan({{"ln", "colwise"}}), plain, "module \"ln\" (torch::nn::LayerNormImpl) cannot be split");
  run_accelerators(
      2,
      [&](const Accelerator& acc, int) {
        auto seq = std::make_shared<torch::nn::SequentialImpl>();
        seq->push_back("fc", torch::nn::Linear(4, 5));
        EXPECT_THAT(error_of([&] { acc.prepare_model(seq); }),
                    ::testing::HasSubstr("its weight has 5 along dimension 0, which tp_size 2 does not divide"));
        acc.wait_for_everyone();  // the refusal comes after prepare's broadcasts (see above)
      },
      with_plan({{"fc", "colwise"}}));
  // Embeddings whose lookups a split would change, and a rowwise input of neither width.
  run_accelerators(
      2,
      [&](const Accelerator& acc, int) {
        auto renormed = std::make_shared<torch::nn::SequentialImpl>();
        renormed->push_back("embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(8, 4).max_norm(1.0)));
        EXPECT_THAT(error_of([&] { acc.prepare_model(renormed); }),
                    ::testing::HasSubstr("module \"embed\": an Embedding with max_norm cannot be split"));
        auto padded = std::make_shared<torch::nn::SequentialImpl>();
        padded->push_back("embed", torch::nn::Embedding(torch::nn::EmbeddingOptions(8, 4).padding_idx(0)));
        EXPECT_THAT(error_of([&] { acc.prepare_model(padded); }),
                    ::testing::HasSubstr("a vocabulary-parallel Embedding with padding_idx is not supported yet"));
        acc.wait_for_everyone();
      },
      with_plan({{"embed", "rowwise"}}));
  run_accelerators(
      2,
      [&](const Accelerator& acc, int) {
        auto seq = std::make_shared<torch::nn::SequentialImpl>();
        seq->push_back("fc", torch::nn::Linear(8, 4));
        auto model = acc.prepare_model(seq);
        // Through accelerate::forward, which walks a Sequential's children (and so runs fc's hook).
        EXPECT_THAT(error_of([&] { accelerate::forward(model.module(), torch::ones({2, 6})); }),
                    ::testing::HasSubstr("module \"fc\" (rowwise) takes inputs of 4 features (this process's) or 8 "
                                         "(whole), got a last dimension of 6"));
        acc.wait_for_everyone();
      },
      with_plan({{"fc", "rowwise"}}));
  auto async = mesh_options({"", 1, 1, 2});
  async.tp_handler.enable_async_tp = true;
  Store async_store = Store::in_memory();
  run_threads(2, [&](int rank) {
    AcceleratorOptions options = async;
    options.standalone_state = rank_options(PartialStateOptions{}, rank, 2, async_store);
    EXPECT_THAT(error_of([&] { Accelerator acc(options); }), ::testing::HasSubstr("enable_async_tp"));
  });
}

// ---- Checkpoints (Note [Checkpoints of split layers])

// The data-parallel rank and size of a process (the whole job without a mesh).
std::pair<int, int> dp_of(const Accelerator& acc) {
  const auto mesh = acc.torch_device_mesh();
  if (!mesh) return {acc.process_index(), acc.num_processes()};
  return {mesh->get_local_rank("dp"), mesh->size("dp")};
}

// Steps `first`..`last - 1` of the reference's training, each process on its dp rank's rows.
template <typename Model, typename Optimizer>
void train(const Accelerator& acc, Model& model, Optimizer& opt, torch::nn::Module& net, int first, int last) {
  const auto [dp_rank, dp] = dp_of(acc);
  const int64_t rows = kBatch / dp;
  for (int s = first; s < last; ++s) {
    opt.zero_grad();
    auto x = ids(s).narrow(0, dp_rank * rows, rows), y = targets(s).narrow(0, dp_rank * rows, rows);
    acc.backward(loss_of(model(x), y));
    acc.clip_grad_norm_(net.parameters(), kMaxNorm);
    opt.step();
  }
}

struct Resume {
  const char* name;
  Mesh saved, loaded;
  CheckpointLayout layout = CheckpointLayout::kCpp;
  FsdpStateDictType fsdp_state = FsdpStateDictType::kFullStateDict;
};
void PrintTo(const Resume& r, std::ostream* os) { *os << r.name; }

class TensorParallelCheckpoints : public ::testing::TestWithParam<Resume> {};

// Two steps on one mesh, save_state; a new model and optimizer on another mesh load it and take
// the third step: the parameters equal three steps on one process, so the weights and the AdamW
// moments and step count all crossed. The files hold whole tensors, those of two steps.
TEST_P(TensorParallelCheckpoints, SaveStateOnOneMeshResumesOnAnotherEqualToOneProcess) {
  const auto [name, saved, loaded, layout, fsdp_state] = GetParam();
  const auto options_of = [state = fsdp_state](const Mesh& m) {
    auto options = mesh_options(m);
    if (m.shard > 1) options.fsdp_plugin = FullyShardedDataParallelPlugin{.state_dict_type = state};
    return options;
  };
  const bool sharded = fsdp_state != FsdpStateDictType::kFullStateDict && saved.shard > 1;
  const auto want = reference(3);
  TempDir dir;
  const auto folder = (dir.path() / "ckpt").string();
  run_accelerators(
      saved.ranks(),
      [&](const Accelerator& acc, int) {
        auto net = make_net();
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.02)));
        train(acc, model, opt, *net, 0, 2);
        acc.save_state(folder, {.layout = layout});
      },
      options_of(saved));
  const auto two_steps = reference(2).params;
  // Whole tensors in the files, or pieces that the index places in them (merge-weights joins them).
  expect_close(sharded ? detail::checkpoint::merge_sharded_state(folder + "/pytorch_model_fsdp_0")
                       : SafetensorsFile(folder + "/model.safetensors").read_tensors(),
               two_steps);
  ASSERT_EQ(std::filesystem::exists(folder + "/model.safetensors"), !sharded);
  if (sharded) {  // one file per process of a replica: its rows of its piece
    const auto last = "shard-" + std::to_string(saved.shard - 1) + "-of-" + std::to_string(saved.shard) +
                      (saved.tp > 1 ? "-tp-" + std::to_string(saved.tp - 1) + "-of-" + std::to_string(saved.tp) : "");
    EXPECT_TRUE(std::filesystem::exists(folder + "/pytorch_model_fsdp_0/" + last + ".safetensors")) << last;
    EXPECT_TRUE(std::filesystem::exists(folder + "/optimizer_0/" + last + ".safetensors")) << last;
  }
  ASSERT_EQ(std::filesystem::exists(folder + "/optimizer.bin"), layout == CheckpointLayout::kPython);
  run_accelerators(
      loaded.ranks(),
      [&](const Accelerator& acc, int) {
        auto net = make_net();
        {
          torch::NoGradGuard no_grad;
          for (auto& p : net->parameters()) p.fill_(0.25);  // nothing of the start survives a load
        }
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.02)));
        acc.load_state(folder, {.layout = layout});
        expect_close(as_map(acc.get_state_dict(model)), two_steps);
        train(acc, model, opt, *net, 2, 3);
        expect_close(as_map(acc.get_state_dict(model)), want.params);
      },
      options_of(loaded));
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, TensorParallelCheckpoints,
    ::testing::Values(Resume{"Tp2ToOneProcess", {"", 1, 1, 2}, {"", 1, 1, 1}},
                      Resume{"OneProcessToTp2", {"", 1, 1, 1}, {"", 1, 1, 2}},
                      Resume{"Tp2Fsdp2ToFsdp4", {"", 1, 2, 2}, {"", 1, 4, 1}},
                      Resume{"Tp2Ddp2ToTp2Fsdp2", {"", 2, 1, 2}, {"", 1, 2, 2}},
                      Resume{"ThreeDimensionsToTp4", {"", 2, 2, 2}, {"", 1, 1, 4}},
                      Resume{"Tp2ToTp4InPythonsLayout", {"", 1, 1, 2}, {"", 1, 1, 4}, CheckpointLayout::kPython},
                      Resume{"ShardedTp2Fsdp2ToFsdp4", {"", 1, 2, 2}, {"", 1, 4, 1}, CheckpointLayout::kCpp,
                             FsdpStateDictType::kShardedStateDict},
                      Resume{"ShardedFsdp4ToTp2Fsdp2", {"", 1, 4, 1}, {"", 1, 2, 2}, CheckpointLayout::kCpp,
                             FsdpStateDictType::kShardedStateDict},
                      Resume{"ShardedTp2Fsdp2ToTp4", {"", 1, 2, 2}, {"", 1, 1, 4}, CheckpointLayout::kCpp,
                             FsdpStateDictType::kShardedStateDict},
                      Resume{"ShardedThreeDimensionsToOneProcess", {"", 2, 2, 2}, {"", 1, 1, 1},
                             CheckpointLayout::kCpp, FsdpStateDictType::kShardedStateDict},
                      Resume{"ShardedTp2Fsdp2ToTp2Fsdp4", {"", 1, 2, 2}, {"", 1, 4, 2}, CheckpointLayout::kCpp,
                             FsdpStateDictType::kShardedStateDict},
                      Resume{"LocalTp2Fsdp2ToTheSameMesh", {"", 1, 2, 2}, {"", 1, 2, 2}, CheckpointLayout::kCpp,
                             FsdpStateDictType::kLocalStateDict}),
    [](const ::testing::TestParamInfo<Resume>& info) { return std::string(info.param.name); });

TEST(TensorParallel, AWholeTensorTheTpSizeDoesNotDivideIsRefusedAndNothingChanges) {
  TempDir dir;
  const auto folder = (dir.path() / "ckpt").string();
  run_accelerators(
      1,
      [&](const Accelerator& acc, int) {
        auto net = make_net();
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.02)));
        train(acc, model, opt, *net, 0, 1);
        acc.save_state(folder);
      },
      mesh_options({"", 1, 1, 1}));
  auto tensors = SafetensorsFile(folder + "/model.safetensors").read_tensors();
  tensors["block0.fc1.weight"] = tensors["block0.fc1.weight"].narrow(0, 0, kHidden - 1).clone();
  save_file(tensors, folder + "/model.safetensors", {{"format", "pt"}});
  run_accelerators(
      2,
      [&](const Accelerator& acc, int) {
        auto net = make_net();
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.02)));
        const auto before = as_map(acc.get_state_dict(model));
        EXPECT_THAT(error_of([&] { acc.load_state(folder); }),
                    ::testing::AllOf(::testing::HasSubstr("model.safetensors"), ::testing::HasSubstr("block0.fc1.weight"),
                                     ::testing::HasSubstr("tp_size 2 does not divide")));
        expect_close(as_map(acc.get_state_dict(model)), before);
        EXPECT_TRUE(opt.optimizer()->state().empty());
      },
      mesh_options({"", 1, 1, 2}));
}

// save_state of the untrained model on tp 2 x FSDP 2, in a state dict type of FSDP's, to `folder`.
void save_tp_fsdp_state(const std::string& folder, FsdpStateDictType type) {
  auto options = mesh_options({"", 1, 2, 2});
  options.fsdp_plugin = FullyShardedDataParallelPlugin{.state_dict_type = type};
  run_accelerators(
      4,
      [&](const Accelerator& acc, int) {
        auto net = make_net();
        auto model = acc.prepare_model(net);
        acc.save_state(folder);
      },
      options);
}

// A sharded folder of split layers with a file missing, or an index whose split cannot be, is
// refused naming the file or the tensor: by merge-weights and by load_state.
TEST(TensorParallel, AShardedFolderMissingAPieceOrWithABadSplitIsRefusedNamingIt) {
  TempDir dir;
  const auto folder = (dir.path() / "ckpt").string();
  save_tp_fsdp_state(folder, FsdpStateDictType::kShardedStateDict);
  const auto model_folder = folder + "/pytorch_model_fsdp_0";
  ASSERT_EQ(detail::checkpoint::merge_sharded_state(model_folder).at("block0.fc1.weight").sizes(),
            (std::vector<int64_t>{kHidden, kDim}));

  // The index says fc1's weight is split along a dimension it does not have.
  const auto index_path = model_folder + "/index.json";
  const auto index = load_state_dict_file(index_path);
  auto bad = index.values;
  bad["split"]["block0.fc1.weight"]["dim"] = 5;
  save_state_dict_file({bad, {}}, index_path);
  EXPECT_THAT(error_of([&] { detail::checkpoint::merge_sharded_state(model_folder); }),
              ::testing::AllOf(::testing::HasSubstr("block0.fc1.weight cannot be split along dimension 5 of [16, 8]"),
                               ::testing::HasSubstr("index.json")));
  save_state_dict_file(index, index_path);

  // A process's file is gone.
  std::filesystem::remove(model_folder + "/shard-1-of-2-tp-1-of-2.safetensors");
  EXPECT_THAT(error_of([&] { detail::checkpoint::merge_sharded_state(model_folder); }),
              ::testing::HasSubstr("has no shard-1-of-2-tp-1-of-2.safetensors (saved by 4 processes)"));
  run_accelerators(
      2,
      [&](const Accelerator& acc, int) {
        auto net = make_net();
        auto model = acc.prepare_model(net);
        const auto before = as_map(acc.get_state_dict(model));
        EXPECT_THAT(error_of([&] { acc.load_state(folder); }),
                    ::testing::HasSubstr("has no shard-1-of-2-tp-1-of-2.safetensors (saved by 4 processes)"));
        expect_close(as_map(acc.get_state_dict(model)), before);
      },
      mesh_options({"", 1, 1, 2}));
}

TEST(TensorParallel, ALocalStateOfSplitLayersLoadsOnlyOnTheMeshThatSavedIt) {
  TempDir dir;
  const auto folder = (dir.path() / "ckpt").string();
  save_tp_fsdp_state(folder, FsdpStateDictType::kLocalStateDict);
  auto options = mesh_options({"", 1, 4, 1});
  options.fsdp_plugin = FullyShardedDataParallelPlugin{.state_dict_type = FsdpStateDictType::kLocalStateDict};
  run_accelerators(
      4,
      [&](const Accelerator& acc, int) {
        auto net = make_net();
        auto model = acc.prepare_model(net);
        EXPECT_THAT(error_of([&] { acc.load_state(folder); }),
                    ::testing::HasSubstr("was saved by 4 (2 sharded x tp_size 2) processes as a LOCAL_STATE_DICT, "
                                         "which only loads on as many; this job has 4"));
      },
      options);
}

}  // namespace
}  // namespace accelerate::testing
