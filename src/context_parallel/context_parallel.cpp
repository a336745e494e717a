// The context-parallel scope; see include/accelerate/context_parallel.h.
#include "accelerate/context_parallel.h"

#include "context_parallel/ring_attention.h"
#include "detail/collectives.h"
#include "detail/warn.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace accelerate {
namespace {

constexpr const char* kScopeApi = "maybe_context_parallel";
namespace cp = detail::context_parallel;

}  // namespace

ContextParallel::ContextParallel(const PartialState& group, const std::vector<at::Tensor>& buffers,
                                 const std::vector<int64_t>& buffer_seq_dims,
                                 const std::vector<at::Tensor>& no_restore_buffers,
                                 const std::string& cp_comm_strategy) {
  TORCH_CHECK_VALUE(cp_comm_strategy == "allgather" || cp_comm_strategy == "alltoall", "[", kScopeApi,
                    "] cp_comm_strategy must be \"allgather\" or \"alltoall\", got \"", cp_comm_strategy, "\"");
  TORCH_CHECK_VALUE(buffers.size() == buffer_seq_dims.size(), "[", kScopeApi, "] ", buffers.size(), " buffers but ",
                    buffer_seq_dims.size(), " buffer_seq_dims: give one sequence dimension per buffer");
  const auto index_of = [&](const at::Tensor& t) {
    for (size_t i = 0; i < buffers.size(); ++i) {
      if (buffers[i].is_same(t)) return static_cast<int64_t>(i);
    }
    return int64_t{-1};
  };
  for (const auto& t : no_restore_buffers) {
    TORCH_CHECK_VALUE(index_of(t) >= 0, "[", kScopeApi, "] no_restore_buffers must be a subset of buffers: a tensor "
                      "of shape ", t.sizes(), " is not among them");
  }
  const int n = group.num_processes();
  if (n <= 1) return;
  auto impl = std::make_shared<cp::ContextParallelImpl>();
  impl->group = group;
  impl->alltoall = cp_comm_strategy == "alltoall";
  std::vector<int64_t> dims;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const auto& t = buffers[i];
    TORCH_CHECK_VALUE(t.defined() && t.layout() == at::kStrided, "[", kScopeApi, "] buffer ", i, " is ",
                      t.defined() ? "not a dense tensor" : "undefined");
    TORCH_CHECK_VALUE(!t.requires_grad(), "[", kScopeApi, "] buffer ", i, " requires grad: a tensor that takes part in "
                      "autograd cannot be split in place; split the inputs it is computed from");
    TORCH_CHECK_VALUE(index_of(t) == static_cast<int64_t>(i), "[", kScopeApi, "] buffer ", i, " is the same tensor as "
                      "buffer ", index_of(t), "; give each tensor once");
    const int64_t d = buffer_seq_dims[i];
    TORCH_CHECK_INDEX(d >= -t.dim() && d < t.dim(), "[", kScopeApi, "] buffer_seq_dims[", i, "] is ", d, ", outside ",
                      "the ", t.dim(), " dimensions of buffer ", i, " (shape ", t.sizes(), ")");
    dims.push_back(d < 0 ? d + t.dim() : d);
    const int64_t length = t.size(dims.back());
    TORCH_CHECK_VALUE(i == 0 || length == impl->length, "[", kScopeApi, "] every buffer must have one sequence length: "
                      "buffer 0 has ", impl->length, " along its sequence dimension, buffer ", i, " has ", length);
    impl->length = length;
  }
  TORCH_CHECK_VALUE(buffers.empty() || impl->length >= 2 * n, "[", kScopeApi, "] a sequence of ", impl->length,
                    " tokens is too short to split over ", n, " processes (it needs at least 2 per process)");
  const int64_t chunks = 2 * n, base = impl->length / chunks, extra = impl->length % chunks;
  const auto chunk = [&](int64_t c) {
    return std::pair<int64_t, int64_t>{c * base + std::min(c, extra), base + (c < extra ? 1 : 0)};
  };
  for (int p = 0; p < n; ++p) impl->ranges.push_back({chunk(p), chunk(chunks - 1 - p)});
  const auto& mine = impl->ranges[static_cast<size_t>(group.process_index())];
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < buffers.size(); ++i) {
    at::Tensor buffer = buffers[i];
    const int64_t d = dims[i];
    auto piece = at::cat({buffer.narrow(d, mine[0].first, mine[0].second),
                          buffer.narrow(d, mine[1].first, mine[1].second)}, d);
    at::Tensor original = at::empty({0}, buffer.options()).set_(buffer);
    bool restore = true;
    for (const auto& t : no_restore_buffers) restore = restore && !t.is_same(buffer);
    buffer.set_(piece);
    impl->held.push_back({buffer, original, restore});
  }
  impl->previous = cp::active_context_parallel();
  cp::set_active_context_parallel(impl.get());
  impl_ = std::move(impl);
}

