// Context parallelism's state and its ring attention: what a context-parallel scope holds
// (the group, the strategy, every process's piece of the sequence), the scope active on this
// thread, and ring attention over that scope's group, which accelerate::scaled_dot_product_attention
// runs inside a scope.
#pragma once

#include "accelerate/context_parallel.h"
#include "accelerate/state.h"

#include <ATen/ATen.h>

#include <array>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace accelerate::detail::context_parallel {

// Note [Context-parallel pieces]
// A sequence of length L is cut into 2n chunks for a group of n processes, the first L mod 2n
// of them one token longer; process i holds chunk i followed by chunk 2n−1−i. Under a causal
// mask the work of a query grows with its position, so pairing a chunk from the front with its
// mirror from the back gives every process the same work (PyTorch's head-tail load balancing,
// which needs 2n to divide L; here any L of at least 2n tokens). Every process knows every
// process's positions, which is all ring attention needs to mask causally across pieces.
struct ContextParallelImpl : std::enable_shared_from_this<ContextParallelImpl> {
  PartialState group;
  bool alltoall = false;
  int64_t length = 0;
  std::vector<std::array<std::pair<int64_t, int64_t>, 2>> ranges;  // per process: (start, length) twice
  struct Held {
    at::Tensor buffer, original;
    bool restore = true;
  };
  std::vector<Held> held;
  const ContextParallelImpl* previous = nullptr;

  int64_t local_length(int process) const {
    const auto& r = ranges[static_cast<size_t>(process)];
    return r[0].second + r[1].second;
  }
  /// The positions in the whole sequence of `process`'s tokens, in their local order.
  at::Tensor positions_of(int process) const {
    const auto& r = ranges[static_cast<size_t>(process)];
    return at::cat({at::arange(r[0].first, r[0].first + r[0].second, at::kLong),
                    at::arange(r[1].first, r[1].first + r[1].second, at::kLong)});
  }
};

/// The innermost context-parallel scope of this thread whose group has more than one process,
/// or null.
const ContextParallelImpl* active_context_parallel();
/// Makes `scope` (or null) this thread's active scope.
void set_active_context_parallel(const ContextParallelImpl* scope);

/// Makes `scope` (or null) this thread's active scope for its lifetime, then puts the previous one
/// back (activation checkpointing's recomputation runs as its first run did, in or out of a scope).
class ActiveScope {
 public:
  explicit ActiveScope(const ContextParallelImpl* scope) : previous_(active_context_parallel()) {
    set_active_context_parallel(scope);
  }
  ~ActiveScope() { set_active_context_parallel(previous_); }
  ActiveScope(const ActiveScope&) = delete;
  ActiveScope& operator=(const ActiveScope&) = delete;

 private:
  const ContextParallelImpl* previous_;
};

/// Attention of this process's queries over the whole group's keys and values (Note [Ring
/// attention]); query, key and value hold this process's piece of the sequence of `scope`.
at::Tensor ring_attention(const ContextParallelImpl& scope, const at::Tensor& query, const at::Tensor& key,
                          const at::Tensor& value, const std::optional<at::Tensor>& attn_mask, double dropout_p,
                          bool is_causal, double scale);

}  // namespace accelerate::detail::context_parallel
