// What attention.cpp needs of context_parallel.cpp: whether this thread is inside a context-parallel
// scope, and ring attention over that scope's group.
#pragma once

#include "accelerate/context_parallel.h"

#include <ATen/Tensor.h>

#include <optional>

namespace accelerate::detail {

/// The innermost context-parallel scope of this thread whose group has more than one process,
/// or null.
const ContextParallelImpl* active_context_parallel();

/// Attention of this process's queries over the whole group's keys and values (Note [Ring
/// attention]); query, key and value hold this process's piece of the sequence of `scope`.
at::Tensor ring_attention(const ContextParallelImpl& scope, const at::Tensor& query, const at::Tensor& key,
                          const at::Tensor& value, const std::optional<at::Tensor>& attn_mask, double dropout_p,
                          bool is_causal, double scale);

}  // namespace accelerate::detail
