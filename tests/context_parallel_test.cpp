// Context parallelism with ranks as threads: the parallel degrees resolved in one place
// (ParallelismConfig's names, JSON and refusals), the mesh with its cp dimension and sub-meshes,
// the scope that splits and restores sequences, ring attention against attention over the whole
// sequence written out here in float64 (outputs and gradients, both strategies, causal and not,
// fp32 and bf16, cp 2 and 4, a length the group does not divide), and training under cp that
// follows the single-process run.
#include "accelerate/accelerator.h"
#include "accelerate/attention.h"
#include "accelerate/hooks.h"
#include "accelerate/utils/environment.h"
#include "support/accelerators.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;
using Names = std::vector<std::string>;

// ---- ParallelismConfig ------------------------------------------------------------------------

TEST(ParallelismConfig, ResolvedSizesNameTheDimensionsEachParallelismSpans) {
  auto c = ParallelismConfig{.dp_replicate_size = 2, .tp_size = 2, .cp_size = 2}.resolved(16);
  EXPECT_EQ(*c.dp_shard_size, 2);  // what is left of the processes
  EXPECT_EQ(c.total_size(), 16);
  EXPECT_EQ(c.data_parallel_size(), 4);
  EXPECT_EQ(c.non_data_parallel_size(), 4);
  EXPECT_TRUE(c.dp_replicate_enabled() && c.dp_shard_enabled() && c.tp_enabled() && c.cp_enabled());
  EXPECT_EQ(c.dp_dim_names(), (Names{"dp_replicate", "dp_shard"}));
  EXPECT_EQ(c.non_dp_dim_names(), (Names{"tp", "cp"}));
  EXPECT_EQ(c.dp_shard_cp_dim_names(), (Names{"dp_shard", "cp"}));
  EXPECT_EQ(c.dp_cp_dim_names(), (Names{"dp_replicate", "dp_shard", "cp"}));
  EXPECT_EQ(c.fsdp_dim_names(), (Names{"dp_replicate", "dp_shard_cp"}));
  EXPECT_EQ(c.active_mesh_dims(), (Names{"dp_replicate", "dp_shard", "tp", "cp"}));
  EXPECT_EQ(c.cp_backend, "torch");
  EXPECT_EQ(c.cp_handler.cp_comm_strategy, "allgather");

  auto plain = ParallelismConfig{.dp_shard_size = 4}.resolved(4);
  EXPECT_EQ(plain.dp_dim_names(), (Names{"dp_shard"}));
  EXPECT_TRUE(plain.non_dp_dim_names().empty());
  EXPECT_EQ(plain.dp_shard_cp_dim_names(), (Names{"dp_shard"}));
  EXPECT_EQ(plain.fsdp_dim_names(), (Names{"dp_shard_cp"}));
  EXPECT_FALSE(plain.cp_enabled());
}

TEST(ParallelismConfig, TheEnvironmentFillsWhatTheConfigLeavesEmpty) {
  auto env = patch_environment({{"PARALLELISM_CONFIG_CP_SIZE", "2"}, {"PARALLELISM_CONFIG_CP_COMM_STRATEGY", "alltoall"}});
  auto c = ParallelismConfig{}.resolved(4);
  EXPECT_EQ(*c.cp_size, 2);
  EXPECT_EQ(*c.dp_shard_size, 2);
  EXPECT_EQ(c.cp_handler.cp_comm_strategy, "alltoall");
  auto given = ParallelismConfig{.cp_size = 1, .cp_handler = {.cp_comm_strategy = "allgather"}}.resolved(4);
  EXPECT_EQ(*given.cp_size, 1);  // a given value wins over the environment
  EXPECT_EQ(given.cp_handler.cp_comm_strategy, "allgather");
}

