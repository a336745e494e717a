// Scaled dot-product attention: the checks, LibTorch's kernel where the release has one
// (detail/torch_compat), and the computation written out where it does not.
#include "accelerate/attention.h"

#include "context_parallel/ring_attention.h"
#include "detail/torch_compat.h"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace accelerate {
namespace {

constexpr const char* kApi = "scaled_dot_product_attention";

void check_arguments(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                     std::optional<double> scale) {
  TORCH_CHECK_VALUE(q.defined() && k.defined() && v.defined(), "[", kApi, "] query, key and value must be defined");
  TORCH_CHECK_VALUE(q.dim() >= 2 && k.dim() == q.dim() && v.dim() == q.dim(), "[", kApi,
                    "] query, key and value must have the same number of dimensions, at least 2 ([..., L, E], "
                    "[..., S, E], [..., S, Ev]); got ", q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "[", kApi,
                    "] query, key and value must have one dtype; got ", q.scalar_type(), ", ", k.scalar_type(),
                    " and ", v.scalar_type());
  TORCH_CHECK_VALUE(at::isFloatingType(q.scalar_type()), "[", kApi, "] attention needs floating-point tensors, got ",
                    q.scalar_type());
  TORCH_CHECK_VALUE(q.device() == k.device() && q.device() == v.device(), "[", kApi,
                    "] query, key and value must be on one device; got ", q.device(), ", ", k.device(), " and ",
                    v.device());
  TORCH_CHECK_VALUE(q.sizes().slice(0, q.dim() - 2) == k.sizes().slice(0, k.dim() - 2) &&
                        k.sizes().slice(0, k.dim() - 2) == v.sizes().slice(0, v.dim() - 2),
                    "[", kApi, "] query, key and value must have the same leading (batch, head) dimensions; got ",
                    q.sizes(), ", ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(q.size(-1) == k.size(-1), "[", kApi, "] query and key must have the same last dimension (E); got ",
                    q.size(-1), " and ", k.size(-1));
  TORCH_CHECK_VALUE(k.size(-2) == v.size(-2), "[", kApi, "] key and value must have the same length (S); got ",
                    k.size(-2), " and ", v.size(-2));
  TORCH_CHECK_VALUE(dropout_p >= 0 && dropout_p < 1, "[", kApi, "] dropout_p must be in [0, 1), got ", dropout_p);
  TORCH_CHECK_VALUE(!scale || std::isfinite(*scale), "[", kApi, "] scale must be finite, got ", scale.value_or(0));
  if (!mask) return;
  TORCH_CHECK_VALUE(!is_causal, "[", kApi, "] attn_mask and is_causal exclude each other: is_causal is the mask");
  const at::Tensor& m = *mask;
  TORCH_CHECK_VALUE(m.defined(), "[", kApi, "] attn_mask is an undefined tensor: pass std::nullopt for no mask");
  TORCH_CHECK_VALUE(m.scalar_type() == at::kBool || m.scalar_type() == q.scalar_type(), "[", kApi,
                    "] attn_mask must be boolean or of the query's dtype (", q.scalar_type(), "), got ",
                    m.scalar_type());
  TORCH_CHECK_VALUE(m.device() == q.device(), "[", kApi, "] attn_mask is on ", m.device(), ", the query on ",
                    q.device());
  const int64_t length = q.size(-2), keys = k.size(-2);
  bool broadcasts = m.dim() >= 1 && m.dim() <= q.dim();
  for (int64_t d = 1; broadcasts && d <= m.dim(); ++d) {
    const int64_t want = d == 1 ? keys : d == 2 ? length : q.size(-d);
    broadcasts = m.size(-d) == want || m.size(-d) == 1;
  }
  TORCH_CHECK_VALUE(broadcasts, "[", kApi, "] attn_mask of shape ", m.sizes(), " does not broadcast to the scores' ",
                    "shape [..., L=", length, ", S=", keys, "]");
}

// The computation written out: the scores, the mask, softmax, dropout, the weighted values.
at::Tensor written_out(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal, double scale) {
  auto scores = at::matmul(q, k.transpose(-2, -1)) * scale;
  const double minus_infinity = -std::numeric_limits<double>::infinity();
  if (is_causal) {
    auto future = at::ones({q.size(-2), k.size(-2)}, q.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(future, minus_infinity);
  } else if (mask && mask->scalar_type() == at::kBool) {
    scores = scores.masked_fill(mask->logical_not(), minus_infinity);
  } else if (mask) {
    scores = scores + *mask;
  }
  auto weights = scores.softmax(-1);
  if (dropout_p > 0) weights = at::dropout(weights, dropout_p, /*train=*/true);
  return at::matmul(weights, v);
}

}  // namespace

at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                                        std::optional<double> scale) {
  check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale);
  if (const auto* scope = detail::context_parallel::active_context_parallel()) {
    return detail::context_parallel::ring_attention(*scope, query, key, value, attn_mask, dropout_p, is_causal,
                                  scale.value_or(1.0 / std::sqrt(static_cast<double>(query.size(-1)))));
  }
  if (auto fused = detail::compat::fused_attention(query, key, value, attn_mask, dropout_p, is_causal, scale)) {
    return *fused;
  }
  return written_out(query, key, value, attn_mask, dropout_p, is_causal,
                     scale.value_or(1.0 / std::sqrt(static_cast<double>(query.size(-1)))));
}

}  // namespace accelerate
