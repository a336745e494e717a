// Activation checkpointing through `accelerate::forward` (ModelHook::checkpoints_activations): a
// checkpointed module keeps none of its intermediate tensors after its forward, runs again in the
// backward pass, and its outputs and every gradient equal those of the ordinary forward — with
// dropout (the recomputation draws the same masks), under autocast, with integer inputs, inside a
// Sequential (its elements, or the Sequential whole), with several outputs, non-tensor arguments
// and undefined ones, and with a weight used again in the same autocast region. A recomputation
// that disagrees with the first run, gradients of gradients and partial gradients are refused by
// name.
#include "accelerate/hooks.h"
#include "accelerate/utils/autocast.h"
#include "detail/torch_compat.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>
#include <tuple>

namespace accelerate::testing {
namespace {

class Checkpoint final : public ModelHook {
 public:
  void pre_forward(torch::nn::Module&, std::vector<at::Tensor>&) override { ++pre; }
  void post_forward(torch::nn::Module&, std::vector<at::Tensor>&) override { ++post; }
  bool checkpoints_activations() const override { return true; }
  int pre = 0;
  int post = 0;
};

using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// Counts its forwards and keeps a weak reference to its hidden activation, which the ordinary
// forward's graph keeps alive for the backward pass.
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(double dropout = 0.0)
      : fc1(register_module("fc1", torch::nn::Linear(4, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 4))),
        dropout(dropout) {}
  torch::Tensor forward(const torch::Tensor& x) {
    ++calls;
    auto h = torch::relu(fc1(x));
    if (dropout > 0) h = torch::dropout(h, dropout, /*train=*/true);
    hidden.emplace(h.getIntrusivePtr());
    return fc2(h) + x;
  }
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
  double dropout;
  int calls = 0;
  std::optional<WeakTensor> hidden;
};
TORCH_MODULE(Mlp);

template <typename M>
M copy_of(const M& from, M to) {
  torch::NoGradGuard no_grad;
  auto source = from->parameters();
  auto target = to->parameters();
  for (size_t i = 0; i < source.size(); ++i) target[i].copy_(source[i]);
  return to;
}

void expect_same_gradients(const torch::nn::Module& a, const torch::nn::Module& b, double rtol = 1e-6,
                           double atol = 1e-7) {
  const auto pa = a.named_parameters();
  const auto pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) {
    const auto& other = pb[item.key()];
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    ASSERT_TRUE(other.grad().defined()) << item.key() << " got no gradient";
    EXPECT_TRUE(torch::allclose(item.value().grad(), other.grad(), rtol, atol))
        << item.key() << "\n" << item.value().grad() << "\n" << other.grad();
  }
}

TEST(ActivationCheckpointing, OutputsAndGradientsEqualTheOrdinaryForwardWhileNoActivationIsKept) {
  torch::manual_seed(0);
  Mlp plain;
  Mlp checkpointed = copy_of(plain, Mlp());
  auto hook = std::make_shared<Checkpoint>();
  add_hook_to_module(*checkpointed, hook);
  auto x1 = torch::randn({3, 4}).requires_grad_();
  auto x2 = x1.detach().clone().requires_grad_();

  auto y1 = accelerate::forward(plain, x1);
  auto y2 = accelerate::forward(checkpointed, x2);
  EXPECT_FALSE(plain->hidden->expired());        // kept by the graph for the backward pass
  EXPECT_TRUE(checkpointed->hidden->expired());  // freed as soon as the forward returned
  EXPECT_EQ(checkpointed->calls, 1);
  EXPECT_EQ(hook->pre, 1);
  EXPECT_EQ(hook->post, 1);
  EXPECT_TRUE(torch::equal(y1, y2));
  ASSERT_TRUE(y2.requires_grad());

  (y1 * y1).sum().backward();
  (y2 * y2).sum().backward();
  EXPECT_EQ(checkpointed->calls, 2);  // once more, in the backward pass
  EXPECT_EQ(hook->pre, 1);            // the hook ran around the first run only
  EXPECT_EQ(hook->post, 1);
  expect_same_gradients(*plain, *checkpointed);
  EXPECT_TRUE(torch::allclose(x1.grad(), x2.grad(), 1e-6, 1e-7));
}

TEST(ActivationCheckpointing, DropoutDrawsTheSameMasksAgainAndTheGeneratorMovesOnAsWithout) {
  torch::manual_seed(1);
  Mlp plain(0.5);
  Mlp checkpointed = copy_of(plain, Mlp(0.5));
  add_hook_to_module(*checkpointed, std::make_shared<Checkpoint>());
  auto x = torch::randn({5, 4});

  torch::manual_seed(7);
  auto x1 = x.clone().requires_grad_();
  accelerate::forward(plain, x1).pow(2).sum().backward();
  const auto next1 = torch::rand({4});

  torch::manual_seed(7);
  auto x2 = x.clone().requires_grad_();
  accelerate::forward(checkpointed, x2).pow(2).sum().backward();
  const auto next2 = torch::rand({4});

  EXPECT_EQ(checkpointed->calls, 2);
  expect_same_gradients(*plain, *checkpointed);
  EXPECT_TRUE(torch::allclose(x1.grad(), x2.grad(), 1e-6, 1e-7));
  EXPECT_TRUE(torch::equal(next1, next2)) << "the recomputation left the caller's generator elsewhere";
}