TEST(ParallelismConfig, JsonRoundTripsAndUnknownFieldsAreRefused) {
  ParallelismConfig c{.dp_shard_size = 2, .cp_size = 2, .cp_handler = {.cp_comm_strategy = "alltoall"}};
  const auto json = nlohmann::json::parse(c.to_json());
  EXPECT_EQ(json["dp_shard_size"], 2);
  EXPECT_EQ(json["cp_size"], 2);
  EXPECT_TRUE(json["tp_size"].is_null());
  EXPECT_EQ(json["cp_handler"]["cp_comm_strategy"], "alltoall");
  auto back = ParallelismConfig::from_json(c.to_json());
  EXPECT_EQ(back.dp_shard_size, c.dp_shard_size);
  EXPECT_EQ(back.cp_size, c.cp_size);
  EXPECT_FALSE(back.tp_size.has_value());
  EXPECT_EQ(back.cp_handler.cp_comm_strategy, "alltoall");
  EXPECT_THAT(error_of([] { ParallelismConfig::from_json(R"({"cp_sise": 2})"); }), HasSubstr("unknown field \"cp_sise\""));
  EXPECT_THAT(error_of([] { ParallelismConfig::from_json(R"({"sp_size": 2})"); }), HasSubstr("sequence parallelism"));
  EXPECT_THAT(error_of([] { ParallelismConfig::from_json(R"({"cp_size": "2"})"); }), HasSubstr("cp_size must be an "
                                                                                                 "integer"));
  EXPECT_THAT(error_of([] { ParallelismConfig::from_json("[1]"); }), HasSubstr("expected a JSON object"));
}

TEST(ParallelismConfig, BadSizesBackendsAndStrategiesAreRefusedByName) {
  EXPECT_THAT(error_of([] { ParallelismConfig{.dp_shard_size = 2, .cp_size = 2}.resolved(8); }),
              HasSubstr("dp_replicate_size (1) x dp_shard_size (2) x tp_size (1) x cp_size (2) must equal the number "
                        "of processes, 8"));
  EXPECT_THAT(error_of([] { ParallelismConfig{.cp_size = 0}.resolved(2); }), HasSubstr("cp_size must be at least 1"));
  EXPECT_THAT(error_of([] { ParallelismConfig{.cp_size = 2, .cp_backend = "ring"}.resolved(2); }),
              HasSubstr("cp_backend must be \"torch\""));
  EXPECT_THAT(error_of([] { ParallelismConfig{.cp_size = 2, .cp_handler = {.cp_comm_strategy = "p2p"}}.resolved(2); }),
              HasSubstr("cp_comm_strategy must be \"allgather\" or \"alltoall\", got \"p2p\""));
  ParallelismConfig unbuilt{.cp_size = 2};
  EXPECT_THAT(error_of([&] { unbuilt.get_device_mesh(); }), HasSubstr("no mesh has been built yet"));
}

// ---- the mesh -------------------------------------------------------------------------------

