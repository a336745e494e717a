// Scaled dot-product attention through one entry point: LibTorch's fused kernels (flash and
// memory-efficient attention on a GPU, the fused CPU kernel) where the release has them, the
// same computation written out where it does not (LibTorch 1.13), with PyTorch's semantics.
//
// Inside a context-parallel scope (`Accelerator::maybe_context_parallel`) the same call runs ring
// attention over the group: query, key and value hold this process's piece of the sequence.
//
// Example (a causal self-attention block, heads already split):
//   auto y = accelerate::scaled_dot_product_attention(q, k, v, std::nullopt, 0.0, /*is_causal=*/true);
// Call it qualified: on LibTorch 2.x, argument-dependent lookup of an unqualified call with
// at::Tensor arguments also finds at::scaled_dot_product_attention, and the call is ambiguous.
#pragma once

#include <ATen/Tensor.h>

#include <optional>

namespace accelerate {

/// softmax(query · keyᵀ · scale + mask) · value, as `torch.nn.functional.scaled_dot_product_attention`:
/// `query` is [..., L, E], `key` [..., S, E] and `value` [..., S, Ev] (the leading dimensions
/// equal), the result [..., L, Ev]. `attn_mask`, broadcastable to [..., L, S], is boolean (true
/// where a position takes part) or of the query's dtype (added to the scores); `is_causal` masks
/// every key after the query's position (top-left aligned when L ≠ S) and excludes `attn_mask`.
/// `dropout_p` in [0, 1) drops attention weights (pass 0 when evaluating); `scale` defaults to
/// 1/√E. A query row whose every key is masked has no defined result (NaN or zero, by kernel).
/// Throws c10::ValueError naming the argument when shapes, dtypes, devices or values disagree.
at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const std::optional<at::Tensor>& attn_mask = std::nullopt,
                                        double dropout_p = 0.0, bool is_causal = false,
                                        std::optional<double> scale = std::nullopt);

}  // namespace accelerate