TEST(ActivationCheckpointing, TheRecomputationRunsInTheFirstRunsAutocastPrecision) {
  torch::manual_seed(2);
  Mlp plain;
  Mlp checkpointed = copy_of(plain, Mlp());
  add_hook_to_module(*checkpointed, std::make_shared<Checkpoint>());
  auto x1 = torch::randn({3, 4}).requires_grad_();
  auto x2 = x1.detach().clone().requires_grad_();
  torch::Tensor y1;
  torch::Tensor y2;
  {
    AutocastGuard autocast(c10::kCPU, PrecisionType::kBf16);
    y1 = accelerate::forward(plain, x1);
    y2 = accelerate::forward(checkpointed, x2);
  }
  EXPECT_TRUE(torch::equal(y1, y2));
  // The backward pass runs outside the autocast region, as a training loop's does.
  y1.to(torch::kFloat).pow(2).sum().backward();
  y2.to(torch::kFloat).pow(2).sum().backward();
  expect_same_gradients(*plain, *checkpointed);
  EXPECT_FALSE(detail::compat::is_autocast_enabled(c10::kCPU)) << "the recomputation left autocast on";
}

struct TaggerImpl : torch::nn::Module {
  TaggerImpl()
      : embed(register_module("embed", torch::nn::Embedding(10, 4))),
        fc(register_module("fc", torch::nn::Linear(4, 3))) {}
  // Several outputs, one of them integer; a non-tensor argument.
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& ids, double scale) {
    ++calls;
    auto logits = fc(torch::tanh(embed(ids))) * scale;
    return {logits, logits.argmax(-1)};
  }
  torch::nn::Embedding embed;
  torch::nn::Linear fc;
  int calls = 0;
};
TORCH_MODULE(Tagger);

TEST(ActivationCheckpointing, IntegerInputsSeveralOutputsAndNonTensorArgumentsStillGiveEveryGradient) {
  torch::manual_seed(3);
  Tagger plain;
  Tagger checkpointed = copy_of(plain, Tagger());
  add_hook_to_module(*checkpointed, std::make_shared<Checkpoint>());
  const auto ids = torch::tensor({{1, 4, 9}, {0, 4, 2}});
  auto [l1, a1] = accelerate::forward(plain, ids, 0.5);
  auto [l2, a2] = accelerate::forward(checkpointed, ids, 0.5);
  EXPECT_TRUE(torch::equal(l1, l2));
  EXPECT_TRUE(torch::equal(a1, a2));
  EXPECT_FALSE(a2.requires_grad());
  l1.pow(2).sum().backward();
  l2.pow(2).sum().backward();
  EXPECT_EQ(checkpointed->calls, 2);
  expect_same_gradients(*plain, *checkpointed);  // though no input required a gradient
}

TEST(ActivationCheckpointing, WithoutGradientsTheModuleRunsOnceAndRecordsNothing) {
  Mlp checkpointed;
  auto hook = std::make_shared<Checkpoint>();
  add_hook_to_module(*checkpointed, hook);
  torch::NoGradGuard no_grad;
  auto y = accelerate::forward(checkpointed, torch::randn({2, 4}));
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(checkpointed->calls, 1);
  EXPECT_EQ(hook->pre, 1);
  EXPECT_EQ(hook->post, 1);
}

// Two Mlps in a Sequential, checkpointed element by element or (`whole`) through the
// Sequential's own hook, against the same Sequential without hooks.
void expect_sequential_checkpointed(bool whole) {
  torch::manual_seed(4);
  Mlp a;
  Mlp b;
  torch::nn::Sequential plain(a, b);
  Mlp ca = copy_of(a, Mlp());
  Mlp cb = copy_of(b, Mlp());
  torch::nn::Sequential checkpointed(ca, cb);
  if (whole) {
    add_hook_to_module(*checkpointed, std::make_shared<Checkpoint>());
  } else {
    add_hook_to_module(*ca, std::make_shared<Checkpoint>());
    add_hook_to_module(*cb, std::make_shared<Checkpoint>());
  }
  auto x1 = torch::randn({3, 4}).requires_grad_();
  auto x2 = x1.detach().clone().requires_grad_();
  auto y1 = accelerate::forward(plain, x1);
  auto y2 = accelerate::forward(checkpointed, x2);
  EXPECT_TRUE(ca->hidden->expired());
  EXPECT_TRUE(cb->hidden->expired());
  y1.pow(2).sum().backward();
  y2.pow(2).sum().backward();
  EXPECT_EQ(ca->calls, 2);
  EXPECT_EQ(cb->calls, 2);
  expect_same_gradients(*plain, *checkpointed);
  EXPECT_TRUE(torch::allclose(x1.grad(), x2.grad(), 1e-6, 1e-7));
}