TEST(DeviceMesh, ContextParallelismSitsBetweenTheShardAndTensorDimensionsAndSubMeshesFlatten) {
  run_accelerators(
      8,
      [&](const Accelerator& acc, int rank) {
        auto mesh = *acc.torch_device_mesh();
        EXPECT_EQ(mesh.mesh_dim_names(), (Names{"dp_replicate", "dp_shard", "cp", "tp"}));
        EXPECT_EQ(mesh.shape(), (std::vector<int>{1, 2, 2, 2}));
        const int t = rank % 2, c = (rank / 2) % 2, s = rank / 4;
        EXPECT_EQ(mesh.group_ranks("cp"), (std::vector<int>{s * 4 + t, s * 4 + 2 + t}));
        EXPECT_EQ(mesh.group_ranks("dp_shard"), (std::vector<int>{c * 2 + t, 4 + c * 2 + t}));
        EXPECT_EQ(mesh.group_ranks("dp"), mesh.group_ranks("dp_shard"));
        EXPECT_EQ(mesh.group_ranks("dp_shard_cp"), (std::vector<int>{t, 2 + t, 4 + t, 6 + t}));
        EXPECT_EQ(mesh.group_ranks("dp_cp"), mesh.group_ranks("dp_shard_cp"));
        EXPECT_EQ(mesh.size("dp_shard_cp"), 4);
        EXPECT_EQ(mesh["tp"].size(), 2);
        EXPECT_EQ(mesh["tp"].get_local_rank(), t);
        EXPECT_EQ(mesh["cp"].mesh_dim_names(), (Names{"cp"}));
        auto joined = mesh[{"dp_shard", "cp"}];
        EXPECT_EQ(joined.mesh_dim_names(), (Names{"dp_shard", "cp"}));
        EXPECT_EQ(joined.shape(), (std::vector<int>{2, 2}));
        EXPECT_EQ(joined.get_local_rank(), rank / 2);
        for (const auto& group : std::vector<PartialState>{joined.get_group(), mesh.get_group("cp"), mesh["dp_cp"].get_group()}) {
          auto sum = reduce(group, torch::tensor({int64_t{1} << rank}), "sum");
          EXPECT_GT(sum.item<int64_t>() & (int64_t{1} << rank), 0);
          EXPECT_EQ(__builtin_popcountll(static_cast<unsigned long long>(sum.item<int64_t>())), group.num_processes());
        }
        auto sum = reduce(joined.get_group(), torch::tensor({int64_t{1} << rank}), "sum").item<int64_t>();
        EXPECT_EQ(sum, (int64_t{1} << t) + (int64_t{1} << (2 + t)) + (int64_t{1} << (4 + t)) + (int64_t{1} << (6 + t)));
        // The data loaders split over "dp"; gradients are averaged over "dp_cp".
        EXPECT_EQ(acc.data_parallel_state().num_processes(), 2);
        EXPECT_EQ(acc.gradient_sync_state().num_processes(), 4);
        EXPECT_THAT(error_of([&] { mesh[{"cp", "dp_shard"}]; }), HasSubstr("outermost first"));
        EXPECT_THAT(error_of([&] { mesh["tp"]["cp"]; }), HasSubstr("no dimension named \"cp\" in this mesh"));
        EXPECT_THAT(error_of([&] { mesh[{"dp_shard", "tp"}].get_group(); }), HasSubstr("have no process group"));
        EXPECT_THAT(error_of([&] { mesh.size("sp"); }), HasSubstr("no dimension named \"sp\""));
        const auto config = *acc.parallelism_config();
        EXPECT_EQ(*config.cp_size, 2);
        ASSERT_TRUE(config.device_mesh);
        EXPECT_EQ(config.device_mesh->shape(), mesh.shape());
      },
      {.parallelism_config = ParallelismConfig{.dp_shard_size = 2, .tp_size = 2, .cp_size = 2}});
}

// ---- ring attention -------------------------------------------------------------------------

// Deterministic values without a shared generator (ranks are threads).
at::Tensor values(std::vector<int64_t> sizes, double phase) {
  int64_t n = 1;
  for (auto s : sizes) n *= s;
  return (torch::arange(n, torch::kDouble) * 0.731 + phase).sin().reshape(sizes);
}

// Attention over the whole sequence, written out in float64, with its gradients for the loss
// sum(out · weights).
struct Whole {
  at::Tensor out, dq, dk, dv;
};
Whole whole_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& w, bool causal) {
  auto q64 = q.to(torch::kDouble).requires_grad_(), k64 = k.to(torch::kDouble).requires_grad_(),
       v64 = v.to(torch::kDouble).requires_grad_();
  auto scores = torch::matmul(q64, k64.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(-1)));
  if (causal) {
    scores = scores.masked_fill(torch::ones({q.size(-2), k.size(-2)}, torch::kBool).triu(1), -INFINITY);
  }
  auto out = torch::matmul(scores.softmax(-1), v64);
  (out * w.to(torch::kDouble)).sum().backward();
  return {out.detach(), q64.grad(), k64.grad(), v64.grad()};
}

