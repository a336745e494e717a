// accelerate::scaled_dot_product_attention against the attention written out independently here
// (scores, mask, softmax, weighted values, in float64), its gradients included, and each refusal.
// Calls are qualified: argument-dependent lookup also finds LibTorch's at:: function of that name.
#include "accelerate/attention.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>

namespace accelerate {
namespace {

using ::testing::HasSubstr;

// softmax(q kᵀ · scale, masked) v in float64, one query row at a time: `allowed(i, j)` says
// whether query i sees key j, `bias` (when defined) is added to every score.
at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::function<bool(int64_t, int64_t)>& allowed, const at::Tensor& bias, double scale) {
  const auto q64 = q.to(at::kDouble), k64 = k.to(at::kDouble), v64 = v.to(at::kDouble);
  const int64_t L = q.size(-2), S = k.size(-2);
  auto out = at::zeros({q.size(0), q.size(1), L, v.size(-1)}, at::kDouble);
  for (int64_t b = 0; b < q.size(0); ++b) {
    for (int64_t h = 0; h < q.size(1); ++h) {
      for (int64_t i = 0; i < L; ++i) {
        std::vector<double> scores;
        double top = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < S; ++j) {
          double s = (q64[b][h][i] * k64[b][h][j]).sum().item<double>() * scale;
          if (bias.defined()) s += bias.expand({q.size(0), q.size(1), L, S})[b][h][i][j].item<double>();
          if (!allowed(i, j)) s = -std::numeric_limits<double>::infinity();
          scores.push_back(s);
          top = std::max(top, s);
        }
        double total = 0;
        for (auto& s : scores) total += (s = std::exp(s - top));
        for (int64_t j = 0; j < S; ++j) out[b][h][i] += v64[b][h][j] * (scores[static_cast<size_t>(j)] / total);
      }
    }
  }
  return out;
}

struct Inputs {
  at::Tensor q, k, v;
};
Inputs inputs(int64_t L, int64_t S, int64_t E = 8, int64_t Ev = 6) {
  torch::manual_seed(3);
  return {torch::randn({2, 3, L, E}), torch::randn({2, 3, S, E}), torch::randn({2, 3, S, Ev})};
}
const auto everything = [](int64_t, int64_t) { return true; };

void expect_close(const at::Tensor& got, const at::Tensor& want, double tolerance = 1e-5) {
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_LE((got.to(at::kDouble) - want).abs().max().item<double>(), tolerance);
}

TEST(Attention, MatchesTheWrittenOutAttentionWithoutAMask) {
  auto [q, k, v] = inputs(5, 7);
  expect_close(accelerate::scaled_dot_product_attention(q, k, v), reference(q, k, v, everything, {}, 1 / std::sqrt(8.0)));
}

TEST(Attention, IsCausalHidesLaterKeysTopLeftAligned) {
  for (auto [L, S] : {std::pair<int64_t, int64_t>{6, 6}, {4, 6}}) {
    auto [q, k, v] = inputs(L, S);
    auto got = accelerate::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, /*is_causal=*/true);
    expect_close(got, reference(q, k, v, [](int64_t i, int64_t j) { return j <= i; }, {}, 1 / std::sqrt(8.0)));
    // The first query sees only the first key: its output is that key's value.
    expect_close(got.select(2, 0), v.select(2, 0).to(at::kDouble));
  }
}

TEST(Attention, ABooleanMaskKeepsWhereTrueAndAFloatMaskIsAdded) {
  auto [q, k, v] = inputs(5, 7);
  auto keep = torch::rand({5, 7}) > 0.3;
  keep.select(1, 0).fill_(true);  // every query keeps a key
  auto got = accelerate::scaled_dot_product_attention(q, k, v, keep);
  auto keep_at = [&](int64_t i, int64_t j) { return keep[i][j].item<bool>(); };
  expect_close(got, reference(q, k, v, keep_at, {}, 1 / std::sqrt(8.0)));
  auto bias = torch::randn({1, 3, 1, 7});  // per head and key, broadcast over queries
  expect_close(accelerate::scaled_dot_product_attention(q, k, v, bias), reference(q, k, v, everything, bias, 1 / std::sqrt(8.0)));
}

