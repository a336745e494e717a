// Ring attention over a context-parallel group; see ring_attention.h.
#include "context_parallel/ring_attention.h"

#include "detail/autograd_function.h"
#include "detail/collectives.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>

namespace accelerate::detail::context_parallel {
namespace {

thread_local const ContextParallelImpl* current_scope = nullptr;

constexpr const char* kAttentionApi = "scaled_dot_product_attention (context parallel)";

}  // namespace

const ContextParallelImpl* active_context_parallel() { return current_scope; }
void set_active_context_parallel(const ContextParallelImpl* scope) { current_scope = scope; }

// Note [Ring attention]
// Each process holds the queries, keys and values of its piece of the sequence. Attention over
// the whole sequence is computed one key block (one process's keys and values) at a time: a
// block gives each query row its partial output and the log-sum-exp of its scores, and partial
// results merge exactly (outputs weighted by exp(lse_part − lse_total)), so the order of blocks
// does not matter. "allgather" gathers every block at once; "alltoall" passes the blocks around
// the group, each process sending its current block to the next and taking the previous one's.
// The backward pass visits the blocks again with the saved output and log-sum-exp: each gives
// the queries' gradient here and the block's key and value gradients, which belong to the block's
// owner: "allgather" sums every process's block gradients into their owners (reduce-scatter);
// "alltoall" carries them along with the block, one more step bringing them home. Causal masks
// compare the positions of the pieces (Note [Context-parallel pieces]). The arithmetic is in float
// (double for double inputs) whatever the inputs' dtype; results return in the inputs' dtypes.
struct RingPlan : torch::CustomClassHolder {
  PartialState group;
  bool alltoall = false, causal = false;
  double scale = 1;
  int64_t key_width = 0;               // E: keys and values travel joined along the last dimension
  std::vector<at::Tensor> positions;   // per process, on the inputs' device
  std::vector<int64_t> lengths;        // per process
};

namespace {

// The partial output and log-sum-exp of `q` over one block of keys and values.
std::pair<at::Tensor, at::Tensor> block_forward(const RingPlan& plan, const at::Tensor& q, const at::Tensor& kv,
                                                const at::Tensor& q_positions, const at::Tensor& k_positions) {
  auto k = kv.narrow(-1, 0, plan.key_width);
  auto v = kv.narrow(-1, plan.key_width, kv.size(-1) - plan.key_width);
  auto scores = at::matmul(q, k.transpose(-2, -1)) * plan.scale;
  if (plan.causal) {
    scores.masked_fill_(k_positions.unsqueeze(0) > q_positions.unsqueeze(1), -std::numeric_limits<double>::infinity());
  }
  auto lse = scores.logsumexp(-1, /*keepdim=*/true);
  auto weights = (scores - at::where(lse.isinf(), at::zeros_like(lse), lse)).exp();
  return {at::matmul(weights, v), lse};
}

// The gradients of one block: the queries' (added to `dq`), and the block's keys and values, joined.
at::Tensor block_backward(const RingPlan& plan, const at::Tensor& q, const at::Tensor& kv, const at::Tensor& lse,
                          const at::Tensor& grad_out, const at::Tensor& delta, const at::Tensor& q_positions,
                          const at::Tensor& k_positions, at::Tensor& dq) {
  auto k = kv.narrow(-1, 0, plan.key_width);
  auto v = kv.narrow(-1, plan.key_width, kv.size(-1) - plan.key_width);
  auto scores = at::matmul(q, k.transpose(-2, -1)) * plan.scale;
  if (plan.causal) {
    scores.masked_fill_(k_positions.unsqueeze(0) > q_positions.unsqueeze(1), -std::numeric_limits<double>::infinity());
  }
  auto weights = (scores - at::where(lse.isinf(), at::zeros_like(lse), lse)).exp();
  auto dv = at::matmul(weights.transpose(-2, -1), grad_out);
  auto dscores = weights * (at::matmul(grad_out, v.transpose(-2, -1)) - delta);
  dq.add_(at::matmul(dscores, k), plan.scale);
  auto dk = at::matmul(dscores.transpose(-2, -1), q) * plan.scale;
  return at::cat({dk, dv}, -1);
}

// `t` with its sequence dimension (-2) of length `length`.
std::vector<int64_t> with_length(const at::Tensor& t, int64_t length) {
  auto sizes = t.sizes().vec();
  sizes[sizes.size() - 2] = length;
  return sizes;
}

// Every process's block, gathered (padded to the longest for the collective, then trimmed).
std::vector<at::Tensor> gather_blocks(const RingPlan& plan, const at::Tensor& mine) {
  const int64_t longest = *std::max_element(plan.lengths.begin(), plan.lengths.end());
  auto padded = at::constant_pad_nd(mine, {0, 0, 0, longest - mine.size(-2)});
  auto all = all_gather(plan.group, padded, kAttentionApi);
  for (size_t o = 0; o < all.size(); ++o) all[o] = all[o].narrow(-2, 0, plan.lengths[o]);
  return all;
}

struct RingAttentionFunction : torch::autograd::Function<RingAttentionFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                            const at::Tensor& value, c10::intrusive_ptr<RingPlan> plan) {
    const auto dtype = query.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    auto q = query.to(dtype);
    auto kv = at::cat({key.to(dtype), value.to(dtype)}, -1).contiguous();
    const int n = plan->group.num_processes(), rank = plan->group.process_index();
    const auto& q_positions = plan->positions[static_cast<size_t>(rank)];
    auto sizes = q.sizes().vec();
    sizes.back() = value.size(-1);
    auto out = at::zeros(sizes, q.options());
    sizes.back() = 1;
    auto lse = at::full(sizes, -std::numeric_limits<double>::infinity(), q.options());
    std::vector<at::Tensor> all;
    if (!plan->alltoall) all = gather_blocks(*plan, kv);
    at::Tensor block = kv;
    for (int step = 0; step < n; ++step) {
      const int owner = (rank - step + n) % n;
      if (!plan->alltoall) block = all[static_cast<size_t>(owner)];
      auto [part, part_lse] = block_forward(*plan, q, block, q_positions, plan->positions[static_cast<size_t>(owner)]);
      auto total = at::logaddexp(lse, part_lse);
      auto safe = at::where(total.isinf(), at::zeros_like(total), total);
      out = out * (lse - safe).exp() + part * (part_lse - safe).exp();
      lse = total;
      if (plan->alltoall && step + 1 < n) {
        const int64_t incoming = plan->lengths[static_cast<size_t>((owner - 1 + n) % n)];
        block = pass_to_next(plan->group, block, with_length(block, incoming), kAttentionApi);
      }
    }
    ctx->save_for_backward({q, kv, out, lse});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(plan);
    ctx->saved_data["query_dtype"] = static_cast<int64_t>(query.scalar_type());
    ctx->saved_data["key_dtype"] = static_cast<int64_t>(key.scalar_type());
    return out.to(query.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    const auto& kv = saved[1];
    const auto& out = saved[2];
    const auto& lse = saved[3];
    auto plan = c10::static_intrusive_pointer_cast<RingPlan>(ctx->saved_data["plan"].toCapsule());
    const auto query_dtype = static_cast<at::ScalarType>(ctx->saved_data["query_dtype"].toInt());
    const auto key_dtype = static_cast<at::ScalarType>(ctx->saved_data["key_dtype"].toInt());
    const int n = plan->group.num_processes(), rank = plan->group.process_index();
    const auto& q_positions = plan->positions[static_cast<size_t>(rank)];
    auto grad_out = grads[0].to(q.scalar_type());
    auto delta = (grad_out * out).sum(-1, /*keepdim=*/true);
    auto dq = at::zeros_like(q);
    at::Tensor dkv;
    if (!plan->alltoall) {
      const auto all = gather_blocks(*plan, kv);
      const int64_t longest = *std::max_element(plan->lengths.begin(), plan->lengths.end());
      std::vector<at::Tensor> parts;
      for (int owner = 0; owner < n; ++owner) {
        auto part = block_backward(*plan, q, all[static_cast<size_t>(owner)], lse, grad_out, delta, q_positions,
                                   plan->positions[static_cast<size_t>(owner)], dq);
        parts.push_back(at::constant_pad_nd(part, {0, 0, 0, longest - part.size(-2)}));
      }
      auto input = at::stack(parts).contiguous().view(-1);
      auto mine = at::empty({input.numel() / n}, input.options());
      reduce_scatter_sum(plan->group, mine, input, kAttentionApi);
      dkv = mine.view(with_length(kv, longest)).narrow(-2, 0, kv.size(-2));
    } else {
      at::Tensor block = kv;
      at::Tensor carried = at::zeros_like(kv);
      for (int step = 0; step < n; ++step) {
        const int owner = (rank - step + n) % n;
        carried.add_(block_backward(*plan, q, block, lse, grad_out, delta, q_positions,
                                    plan->positions[static_cast<size_t>(owner)], dq));
        const int64_t incoming = plan->lengths[static_cast<size_t>((owner - 1 + n) % n)];
        if (step + 1 < n) {
          auto sizes = with_length(block, incoming);
          sizes.back() *= 2;
          auto both = pass_to_next(plan->group, at::cat({block, carried}, -1), sizes, kAttentionApi);
          block = both.narrow(-1, 0, kv.size(-1));
          carried = both.narrow(-1, kv.size(-1), kv.size(-1)).contiguous();
        } else {
          carried = pass_to_next(plan->group, carried, with_length(carried, incoming), kAttentionApi);
        }
      }
      dkv = carried;
    }
    auto dk = dkv.narrow(-1, 0, plan->key_width).to(key_dtype);
    auto dv = dkv.narrow(-1, plan->key_width, dkv.size(-1) - plan->key_width).to(key_dtype);
    return {dq.to(query_dtype), dk, dv, at::Tensor()};
  }
};

}  // namespace