void expect_ring_matches_whole(const PartialState& group, const std::string& strategy, bool causal,
                               torch::Dtype dtype) {
  const int64_t B = 2, H = 2, L = 13, E = 8;
  SCOPED_TRACE(strategy + (causal ? " causal " : " no mask ") + c10::toString(dtype) + " cp " +
               std::to_string(group.num_processes()));
  auto q = values({B, H, L, E}, 0.1).to(dtype), k = values({B, H, L, E}, 0.7).to(dtype),
       v = values({B, H, L, E}, 1.3).to(dtype), w = values({B, H, L, E}, 2.9).to(dtype);
  const auto want = whole_attention(q, k, v, w, causal);
  ContextParallel cp(group, {q, k, v, w}, {2, 2, 2, 2}, {}, strategy);
  ASSERT_TRUE(cp.enabled());
  const auto pos = cp.positions();
  ASSERT_EQ(q.size(2), pos.size(0));
  auto qs = q.clone().requires_grad_(), ks = k.clone().requires_grad_(), vs = v.clone().requires_grad_();
  auto out = accelerate::scaled_dot_product_attention(qs, ks, vs, std::nullopt, 0.0, causal);
  EXPECT_EQ(out.scalar_type(), dtype);
  (out * w).sum().backward();
  const double tol = dtype == torch::kFloat ? 1e-5 : 3e-2;
  const auto close = [&](const at::Tensor& got, const at::Tensor& whole, const char* what) {
    auto expected = whole.index_select(2, pos);
    EXPECT_TRUE(torch::allclose(got.to(torch::kDouble), expected, tol, tol))
        << what << ": largest difference " << (got.to(torch::kDouble) - expected).abs().max().item<double>();
  };
  close(out.detach(), want.out, "output");
  close(qs.grad(), want.dq, "query gradient");
  close(ks.grad(), want.dk, "key gradient");
  close(vs.grad(), want.dv, "value gradient");
}

class RingAttention : public ::testing::TestWithParam<int> {};

TEST_P(RingAttention, OutputsAndGradientsEqualAttentionOverTheWholeSequence) {
  run_accelerators(GetParam(), [&](const Accelerator& acc, int) {
    for (const char* strategy : {"allgather", "alltoall"}) {
      for (bool causal : {true, false}) {
        for (auto dtype : {torch::kFloat, torch::kBFloat16}) expect_ring_matches_whole(acc.state().partial_state(), strategy, causal, dtype);
      }
    }
  });
}
INSTANTIATE_TEST_SUITE_P(ContextParallel, RingAttention, ::testing::Values(2, 4),
                         [](const auto& info) { return "cp" + std::to_string(info.param); });

// Activation checkpointing runs the attention again in the backward pass: the recomputation runs
// as ring attention over the first run's group and pieces, even after the scope ended.
TEST(ContextParallel, ACheckpointedAttentionRecomputesOverTheFirstRunsPiecesAfterTheScopeEnded) {
  run_accelerators(2, [&](const Accelerator& acc, int) {
    const int64_t B = 1, H = 2, L = 11, E = 4;
    auto q = values({B, H, L, E}, 0.2), k = values({B, H, L, E}, 0.5), v = values({B, H, L, E}, 0.9),
         w = values({B, H, L, E}, 1.7);
    q = q.to(torch::kFloat), k = k.to(torch::kFloat), v = v.to(torch::kFloat), w = w.to(torch::kFloat);
    const auto want = whole_attention(q, k, v, w, true);
    torch::nn::Module holder;
    at::Tensor qs, ks, vs, out, pos;
    {
      ContextParallel cp(acc.state().partial_state(), {q, k, v, w}, {2, 2, 2, 2}, /*no_restore_buffers=*/{w});
      pos = cp.positions();
      qs = q.clone().requires_grad_(), ks = k.clone().requires_grad_(), vs = v.clone().requires_grad_();
      out = detail::checkpointed_forward(holder, {qs, ks, vs}, [](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{
            accelerate::scaled_dot_product_attention(in[0], in[1], in[2], std::nullopt, 0.0, true)};
      })[0];
    }
    (out * w).sum().backward();  // after the scope: the recomputation must still be ring attention
    EXPECT_TRUE(torch::allclose(qs.grad().to(torch::kDouble), want.dq.index_select(2, pos), 1e-5, 1e-5));
    EXPECT_TRUE(torch::allclose(ks.grad().to(torch::kDouble), want.dk.index_select(2, pos), 1e-5, 1e-5));
    EXPECT_TRUE(torch::allclose(vs.grad().to(torch::kDouble), want.dv.index_select(2, pos), 1e-5, 1e-5));
  });
}

// ---- the scope --------------------------------------------------------------------------------