TEST(ActivationCheckpointing, TheElementsOfASequentialAreCheckpointedToo) { expect_sequential_checkpointed(false); }

TEST(ActivationCheckpointing, ASequentialWhoseOwnHookAsksIsCheckpointedWhole) { expect_sequential_checkpointed(true); }

// An optional argument and an optional output, both left undefined.
struct MaskedImpl : torch::nn::Module {
  MaskedImpl() : fc(register_module("fc", torch::nn::Linear(3, 3))) {}
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& mask) {
    ++calls;
    auto y = torch::sigmoid(fc(x));
    if (mask.defined()) y = y * mask;
    return {y, torch::Tensor()};
  }
  torch::nn::Linear fc;
  int calls = 0;
};
TORCH_MODULE(Masked);

TEST(ActivationCheckpointing, UndefinedArgumentsAndOutputsPassThrough) {
  torch::manual_seed(6);
  Masked plain;
  Masked checkpointed = copy_of(plain, Masked());
  add_hook_to_module(*checkpointed, std::make_shared<Checkpoint>());
  auto x1 = torch::randn({2, 3}).requires_grad_();
  auto x2 = x1.detach().clone().requires_grad_();
  auto [y1, none1] = accelerate::forward(plain, x1, torch::Tensor());
  auto [y2, none2] = accelerate::forward(checkpointed, x2, torch::Tensor());
  EXPECT_FALSE(none2.defined());
  EXPECT_TRUE(torch::equal(y1, y2));
  y1.sum().backward();
  y2.sum().backward();
  EXPECT_EQ(checkpointed->calls, 2);
  expect_same_gradients(*plain, *checkpointed);
  EXPECT_TRUE(torch::allclose(x1.grad(), x2.grad(), 1e-6, 1e-7));
}

TEST(ActivationCheckpointing, AWeightUsedAgainInTheSameAutocastRegionKeepsItsGradient) {
  // The first run records nothing; had autocast cached its cast of the weight, the second use
  // below would take that cast, which has no history, and the weight would lose its gradient.
  torch::manual_seed(8);
  Mlp plain;
  Mlp checkpointed = copy_of(plain, Mlp());
  add_hook_to_module(*checkpointed, std::make_shared<Checkpoint>());
  const auto x = torch::randn({3, 4});
  const auto run = [&](Mlp& m) {
    AutocastGuard autocast(c10::kCPU, PrecisionType::kBf16);
    auto y = accelerate::forward(m, x);
    return (y + m->fc1(x).sum(-1, true)).to(torch::kFloat);  // fc1's weight again, without the hook
  };
  run(plain).pow(2).sum().backward();
  run(checkpointed).pow(2).sum().backward();
  // The plain run sums the two uses' gradients in bf16 (one cached cast), the checkpointed one in
  // fp32 (two casts): they agree to bf16's precision. A lost gradient would be off by half.
  expect_same_gradients(*plain, *checkpointed, 2e-2, 1e-2);
}

TEST(ActivationCheckpointing, GradientsOfGradientsAndPartialGradientsAreRefusedByName) {
  Mlp checkpointed;
  add_hook_to_module(*checkpointed, std::make_shared<Checkpoint>());
  auto x = torch::randn({2, 4}).requires_grad_();
  auto y = accelerate::forward(checkpointed, x).sum();
  EXPECT_THROWS_WITH(torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true),
                     "torch::autograd::grad and backward(..., inputs) are not supported");
  EXPECT_THROWS_WITH(y.backward({}, /*retain_graph=*/true, /*create_graph=*/true),
                     "backward with create_graph=true (gradients of gradients) through a checkpointed module is "
                     "not supported");
  y.backward();  // the ordinary backward still works after both refusals
  EXPECT_TRUE(x.grad().defined());
  EXPECT_TRUE(checkpointed->fc1->weight.grad().defined());
}

// Returns one tensor more each time it runs.
struct FickleImpl : torch::nn::Module {
  FickleImpl() : fc(register_module("fc", torch::nn::Linear(2, 2))) {}
  std::vector<torch::Tensor> forward(const torch::Tensor& x) {
    std::vector<torch::Tensor> out;
    for (int i = 0; i <= calls; ++i) out.push_back(fc(x) * (i + 1));
    ++calls;
    return out;
  }
  torch::nn::Linear fc;
  int calls = 0;
};
TORCH_MODULE(Fickle);

TEST(ActivationCheckpointing, ARecomputationThatDiffersFromTheFirstRunIsNamed) {
  Fickle fickle;
  add_hook_to_module(*fickle, std::make_shared<Checkpoint>());
  auto out = accelerate::forward(fickle, torch::ones({1, 2}));
  ASSERT_EQ(out.size(), 1u);
  EXPECT_THROWS_WITH(out[0].sum().backward(),
                     "the recomputed forward returned 2 tensors (0 undefined) where the first run returned 1 (0 "
                     "undefined)");
}

}  // namespace
}  // namespace accelerate::testing
