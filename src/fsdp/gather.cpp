// Gathering a unit's whole parameters before it runs, and freeing them after (Note [Prefetching]).
#include "fsdp/engine_impl.h"

#include <torch/csrc/autograd/engine.h>

namespace accelerate::detail::fsdp {

// Note [Prefetching]
// Without prefetching a unit's gather starts when its forward (or backward) does, and the
// computation waits for it. forward_prefetch starts the gather of the unit that ran next in the
// previous forward pass as soon as a unit's forward begins (PyTorch's FSDP also follows the
// order of an earlier iteration); backward_prefetch starts the gather of the unit whose backward
// comes next (the one before in this pass's forward order) when a unit's backward begins
// (BACKWARD_PRE) or when its gradients are computed, before their reduction (BACKWARD_POST).
// Both cost one more unit of whole parameters. At most one gather is on its way ahead
// (limit_all_gathers' rate limit, always on); a unit whose turn comes waits for its own. Every
// process prefetches alike, since every process runs the same units in the same order, so the
// collectives keep one order. A gather started ahead and never needed is waited for and freed
// when the unit is resharded (at the end of the backward pass at the latest).
//
// Note [Gathering large parameters in place]
// A dtype group's parameters are gathered in one collective: each process sends its rows of
// every parameter in one piece, and every parameter's rows are then copied out of the gathered
// buffer into its whole storage, rank by rank. A parameter whose padded size is 1 MiB or more is
// gathered on its own instead, straight into its whole storage, made that large: the processes'
// pieces arrive one after the other, rows r·shard_rows onwards from process r, so the first
// `rows` rows are the parameter and only padding follows. Nothing is copied, and no gathered
// buffer lives beside the whole parameter. (Its reduction mirrors this: Note [Reducing large
// gradients where autograd wrote them].)
bool FsdpEngineImpl::start_gather(Unit& unit) {
  if (unit.gathered || !unit.gathering.empty() || !shard) return false;
  for (const auto& other : units) {
    if (!other.gathering.empty()) return false;
  }
  torch::NoGradGuard no_grad;
  for (size_t g = 0; g < unit.groups.size(); ++g) {
    const auto& group = unit.groups[g];
    // Gathered in the compute dtype: the cast happens on the shards, and half the bytes travel.
    auto options = at::TensorOptions().dtype(group.compute).device(state.device());
    // This process's rows of `p` at `offset` in `piece`, then zeros up to shard_rows.
    const auto put_rows = [&](at::Tensor& piece, const ShardedParam& p, int64_t offset) {
      const int64_t n = p.rows_on(rank) * p.row_numel;
      if (n > 0) piece.narrow(0, offset, n).copy_(p.shard.reshape({-1}));
      const int64_t padding = p.shard_rows * p.row_numel - n;
      if (padding > 0) piece.narrow(0, offset + n, padding).zero_();
    };
    // Note [Gathering large parameters in place]
    for (size_t i : group.params) {
      auto& p = unit.params[i];
      if (!p.own_gather) continue;
      const int64_t stride = p.shard_rows * p.row_numel;
      auto piece = pool.empty(stride, options);
      put_rows(piece, p, 0);
      pool.allocate_storage(p.full, static_cast<size_t>(stride * world) * p.full.element_size());
      at::Tensor all = at::empty({0}, options);
      all.set_(p.full.storage(), 0, {stride * world}, {1});
      auto pending = all_gather_into_async(state, all, piece, kApi);
      unit.gathering.push_back(GatherInFlight{g, piece, all, std::move(pending), i});
    }
    if (group.gather_piece == 0) continue;
    auto piece = pool.empty(group.gather_piece, options);
    for (size_t i : group.params) {
      const auto& p = unit.params[i];
      if (!p.own_gather) put_rows(piece, p, p.offset);
    }
    auto all = pool.empty(group.gather_piece * world, options);
    auto pending = all_gather_into_async(state, all, piece, kApi);
    unit.gathering.push_back(GatherInFlight{g, piece, all, std::move(pending), std::nullopt});
  }
  return true;
}

void FsdpEngineImpl::finish_gather(Unit& unit) {
  torch::NoGradGuard no_grad;
  auto started = std::move(unit.gathering);
  unit.gathering.clear();
  unit.gathered = true;
  for (auto& flight : started) {
    wait_collective(state, flight.pending, kApi);
    flight.pending = PendingCollective{};  // the collective's references to the buffers go
    pool.reclaim(flight.piece);
    if (flight.param) {
      // Already in its whole storage: `all` is that storage, whose rows are the parameter's.
      auto& p = unit.params[*flight.param];
      flight.all = at::Tensor();
      p.param.set_data(p.full);
      continue;
    }
    const auto& group = unit.groups[flight.group];
    auto by_rank = flight.all.view({world, group.gather_piece});
    for (size_t i : group.params) {
      auto& p = unit.params[i];
      if (p.own_gather) continue;
      pool.allocate_storage(p.full);
      auto rows = p.full.view({p.rows, p.row_numel});
      for (int r = 0; r < world; ++r) {
        const int64_t n = p.rows_on(r);
        if (n == 0) continue;
        rows.narrow(0, r * p.shard_rows, n).copy_(by_rank[r].narrow(0, p.offset, n * p.row_numel).view({n, p.row_numel}));
      }
      p.param.set_data(p.full);
    }
  }
  for (auto& flight : started) {
    if (!flight.param) pool.reclaim(flight.all);
  }
}

std::optional<size_t> FsdpEngineImpl::neighbour(const std::vector<size_t>& order, size_t unit, bool after) {
  auto it = std::find(order.begin(), order.end(), unit);
  if (it == order.end()) return std::nullopt;
  if (after) return std::next(it) == order.end() ? std::nullopt : std::optional<size_t>(*std::next(it));
  return it == order.begin() ? std::nullopt : std::optional<size_t>(*std::prev(it));
}

void FsdpEngineImpl::gather(Unit& unit) {
  if (unit.gathered) return;
  if (shard) {
    // Every gather goes through the started form: prefetched, or started and waited for now.
    if (unit.gathering.empty()) {
      // Another unit's prefetch may be on its way: it goes first, as on every process.
      for (auto& other : units) {
        if (&other != &unit && !other.gathering.empty()) finish_gather(other);
      }
      start_gather(unit);
    }
    finish_gather(unit);
    return;
  }
  unit.gathered = true;
  torch::NoGradGuard no_grad;
  // NO_SHARD with a param_dtype or offloaded: the whole parameters in that dtype on the device,
  // copied from the whole ones at rest.
  for (auto& p : unit.params) {
    if (p.full.is_same(p.shard)) continue;
    pool.allocate_storage(p.full);
    p.full.copy_(p.shard);
    p.param.set_data(p.full);
  }
}

void FsdpEngineImpl::reshard(Unit& unit) {
  if (!unit.gathering.empty()) finish_gather(unit);  // a prefetch that was not needed
  if (!unit.gathered) return;
  unit.gathered = false;
  for (auto& p : unit.params) {
    if (p.full.is_same(p.shard)) continue;  // NO_SHARD in the parameters' own dtype: nothing to free
    p.param.set_data(p.shard);
    pool.free_storage(p.full);
  }
}

}  // namespace accelerate::detail::fsdp