TEST(ContextParallel, TheScopeSplitsInPlaceLoadBalancedAndRestoresAllButTheKeptPieces) {
  run_accelerators(
      2,
      [&](const Accelerator& acc, int rank) {
        auto ids = torch::arange(2 * 11).reshape({2, 11});
        auto labels = ids + 100;
        auto alias = ids;  // another handle to the same tensor sees the piece
        {
          auto cp = acc.maybe_context_parallel({ids, labels}, {1, -1}, {labels});
          ASSERT_TRUE(cp.enabled());
          EXPECT_EQ(cp.sequence_length(), 11);
          // 11 tokens in 4 chunks of 3, 3, 3, 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
          const auto want = rank == 0 ? std::vector<int64_t>{0, 1, 2, 9, 10} : std::vector<int64_t>{3, 4, 5, 6, 7, 8};
          EXPECT_TRUE(torch::equal(cp.positions(), torch::tensor(want)));
          EXPECT_TRUE(torch::equal(alias, torch::stack({torch::tensor(want), torch::tensor(want) + 11})));
          EXPECT_TRUE(torch::equal(labels, alias + 100));
          EXPECT_DOUBLE_EQ(cp.loss_weight(), static_cast<double>(want.size()) * 2 / 11);
          // The pieces of a per-token output come back whole, in order, on every process.
          EXPECT_TRUE(torch::equal(cp.gather_sequence(alias * 10, 1), torch::arange(22).reshape({2, 11}) * 10));
          // Both processes read the same batch: gathering for metrics takes it once.
          EXPECT_TRUE(torch::equal(acc.gather_for_metrics(torch::tensor({7})), torch::tensor({7})));
          // Inside the scope attention takes this process's piece only, causal or unmasked.
          auto q = torch::ones({1, 1, static_cast<int64_t>(want.size()), 4});
          EXPECT_THAT(error_of([&] { accelerate::scaled_dot_product_attention(q, q, q, torch::ones({1}), 0.0); }),
                      HasSubstr("is_causal or no mask"));
          EXPECT_THAT(error_of([&] { accelerate::scaled_dot_product_attention(q, q, q, std::nullopt, 0.1); }),
                      HasSubstr("ring attention has no dropout"));
          auto other = torch::ones({1, 1, 11, 4});
          EXPECT_THAT(error_of([&] { accelerate::scaled_dot_product_attention(other, other, other); }),
                      HasSubstr("this process's piece of the sequence"));
        }
        EXPECT_TRUE(torch::equal(ids, torch::arange(22).reshape({2, 11})));  // restored
        EXPECT_EQ(labels.size(1), rank == 0 ? 5 : 6);                        // kept as its piece
        // Outside the scope attention is local again.
        auto x = torch::ones({1, 1, 3, 4});
        EXPECT_EQ(accelerate::scaled_dot_product_attention(x, x, x).size(2), 3);
      },
      {.parallelism_config = ParallelismConfig{.cp_size = 2}});
}

TEST(ContextParallel, WithoutContextParallelismTheScopeChangesNothing) {
  run_accelerators(2, [&](const Accelerator& acc, int) {
    auto ids = torch::arange(8).reshape({1, 8});
    auto cp = acc.maybe_context_parallel({ids}, {1});
    EXPECT_FALSE(cp.enabled());
    EXPECT_EQ(ids.size(1), 8);
    EXPECT_DOUBLE_EQ(cp.loss_weight(), 1.0);
    auto x = torch::ones({1, 1, 8, 4});
    EXPECT_EQ(accelerate::scaled_dot_product_attention(x, x, x).size(2), 8);
  });
}

TEST(ContextParallel, BadBuffersAreRefusedByNameBeforeAnythingIsSplit) {
  run_accelerators(
      2,
      [&](const Accelerator& acc, int) {
        auto a = torch::zeros({2, 8}), b = torch::zeros({2, 9}), other = torch::zeros({8});
        EXPECT_THAT(error_of([&] { acc.maybe_context_parallel({a, b}, {1, 1}); }),
                    HasSubstr("buffer 0 has 8 along its sequence dimension, buffer 1 has 9"));
        EXPECT_THAT(error_of([&] { acc.maybe_context_parallel({a}, {1, 1}); }), HasSubstr("1 buffers but 2"));
        EXPECT_THAT(error_of([&] { acc.maybe_context_parallel({a}, {2}); }), HasSubstr("buffer_seq_dims[0] is 2"));
        EXPECT_THAT(error_of([&] { acc.maybe_context_parallel({a}, {1}, {other}); }),
                    HasSubstr("no_restore_buffers must be a subset of buffers"));
        EXPECT_THAT(error_of([&] { acc.maybe_context_parallel({a, a}, {1, 1}); }), HasSubstr("the same tensor as"));
        auto leaf = torch::zeros({2, 8}, torch::requires_grad());
        EXPECT_THAT(error_of([&] { acc.maybe_context_parallel({leaf}, {1}); }), HasSubstr("requires grad"));
        auto short_one = torch::zeros({2, 3});
        EXPECT_THAT(error_of([&] { acc.maybe_context_parallel({short_one}, {1}); }), HasSubstr("too short"));
        EXPECT_EQ(a.size(1), 8);  // nothing was split
        EXPECT_EQ(b.size(1), 9);
      },
      {.parallelism_config = ParallelismConfig{.cp_size = 2}});
}

