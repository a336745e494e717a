// A unit's backward: lending gradient buffers, then reducing the whole gradients into the shards.
#include "fsdp/engine_impl.h"

#include <torch/csrc/autograd/engine.h>

namespace accelerate::detail::fsdp {

void FsdpEngineImpl::pre_backward(size_t index) {
  auto& unit = units[index];
  if (unit.backward_armed) return;
  if (!callback_queued) {
    callback_queued = true;
    auto self = shared_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([self] { self->end_of_backward(); });
  }
  if (!overlap_reductions) finish_reductions();  // Note [When a reduction overlaps the backward pass]
  gather(unit);
  for (auto& p : unit.params) {
    p.grad_at_rest = p.param.grad();
    p.param.mutable_grad() = at::Tensor();
  }
  if (require_sync) lend_gradient_buffers(unit);
  unit.backward_armed = true;
  if (settings.backward_prefetch == FsdpBackwardPrefetch::kBackwardPre) prefetch_for_backward(index);
}

// Note [Lending gradient buffers]
// Autograd gives a parameter without a `.grad` the first gradient its backward computed (a new
// buffer of the whole parameter's size, from malloc) and adds later ones into it. Those buffers
// live until the unit's reduction has copied them: every unit's whole gradients would come from
// malloc, unit after unit, among activations and the optimizer's temporaries, and glibc's heap
// fragments (bench/README.md, W9). Instead, before a unit's backward on a synchronising pass,
// each parameter that needs a gradient gets a zeroed buffer from the engine's pool as its
// `.grad`; autograd adds into it in place, and the reduction copies it and gives it back. A
// buffer whose version did not move received nothing: its parameter had no gradient in this pass
// and gets none. Inside no_sync the whole gradients outlive the pass (they accumulate), and
// autograd allocates them as before; so it does when the backward builds a graph of its own
// (create_graph), where it replaces the `.grad` instead of adding into it. A large parameter's
// buffer is its reduction's input itself (Note [Reducing large gradients where autograd wrote
// them]).
void FsdpEngineImpl::lend_gradient_buffers(Unit& unit) {
  torch::NoGradGuard no_grad;
  for (auto& p : unit.params) {
    if (!p.param.requires_grad()) continue;
    if (p.own_reduction) {
      // The reduction's input, zeroed (its padding rows are sent as they are); its first elements
      // are the whole gradient. A view shares its base's version, and nothing else writes the base.
      p.reduce_input = zeroed_reduce_input(p);
      at::Tensor view = p.reduce_input.narrow(0, 0, p.param.numel()).view(p.param.sizes());
      p.lent_version = static_cast<int64_t>(view._version());
      p.lent_grad = view;
      p.param.mutable_grad() = view;
      continue;
    }
    if (p.pending_grad.defined()) continue;
    at::Tensor buffer = pool.empty(p.param.numel(), p.param.options());
    buffer.unsafeGetTensorImpl()->set_sizes_contiguous(p.param.sizes());  // a view would keep the flat one alive
    buffer.zero_();
    p.lent_version = static_cast<int64_t>(buffer._version());
    p.lent_grad = buffer;
    p.param.mutable_grad() = buffer;
  }
}

// The gradient autograd left in `p` (undefined when none); a lent buffer that received nothing
// goes back to the pool.
at::Tensor FsdpEngineImpl::take_whole_gradient(ShardedParam& p) {
  at::Tensor whole = p.param.grad();
  p.param.mutable_grad() = at::Tensor();
  if (p.lent_grad.defined()) {
    const bool untouched = whole.is_same(p.lent_grad) && static_cast<int64_t>(whole._version()) == p.lent_version;
    p.lent_grad = at::Tensor();
    if (untouched) {
      pool.release(whole);
      return at::Tensor();
    }
  }
  return whole;
}

void FsdpEngineImpl::prefetch_for_backward(size_t index) {
  if (auto next = neighbour(forward_order, index, /*after=*/false)) {
    if (!units[*next].backward_armed && start_gather(units[*next])) ++backward_prefetches;
  }
}

void FsdpEngineImpl::post_backward(size_t index) {
  auto& unit = units[index];
  if (!unit.backward_armed) return;
  unit.backward_armed = false;
  if (settings.backward_prefetch == FsdpBackwardPrefetch::kBackwardPost) prefetch_for_backward(index);
  reduce(unit);
  reshard(unit);
}

void FsdpEngineImpl::end_of_backward() {
  callback_queued = false;
  // Units in reverse order of definition, the root last: the same order on every process.
  for (size_t i = units.size(); i-- > 0;) {
    units[i].pending_input_nodes = 0;
    post_backward(i);
    reshard(units[i]);
  }
  finish_reductions();
}

// Note [Reducing large gradients where autograd wrote them]
// A unit's gradients are reduced in one collective per dtype group: each process's piece holds
// its rows of every parameter, so every whole gradient is copied into a flat buffer first, and
// both are alive until the copy is done (a unit's gradients twice). A parameter whose padded
// gradient is 1 MiB or more is reduced on its own instead: the buffer lent as its `.grad` (Note
// [Lending gradient buffers]) is that collective's input, its whole gradient followed by the
// padding rows, so that process r's piece is rows r·shard_rows onwards, as the shards are cut.
// Autograd adds into it in place, and the collective sends it as it is: no copy, and no second
// buffer. Its piece of the sum becomes the shard's gradient as it is when the shards are kept in
// the reduction's dtype on the job's device. Whether it had a gradient travels among the flags of
// its group's packed reduction (Note [Which parameters had a gradient]), which also reduces the
// smaller parameters as before. A group whose reduction is in another dtype than its gradients
// (reduce_dtype) keeps every parameter in the packed reduction, which casts them as it copies.

// Leaves `p`'s whole gradient of this pass, and whatever no_sync accumulated, in the first
// elements of `p.reduce_input` (zeros where there was none); true when there was some. `shared`:
// something besides the engine still holds the buffer lent as the gradient.
bool FsdpEngineImpl::take_own_gradient(ShardedParam& p, bool& shared) {
  at::Tensor whole = p.param.grad();
  p.param.mutable_grad() = at::Tensor();
  at::Tensor lent = std::exchange(p.lent_grad, at::Tensor());
  if (!p.reduce_input.defined()) p.reduce_input = zeroed_reduce_input(p);  // nothing was lent
  auto target = p.reduce_input.narrow(0, 0, p.param.numel());
  bool had = false;
  if (whole.defined() && whole.is_same(lent)) {
    had = static_cast<int64_t>(whole._version()) != p.lent_version;
  } else if (whole.defined()) {
    // Autograd replaced the lent buffer instead of adding into it (a backward with create_graph).
    target.copy_(whole.reshape({-1}));
    had = true;
  }
  if (p.pending_grad.defined()) {
    target.add_(p.pending_grad.reshape({-1}));
    pool.release(p.pending_grad);
    had = true;
  }
  whole = at::Tensor();
  lent = at::Tensor();
  shared = p.reduce_input.storage().use_count() > 1;
  return had;
}

void FsdpEngineImpl::reduce(Unit& unit) {
  torch::NoGradGuard no_grad;
  const bool sync = require_sync;
  collect_whole_gradients(unit, sync);
  if (!sync) {
    for (auto& p : unit.params) p.param.mutable_grad() = p.grad_at_rest, p.grad_at_rest = at::Tensor();
    return;
  }
  // Note [When a reduction overlaps the backward pass]
  // On a GPU, or between machines, a unit's reduction travels while the backward pass goes on to
  // the next unit (the device's or the network's work beside the computation, as in PyTorch's
  // FSDP); the one before it is finished first, so at most one unit's whole gradients wait in a
  // buffer. When every process computes on the CPU of one machine, the collective's copies and
  // sums take the same cores as the computation, and the overlap buys no time: the reduction is
  // finished before the next unit's backward begins (pre_backward), and the next unit's whole
  // gradients never share the memory with it (W9 at 4 processes: a peak some 20 MiB lower at the
  // same rate; bench/README.md).
  finish_reductions();
  for (auto& group : unit.groups) start_group_reduction(unit, group);
}

void FsdpEngineImpl::collect_whole_gradients(Unit& unit, bool sync) {
  for (auto& group : unit.groups) {
    // Note [Accumulating inside no_sync]
    // Inside no_sync the whole gradients accumulate from pass to pass; when the policy reduces in
    // a wider dtype than it computes in (param_dtype bf16, reduce_dtype fp32), they accumulate in
    // the reduction's dtype, as `fully_shard` does, so that the sum of many passes is not rounded
    // to the compute dtype at every pass. A single pass's gradient is cast when it is copied into
    // the reduction's buffer. (FSDP1 accumulates in param_dtype; both versions here widen. A
    // narrower reduce_dtype, which `fully_shard` would also accumulate in, is not used for the
    // sum: it would only lose precision, or overflow in fp16.)
    const bool upcast = !sync && c10::elementSize(group.reduce) > c10::elementSize(group.compute);
    for (size_t i : group.params) {
      auto& p = unit.params[i];
      if (sync && p.own_reduction) continue;  // taken where autograd wrote it, below
      at::Tensor whole = take_whole_gradient(p);
      if (!whole.defined()) continue;
      if (p.pending_grad.defined()) {
        p.pending_grad.add_(whole);
        pool.release(whole);
      } else if (upcast) {
        p.pending_grad = whole.to(group.reduce);
        pool.release(whole);
      } else {
        p.pending_grad = std::move(whole);
      }
    }
  }
}

void FsdpEngineImpl::start_group_reduction(Unit& unit, DtypeGroup& group) {
  auto options = at::TensorOptions().dtype(group.reduce).device(state.device());
  bool any = false;
  for (size_t i : group.params) any = any || unit.params[i].param.requires_grad();
  if (!any) return;
  // Note [Dividing an fp16 sum]
  // The processes' gradients are averaged: summed by the collective, then divided by their
  // number. fp16 overflows above 65504, and a process's own gradient is the mean over its own
  // rows of the batch: each row's part of it is N times that row's part of the whole batch's
  // mean, and where the processes' parts cancel the whole can be up to N times larger too. With
  // loss scaling, one process's backward pass can then overflow where one process on the whole
  // batch does not, and the job would skip a step that one process takes (seen at 2 processes:
  // one process's head weight gradient past 65504 at scale 65536, the whole batch's at 35712).
  // Dividing by about √N just before the collective, as PyTorch's FSDP does, comes too late for
  // that: the inf is already in the backward pass. So when a group reduces in fp16 the gradient
  // that enters the model's backward pass is divided by `gradient_divisor`, the smallest power of
  // two at least N (Note [The gradient divisor] in engine.cpp): each process's backward pass then
  // computes its rows' share of the whole batch's mean, row by row the values one process
  // computes (exactly so when N is a power of two), and the sum is multiplied by what is left
  // (D / N) after the collective. bf16 and fp32 have fp32's range: their divisor is 1, and the
  // sum is divided by N once it arrived.
  const double total = static_cast<double>(world) * num_replicas;
  const double pre = gradient_divisor;
  const size_t first = in_flight.size();
  // Every process's packed piece ends with one flag per parameter of the group (Note [Which
  // parameters had a gradient]).
  std::vector<float> had(group.params.size(), 0.f);
  std::vector<size_t> packed;  // positions in group.params
  for (size_t j = 0; j < group.params.size(); ++j) {
    auto& p = unit.params[group.params[j]];
    if (!p.own_reduction) {
      packed.push_back(j);
      had[j] = p.pending_grad.defined() ? 1.f : 0.f;
      continue;
    }
    if (!p.param.requires_grad()) continue;
    had[j] = start_own_reduction(unit, group, j, total, pre, options) ? 1.f : 0.f;
  }
  start_packed_reduction(unit, group, std::move(packed), had, total, pre, options);
  const bool every = std::find(had.begin(), had.end(), 0.f) == had.end();
  for (size_t k = first; k < in_flight.size(); ++k) in_flight[k].had_every_gradient = every;
}

bool FsdpEngineImpl::start_own_reduction(Unit& unit, DtypeGroup& group, size_t j, double total, double pre,
                                         const at::TensorOptions& options) {
  auto& p = unit.params[group.params[j]];
  // Note [Reducing large gradients where autograd wrote them]
  bool shared = false;
  const bool had = take_own_gradient(p, shared);
  InFlight reduction;
  reduction.unit = &unit;
  reduction.group = &group;
  reduction.slots = {j};
  reduction.packed = false;
  reduction.input = std::exchange(p.reduce_input, at::Tensor());
  reduction.input_shared = shared;
  reduction.post_divide = total / pre;
  const int64_t stride = p.shard_rows * p.row_numel;
  reduction.mine_is_gradient = !p.grad_at_rest.defined() && p.shard.scalar_type() == group.reduce &&
                               p.shard.device() == state.device();
  reduction.mine = reduction.mine_is_gradient ? at::empty({stride}, options) : pool.empty(stride, options);
  reduction.pending = reduce_scatter_sum_async(state, reduction.mine, reduction.input, kApi);
  in_flight.push_back(std::move(reduction));
  return had;
}

void FsdpEngineImpl::start_packed_reduction(Unit& unit, DtypeGroup& group, std::vector<size_t> packed,
                                            const std::vector<float>& had, double total, double pre,
                                            const at::TensorOptions& options) {
  bool complete = true;  // every packed parameter has a gradient: only padding needs zeros
  for (size_t j : packed) complete = complete && had[j] > 0;
  const auto flags = static_cast<int64_t>(had.size());
  const int64_t stride = group.reduce_piece + flags;
  auto input = pool.empty(shard ? stride * world : stride, options);
  if (!complete) input.zero_();
  auto by_rank = input.view({shard ? world : 1, stride});
  by_rank.narrow(1, group.reduce_piece, flags).copy_(at::tensor(had).to(options));  // the same flags in every piece
  if (complete && shard) {
    for (size_t j : packed) {
      const auto& p = unit.params[group.params[j]];
      for (int r = 0; r < world; ++r) {
        const int64_t n = p.rows_on(r);
        if (n < p.shard_rows) {
          by_rank[r].narrow(0, p.reduce_offset + n * p.row_numel, (p.shard_rows - n) * p.row_numel).zero_();
        }
      }
    }
  }
  for (size_t j : packed) {
    auto& p = unit.params[group.params[j]];
    if (!p.pending_grad.defined()) continue;
    auto rows = p.pending_grad.reshape({p.rows, p.row_numel});
    if (!shard) {
      input.narrow(0, p.reduce_offset, p.rows * p.row_numel).copy_(rows.reshape({-1}));
      continue;
    }
    for (int r = 0; r < world; ++r) {
      const int64_t n = p.rows_on(r);
      if (n > 0) {
        by_rank[r]
            .narrow(0, p.reduce_offset, n * p.row_numel)
            .copy_(rows.narrow(0, r * p.shard_rows, n).reshape({-1}));
      }
    }
  }
  for (size_t j : packed) pool.release(unit.params[group.params[j]].pending_grad);  // `input` holds them now
  InFlight reduction;
  reduction.unit = &unit;
  reduction.group = &group;
  reduction.slots = std::move(packed);
  reduction.input = input;
  reduction.post_divide = total / pre;
  if (shard) {
    reduction.mine = pool.empty(stride, options);
    reduction.pending = reduce_scatter_sum_async(state, reduction.mine, reduction.input, kApi);
  } else {
    reduction.mine = all_reduce(state, input, Reduction::kSum, kApi);
  }
  in_flight.push_back(std::move(reduction));
}

void FsdpEngineImpl::finish_reductions() {
  torch::NoGradGuard no_grad;
  auto done = std::move(in_flight);
  in_flight.clear();
  for (auto& r : done) {
    wait_collective(state, r.pending, kApi);
    r.pending = PendingCollective{};  // the collective's references to the buffers go
    if (replicas) {
      // Hybrid sharding: the same rows of every replica are summed too, then averaged over all.
      r.mine = all_reduce(*replicas, r.mine, Reduction::kSum, kApi);
    }
    r.mine.div_(r.post_divide);
  }
  // Note [Which parameters had a gradient]
  // A parameter that took no part in the pass has no gradient on one process, and under
  // `fully_shard` gets none: the optimizer then leaves it alone (AdamW neither decays nor moves
  // it). Whether some process had one is known only together, and a process's piece of the sum
  // cannot say it (a gradient may sum to exactly zero), so each process appends a flag per
  // parameter, 1 when it had a gradient, to every piece of its group's packed reduction: the
  // reduction sums them with the gradients, and a parameter whose flags sum to zero gets no
  // gradient, on every process alike. The flags are read only when this process lacked a
  // gradient: otherwise each sum is at least its own 1, and reading them would wait for the device.
  std::unordered_map<const DtypeGroup*, at::Tensor> had_by_group;
  for (auto& r : done) {
    if (!r.packed || r.had_every_gradient) continue;
    const auto flags = static_cast<int64_t>(r.group->params.size());
    had_by_group[r.group] = r.mine.narrow(0, r.group->reduce_piece, flags).to(at::kCPU, at::kFloat);
  }
  for (auto& r : done) {
    auto found = had_by_group.find(r.group);
    const at::Tensor had = found == had_by_group.end() ? at::Tensor() : found->second;
    for (size_t j : r.slots) {
      auto& p = r.unit->params[r.group->params[j]];
      if (!p.param.requires_grad()) continue;
      if (had.defined() && !(had.data_ptr<float>()[j] > 0)) {
        p.param.mutable_grad() = p.grad_at_rest;  // what earlier passes left, if anything
        p.grad_at_rest = at::Tensor();
        continue;
      }
      const int64_t n = shard ? p.rows_on(rank) : p.rows;
      const int64_t offset = r.packed ? p.reduce_offset : 0;
      auto reduced = r.mine.narrow(0, offset, n * p.row_numel).view(p.shard.sizes());
      if (p.grad_at_rest.defined()) {
        p.grad_at_rest.add_(reduced.to(p.grad_at_rest.device()));
        p.param.mutable_grad() = p.grad_at_rest;
      } else if (r.mine_is_gradient) {
        p.param.mutable_grad() = reduced;
      } else {
        // In the shards' dtype and on their device (the CPU when offloaded), where the optimizer
        // steps them (a copy either way: `mine` goes back to the pool).
        p.param.mutable_grad() =
            reduced.to(p.shard.device(), p.shard.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      }
      p.grad_at_rest = at::Tensor();
    }
    // A lent gradient someone else still holds keeps its buffer out of the pool.
    if (r.input_shared) {
      pool.release(r.input);
    } else {
      pool.reclaim(r.input);
    }
    if (shard && !r.mine_is_gradient) pool.reclaim(r.mine);
  }
}

at::Tensor FsdpEngineImpl::whole_value(const ShardedParam& p) {
  torch::NoGradGuard no_grad;
  if (!shard) return p.shard.clone();
  // Gathered on the job's device (NCCL takes no CPU tensors), given back where the shard lives.
  auto options = p.shard.options().device(state.device());
  auto piece = at::zeros({p.shard_rows * p.row_numel}, options);
  const int64_t n = p.rows_on(rank);
  if (n > 0) piece.narrow(0, 0, n * p.row_numel).copy_(p.shard.reshape({-1}));
  auto all = at::empty({piece.numel() * world}, options);
  all_gather_into(state, all, piece, kApi);
  return all.view({world * p.shard_rows, p.row_numel})
      .narrow(0, 0, p.rows)
      .reshape(p.shape)
      .to(p.shard.device(), p.shard.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}

}  // namespace accelerate::detail::fsdp