TEST(Attention, ScaleReplacesOneOverTheSquareRootOfE) {
  auto [q, k, v] = inputs(5, 5);
  expect_close(accelerate::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, false, 0.7),
               reference(q, k, v, everything, {}, 0.7));
}

TEST(Attention, GradientsMatchTheWrittenOutAttention) {
  auto [q0, k0, v0] = inputs(5, 5);
  auto run = [&](bool library) {
    auto q = q0.clone().requires_grad_(), k = k0.clone().requires_grad_(), v = v0.clone().requires_grad_();
    at::Tensor out;
    if (library) {
      out = accelerate::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, true);
    } else {
      auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(8.0);
      scores = scores.masked_fill(torch::ones({5, 5}, torch::kBool).triu(1), -INFINITY);
      out = torch::matmul(scores.softmax(-1), v);
    }
    (out * torch::linspace(-1, 1, out.numel()).view(out.sizes())).sum().backward();
    return std::vector<at::Tensor>{q.grad(), k.grad(), v.grad()};
  };
  auto got = run(true), want = run(false);
  for (size_t i = 0; i < 3; ++i) expect_close(got[i], want[i].to(at::kDouble));
}

TEST(Attention, DropoutDropsWeightsReproduciblyUnderOneSeed) {
  auto [q, k, v] = inputs(6, 6);
  torch::manual_seed(11);
  auto a = accelerate::scaled_dot_product_attention(q, k, v, std::nullopt, 0.5);
  torch::manual_seed(11);
  auto b = accelerate::scaled_dot_product_attention(q, k, v, std::nullopt, 0.5);
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_GT((a - accelerate::scaled_dot_product_attention(q, k, v)).abs().max().item<double>(), 1e-3);
}

TEST(Attention, RefusesArgumentsThatDisagreeNamingThem) {
  auto [q, k, v] = inputs(5, 7);
  const auto refused = [](const std::function<void()>& call, const std::string& says) {
    try {
      call();
      ADD_FAILURE() << "accepted; expected: " << says;
    } catch (const c10::ValueError& e) {
      EXPECT_THAT(e.what(), HasSubstr(says));
    }
  };
  refused([&] { accelerate::scaled_dot_product_attention(q, k.narrow(-1, 0, 4), v); }, "the same last dimension (E); got 8 and 4");
  refused([&] { accelerate::scaled_dot_product_attention(q, k, v.narrow(2, 0, 3)); }, "the same length (S); got 7 and 3");
  refused([&] { accelerate::scaled_dot_product_attention(q, k, v.to(at::kDouble)); }, "must have one dtype");
  refused([&] { accelerate::scaled_dot_product_attention(q.select(0, 0), k, v); }, "the same number of dimensions");
  refused([&] { accelerate::scaled_dot_product_attention(q, k.narrow(1, 0, 2), v.narrow(1, 0, 2)); },
          "the same leading (batch, head) dimensions");
  refused([&] { accelerate::scaled_dot_product_attention(q, k, v, std::nullopt, 1.0); }, "dropout_p must be in [0, 1), got 1");
  refused([&] { accelerate::scaled_dot_product_attention(q, k, v, torch::ones({5, 7}, torch::kBool), 0.0, true); },
          "attn_mask and is_causal exclude each other");
  refused([&] { accelerate::scaled_dot_product_attention(q, k, v, torch::ones({5, 6}, torch::kBool)); },
          "attn_mask of shape [5, 6] does not broadcast");
  refused([&] { accelerate::scaled_dot_product_attention(q, k, v, torch::ones({5, 7}, torch::kLong)); },
          "attn_mask must be boolean or of the query's dtype");
  refused([&] { accelerate::scaled_dot_product_attention(q.to(at::kLong), k.to(at::kLong), v.to(at::kLong)); },
          "needs floating-point tensors");
}

}  // namespace
}  // namespace accelerate