// ---- training -----------------------------------------------------------------------------------

constexpr int64_t kVocab = 11, kDim = 8, kLength = 13, kBatch = 4;

// A one-layer causal transformer language model whose attention goes through the library.
struct TinyLmImpl : torch::nn::Module {
  TinyLmImpl()
      : tok(register_module("tok", torch::nn::Embedding(kVocab, kDim))),
        pos(register_module("pos", torch::nn::Embedding(kLength, kDim))),
        // No bias: a key bias moves every score of a query alike, so its true gradient is zero and
        // AdamW would turn rounding noise into full steps.
        qkv(register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(kDim, 3 * kDim).bias(false)))),
        proj(register_module("proj", torch::nn::Linear(kDim, kDim))),
        head(register_module("head", torch::nn::Linear(kDim, kVocab))) {}
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions) {
    auto x = tok(ids) + pos(positions);
    auto parts = qkv(x).view({ids.size(0), ids.size(1), 3, 2, kDim / 2}).permute({2, 0, 3, 1, 4});
    auto y = accelerate::scaled_dot_product_attention(parts[0], parts[1], parts[2], std::nullopt, 0.0, true);
    return head(x + proj(y.transpose(1, 2).reshape({ids.size(0), ids.size(1), kDim})));
  }
  torch::nn::Embedding tok, pos;
  torch::nn::Linear qkv, proj, head;
};
TORCH_MODULE(TinyLm);

TinyLm tiny_lm() {
  TinyLm net;
  torch::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : net->parameters()) p.copy_(values(p.sizes().vec(), 0.3 * ++i).to(torch::kFloat) * 0.5);
  return net;
}

torch::Tensor batch_ids(int step) { return (torch::arange(kBatch * kLength).reshape({kBatch, kLength}) * (step + 3)) % kVocab; }

std::map<std::string, torch::Tensor> trained_alone(int steps) {
  auto net = tiny_lm();
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(0.05));
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto ids = batch_ids(s), labels = (ids + 1) % kVocab;
    auto logits = net->forward(ids, torch::arange(kLength).expand({kBatch, kLength}));
    torch::nn::functional::cross_entropy(logits.flatten(0, 1), labels.flatten()).backward();
    opt.step();
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

struct CpMesh {
  const char* name;
  int shard, cp;
  bool fsdp;
  const char* strategy;
};
void PrintTo(const CpMesh& m, std::ostream* os) { *os << m.name; }

class ContextParallelTraining : public ::testing::TestWithParam<CpMesh> {};