ContextParallel::ContextParallel() = default;

ContextParallel::ContextParallel(ContextParallel&& other) noexcept : impl_(std::move(other.impl_)) {}

ContextParallel::~ContextParallel() {
  if (!impl_) return;
  if (cp::active_context_parallel() == impl_.get()) cp::set_active_context_parallel(impl_->previous);
  try {
    at::NoGradGuard no_grad;
    for (auto& held : impl_->held) {
      if (held.restore) held.buffer.set_(held.original);
    }
  } catch (const std::exception& e) {
    detail::warn("accelerate.accelerator", std::string("[maybe_context_parallel] restoring the split buffers failed: ") +
                                               e.what(),
                 {.every_process = true});
  }
}

bool ContextParallel::enabled() const { return impl_ != nullptr; }
int64_t ContextParallel::sequence_length() const { return impl_ ? impl_->length : 0; }

at::Tensor ContextParallel::positions() const {
  if (!impl_) return at::empty({0}, at::kLong);
  return impl_->positions_of(impl_->group.process_index());
}

double ContextParallel::loss_weight() const {
  if (!impl_ || impl_->length == 0) return 1.0;
  return static_cast<double>(impl_->local_length(impl_->group.process_index()) * impl_->group.num_processes()) /
         static_cast<double>(impl_->length);
}

at::Tensor ContextParallel::gather_sequence(const at::Tensor& piece, int64_t seq_dim) const {
  if (!impl_) return piece;
  const int n = impl_->group.num_processes();
  TORCH_CHECK_INDEX(seq_dim >= -piece.dim() && seq_dim < piece.dim(), "[gather_sequence] seq_dim ", seq_dim,
                    " is outside the ", piece.dim(), " dimensions of the piece");
  const int64_t d = seq_dim < 0 ? seq_dim + piece.dim() : seq_dim;
  const int64_t mine = impl_->local_length(impl_->group.process_index());
  TORCH_CHECK_VALUE(piece.size(d) == mine, "[gather_sequence] the piece has ", piece.size(d), " along dimension ", d,
                    "; this process's piece of the sequence has ", mine);
  int64_t longest = 0;
  for (int p = 0; p < n; ++p) longest = std::max(longest, impl_->local_length(p));
  auto moved = piece.detach().movedim(d, 0).contiguous();
  std::vector<int64_t> pad(static_cast<size_t>(2 * moved.dim()), 0);
  pad.back() = longest - mine;
  auto all = detail::all_gather(impl_->group, at::constant_pad_nd(moved, pad), "gather_sequence");
  auto sizes = moved.sizes().vec();
  sizes[0] = impl_->length;
  auto whole = at::empty(sizes, moved.options());
  for (int p = 0; p < n; ++p) {
    const auto& r = impl_->ranges[static_cast<size_t>(p)];
    whole.narrow(0, r[0].first, r[0].second).copy_(all[static_cast<size_t>(p)].narrow(0, 0, r[0].second));
    whole.narrow(0, r[1].first, r[1].second).copy_(all[static_cast<size_t>(p)].narrow(0, r[0].second, r[1].second));
  }
  return whole.movedim(0, d);
}

}  // namespace accelerate