at::Tensor ring_attention(const ContextParallelImpl& scope, const at::Tensor& query, const at::Tensor& key,
                          const at::Tensor& value, const std::optional<at::Tensor>& attn_mask, double dropout_p,
                          bool is_causal, double scale) {
  const int rank = scope.group.process_index();
  TORCH_CHECK_VALUE(!attn_mask, "[", kAttentionApi, "] inside maybe_context_parallel attention takes is_causal or no "
                    "mask (as PyTorch's context parallelism): an attn_mask covers the whole sequence, which no process "
                    "holds");
  TORCH_CHECK_VALUE(dropout_p == 0, "[", kAttentionApi, "] dropout_p ", dropout_p, ": ring attention has no dropout "
                    "of the attention weights; pass 0 inside maybe_context_parallel");
  const int64_t mine = scope.local_length(rank);
  TORCH_CHECK_VALUE(query.size(-2) == mine && key.size(-2) == mine, "[", kAttentionApi, "] query and key must hold ",
                    "this process's piece of the sequence (", mine, " of ", scope.length, " tokens); got query length ",
                    query.size(-2), " and key length ", key.size(-2), " (attention over another sequence cannot run "
                    "inside maybe_context_parallel)");
  auto plan = c10::make_intrusive<RingPlan>();
  plan->group = scope.group;
  plan->alltoall = scope.alltoall;
  plan->causal = is_causal;
  plan->scale = scale;
  plan->key_width = key.size(-1);
  for (int p = 0; p < scope.group.num_processes(); ++p) {
    plan->positions.push_back(scope.positions_of(p).to(query.device()));
    plan->lengths.push_back(scope.local_length(p));
  }
  return apply_function<RingAttentionFunction>(query, key, value, std::move(plan));
}

}  // namespace accelerate::detail::context_parallel
