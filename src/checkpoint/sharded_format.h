// The sharded checkpoint format (Note [Sharded checkpoint layout] in sharded_format.cpp): one
// safetensors file per process and an index, written by SHARDED_STATE_DICT and LOCAL_STATE_DICT
// saves of fully sharded models and their optimizers, read back at any number of processes, and
// joined into whole tensors by `accelerate merge-weights`.
#pragma once

#include "accelerate/checkpointing.h"
#include "accelerate/state.h"
#include "accelerate/utils/safetensors.h"

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

namespace accelerate::detail {

/// Writes this process's part of a sharded state into `folder` (Note [Sharded checkpoint
/// layout]): `tensors` by name, `values` (JSON), and for each row-sharded tensor its whole shape
/// in `sharded`. Process 0 also writes the folder's index. Every process must call it.
void save_sharded_state(const PartialState& state, const std::string& folder, const nlohmann::json& values,
                        const std::map<std::string, at::Tensor>& tensors,
                        const std::map<std::string, std::vector<int64_t>>& sharded);
/// What this process holds of a folder written by `save_sharded_state`, at the current number of
/// processes (rows of sharded tensors come from whichever files hold them); with `same_world`,
/// refuses a folder written by another number of processes.
StateDict load_sharded_state(const PartialState& state, const std::string& folder, bool same_world = false);
/// The whole tensors of a folder written by `save_sharded_state` (what `accelerate
/// merge-weights` writes); raises naming a missing file or a tensor of the wrong size.
TensorMap merge_sharded_state(const std::string& folder);

}  // namespace accelerate::detail