TEST_P(ContextParallelTraining, ThreeAdamWStepsOnALengthTheGroupDoesNotDivideEqualTheSingleProcessRun) {
  const CpMesh m = GetParam();
  const auto want = trained_alone(3);
  AcceleratorOptions options{.parallelism_config = ParallelismConfig{
                                 .dp_shard_size = m.shard, .cp_size = m.cp, .cp_handler = {m.strategy}}};
  if (m.fsdp) options.fsdp_plugin = FullyShardedDataParallelPlugin{};
  run_accelerators(
      m.shard * m.cp,
      [&](const Accelerator& acc, int) {
        auto net = tiny_lm();
        auto [model, opt] =
            acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05)));
        const auto& dp = acc.data_parallel_state();
        const int64_t rows = kBatch / dp.num_processes();
        for (int s = 0; s < 3; ++s) {
          opt.zero_grad();
          auto ids = batch_ids(s).narrow(0, dp.process_index() * rows, rows).clone();
          auto labels = (ids + 1) % kVocab;
          auto positions = torch::arange(kLength).expand({rows, kLength}).clone();
          auto cp = acc.maybe_context_parallel({ids, labels, positions}, {1, 1, 1}, {ids, labels, positions});
          auto logits = model(ids, positions);
          auto loss = torch::nn::functional::cross_entropy(logits.flatten(0, 1), labels.flatten()) * cp.loss_weight();
          acc.backward(loss);
          opt.step();
        }
        auto got = acc.get_state_dict(model);
        for (const auto& [name, value] : want) {
          ASSERT_TRUE(got.contains(name)) << name;
          EXPECT_TRUE(torch::allclose(got[name], value, 1e-4, 1e-5))
              << name << ": largest difference " << (got[name] - value).abs().max().item().toDouble();
        }
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(ContextParallel, ContextParallelTraining,
                         ::testing::Values(CpMesh{"cp2_ddp_allgather", 1, 2, false, "allgather"},
                                           CpMesh{"cp2_fsdp_alltoall", 1, 2, true, "alltoall"},
                                           CpMesh{"shard2_cp2_fsdp", 2, 2, true, "alltoall"}),
                         [](const auto& info) { return std::string(info.param.name); });

// A sharded checkpoint saved by dp_shard 2 x cp 2 (the model sharded over 4 processes) resumes
// on 2 processes without context parallelism, and the reverse: the weights and the optimizer's
// next step are those of the run that saved.
TEST(ContextParallel, ShardedCheckpointsSavedUnderOneMeshResumeUnderAnother) {
  TempDir dir;
  FullyShardedDataParallelPlugin plugin{.state_dict_type = FsdpStateDictType::kShardedStateDict};
  const auto train = [&](int processes, ParallelismConfig mesh, bool load, const std::string& folder, int steps) {
    std::map<std::string, torch::Tensor> weights;
    run_accelerators(
        processes,
        [&](const Accelerator& acc, int rank) {
          auto net = tiny_lm();
          auto [model, opt] = acc.prepare(
              net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.05)));
          if (load) acc.load_state(folder);
          const auto& dp = acc.data_parallel_state();
          const int64_t rows = kBatch / dp.num_processes();
          for (int s = 0; s < steps; ++s) {
            opt.zero_grad();
            auto ids = batch_ids(s).narrow(0, dp.process_index() * rows, rows).clone();
            auto labels = (ids + 1) % kVocab;
            auto positions = torch::arange(kLength).expand({rows, kLength}).clone();
            auto cp = acc.maybe_context_parallel({ids, labels, positions}, {1, 1, 1}, {ids, labels, positions});
            auto loss =
                torch::nn::functional::cross_entropy(model(ids, positions).flatten(0, 1), labels.flatten()) *
                cp.loss_weight();
            acc.backward(loss);
            opt.step();
          }
          if (!load) acc.save_state(folder);
          auto got = acc.get_state_dict(model);
          if (rank == 0) {
            for (const auto& item : got) weights[item.key()] = item.value().clone();
          }
        },
        {.fsdp_plugin = plugin, .parallelism_config = mesh});
    return weights;
  };
  const auto expect_equal = [](const std::map<std::string, torch::Tensor>& got,
                               const std::map<std::string, torch::Tensor>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, value] : want) {
      EXPECT_TRUE(torch::allclose(got.at(name), value, 1e-4, 1e-5)) << name;
    }
  };
  const ParallelismConfig with_cp{.dp_shard_size = 2, .cp_size = 2}, without{.dp_shard_size = 2};
  const auto saved = train(4, with_cp, false, dir.str() + "/a", 1);
  // The weights as saved, then one more step: the same on the other mesh as on the first.
  expect_equal(train(2, without, true, dir.str() + "/a", 0), saved);
  expect_equal(train(2, without, true, dir.str() + "/a", 1), train(4, with_cp, true, dir.str() + "/a", 1));
  const auto saved_without = train(2, without, false, dir.str() + "/b", 1);
  expect_equal(train(4, with_cp, true, dir.str() + "/b", 0), saved_without);
}

}  // namespace
}  // namespace accelerate::testing
