// The communication functions of tensor parallelism; see communication.h.
#include "tensor_parallel/communication.h"

#include "detail/autograd_function.h"
#include "detail/collectives.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <mutex>
#include <vector>

namespace accelerate::detail::tensor_parallel {

namespace {

// The groups autograd nodes communicate over, by number. A node outlives nothing it needs: the
// table keeps the group, and it is never destroyed (the process groups are, by
// destroy_process_group, which every collective then reports).
std::mutex registry_mutex;
std::vector<PartialState>& registry() {
  static auto* groups = new std::vector<PartialState>();
  return *groups;
}
PartialState group_of(const torch::autograd::AutogradContext* ctx) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  return registry().at(static_cast<size_t>(ctx->saved_data.at("group").toInt()));
}

at::Tensor join_last_dim(const PartialState& group, const at::Tensor& x) {
  auto pieces = all_gather(group, x.contiguous(), kTpApi);
  return at::cat(pieces, -1);
}
at::Tensor last_dim_slice(const PartialState& group, const at::Tensor& x) {
  const int64_t piece = x.size(-1) / group.num_processes();
  return x.narrow(-1, piece * group.process_index(), piece).contiguous();
}

at::Tensor sequence_slice(const PartialState& group, const at::Tensor& x) {
  const auto piece = sequence_piece(x.size(1), group.num_processes(), group.process_index());
  return x.narrow(1, piece.start, piece.length).contiguous();
}
// Every process's piece of dimension 1 joined into `len`: the pieces travel padded to the longest,
// and since only the last pieces are short, the padding lies past `len`.
at::Tensor join_sequence(const PartialState& group, const at::Tensor& piece, int64_t len) {
  const int n = group.num_processes();
  const int64_t size = (len + n - 1) / n;
  if (size == 0) return piece.contiguous();
  at::Tensor padded = piece;
  if (piece.size(1) < size) {
    auto shape = piece.sizes().vec();
    shape[1] = size - piece.size(1);
    padded = at::cat({piece, at::zeros(shape, piece.options())}, 1);
  }
  return at::cat(all_gather(group, padded.contiguous(), kTpApi), 1).narrow(1, 0, len).contiguous();
}

struct CopyToGroup : torch::autograd::Function<CopyToGroup> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {all_reduce(group_of(ctx), grads[0].contiguous(), Reduction::kSum, kTpApi), at::Tensor()};
  }
};

struct SumOverGroup : torch::autograd::Function<SumOverGroup> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return all_reduce(group_of(ctx), x.contiguous(), Reduction::kSum, kTpApi);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    (void)ctx;
    return {grads[0], at::Tensor()};
  }
};

struct GatherLastDim : torch::autograd::Function<GatherLastDim> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return join_last_dim(group_of(ctx), x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {last_dim_slice(group_of(ctx), grads[0]), at::Tensor()};
  }
};

struct SliceLastDim : torch::autograd::Function<SliceLastDim> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return last_dim_slice(group_of(ctx), x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {join_last_dim(group_of(ctx), grads[0]), at::Tensor()};
  }
};

struct SliceSequence : torch::autograd::Function<SliceSequence> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["len"] = x.size(1);
    return sequence_slice(group_of(ctx), x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {join_sequence(group_of(ctx), grads[0], ctx->saved_data.at("len").toInt()), at::Tensor()};
  }
};

struct GatherSequence : torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group, int64_t len) {
    ctx->saved_data["group"] = group;
    return join_sequence(group_of(ctx), x, len);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {sequence_slice(group_of(ctx), grads[0]), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

int64_t register_group(const PartialState& group) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& groups = registry();
  for (size_t i = 0; i < groups.size(); ++i) {
    if (groups[i].impl() == group.impl()) return static_cast<int64_t>(i);
  }
  groups.push_back(group);
  return static_cast<int64_t>(groups.size() - 1);
}

at::Tensor copy_to_group(const at::Tensor& x, int64_t group) { return apply_function<CopyToGroup>(x, group); }
at::Tensor sum_over_group(const at::Tensor& x, int64_t group) { return apply_function<SumOverGroup>(x, group); }
at::Tensor gather_last_dim(const at::Tensor& x, int64_t group) { return apply_function<GatherLastDim>(x, group); }
at::Tensor slice_last_dim(const at::Tensor& x, int64_t group) { return apply_function<SliceLastDim>(x, group); }
at::Tensor slice_sequence(const at::Tensor& x, int64_t group) { return apply_function<SliceSequence>(x, group); }
at::Tensor gather_sequence(const at::Tensor& x, int64_t group, int64_t len) {
  return apply_function<GatherSequence>(x, group, len);
}

SequencePiece sequence_piece(int64_t len, int n, int rank) {
  const int64_t size = (len + n - 1) / n;
  const int64_t start = std::min(len, size * rank);
  return {start, std::min(len, start + size) - start};
}

}  // namespace accelerate::detail::tensor_parallel
