// The sharded checkpoint format (Note [Sharded checkpoint layout] in sharded_format.cpp): one
// safetensors file per process and an index, written by SHARDED_STATE_DICT and LOCAL_STATE_DICT
// saves of fully sharded models and their optimizers (with tensor parallelism, of their pieces),
// read back at any number of processes and on any mesh, and joined into whole tensors by
// `accelerate merge-weights`.
#pragma once

#include "accelerate/checkpointing.h"
#include "accelerate/state.h"
#include "accelerate/utils/safetensors.h"

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace accelerate::detail::checkpoint {

/// Where a process's part of each tensor lies: rows of the fully sharded engine's group, of its
/// piece of the tensor-parallel group (Note [Sharded checkpoint layout]).
struct ShardPlace {
  int world = 1, rank = 0;      // the fully sharded group (1, 0: whole rows)
  int tp_size = 1, tp_rank = 0;  // the tensor-parallel group (1, 0: whole tensors)
};

/// A part of a whole tensor: its offset and length in each dimension (a scalar has one row).
struct ShardBox {
  std::vector<int64_t> offset, length;
  int64_t numel() const {
    int64_t n = 1;
    for (auto l : length) n *= l;
    return n;
  }
};

/// The part of a tensor of shape `whole` that the process at `place` holds: its piece along
/// `split` (-1: whole) of tensor parallelism's, and of that piece its rows when `rows`.
ShardBox shard_box(const std::vector<int64_t>& whole, bool rows, int64_t split, const ShardPlace& place);

/// Writes this process's part of a sharded state into `folder`: `tensors` by name, `values`
/// (JSON); `sharded` gives the whole shape (with tensor parallelism, of the whole tensor, not the
/// piece) of each tensor whose rows this process holds, `split` the dimension each tensor split
/// by tensor parallelism is split on, and the whole shape of those split but not sharded. The
/// first process of `place` also writes the folder's index. Every process must call it.
void save_sharded_state(const ShardPlace& place, const std::string& folder, const nlohmann::json& values,
                        const std::map<std::string, at::Tensor>& tensors,
                        const std::map<std::string, std::vector<int64_t>>& sharded,
                        const std::map<std::string, std::pair<int64_t, std::vector<int64_t>>>& split = {});

/// How a loading process holds a tensor of a sharded state: the dimension tensor parallelism
/// splits it on here (-1: whole), given its name and whole shape.
using SplitDimOf = std::function<int64_t(const std::string& name, const std::vector<int64_t>& whole)>;

/// What the process at `place` holds of a folder written by `save_sharded_state`: the rows its
/// fully sharded group gives it (of every tensor saved by rows) of the piece `split_dim` gives it,
/// copied from whichever files hold them; the values and the other tensors of its own file (else
/// the first). With `same_world`, refuses a folder written by another number of processes.
StateDict load_sharded_state(const ShardPlace& place, const std::string& folder, bool same_world = false,
                             const SplitDimOf& split_dim = nullptr);
/// The whole tensors of a folder written by `save_sharded_state` (what `accelerate
/// merge-weights` writes); raises naming a missing file or a tensor of the wrong size.
TensorMap merge_sharded_state(const std::string& folder);

}  // namespace accelerate::detail::checkpoint
