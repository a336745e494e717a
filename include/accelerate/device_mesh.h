// The processes of a job laid out as an N-D mesh of parallel dimensions (upstream: the
// `torch.distributed.DeviceMesh` that `accelerator.torch_device_mesh` builds from a
// `ParallelismConfig`). Dimensions, outermost first: "dp_replicate", "dp_shard", "tp"; tensor
// parallelism is innermost, so the processes of one tensor-parallel group are neighbouring ranks.
// Each dimension, and the flattened "dp" (dp_replicate × dp_shard), "dp_shard_cp" and "dp_cp"
// (the same as "dp_shard" and "dp" while context parallelism is 1), is a group of processes with
// its own c10d process group: `get_group(name)` is a `PartialState` over it, for collectives.
//
// Example:
//   auto mesh = accelerator.torch_device_mesh();
//   if (mesh) {
//     accelerator.print("tp rank ", mesh->get_local_rank("tp"), " of ", mesh->size("tp"));
//     auto loss_sum = accelerate::reduce(mesh->get_group("dp"), loss.detach(), "sum");
//   }
#pragma once

#include "accelerate/state.h"

#include <map>
#include <string>
#include <vector>

namespace accelerate {

class DeviceMesh {
 public:
  /// Lays the processes of `state` out as dp_replicate × dp_shard × tp and makes every group of
  /// every dimension. A collective: every process of the job must build it at the same point.
  /// The product of the sizes must be the number of processes.
  DeviceMesh(const PartialState& state, int dp_replicate_size, int dp_shard_size, int tp_size);

  /// The names of the dimensions, outermost first.
  std::vector<std::string> mesh_dim_names() const { return {"dp_replicate", "dp_shard", "tp"}; }
  /// The sizes of the dimensions, outermost first.
  std::vector<int> shape() const { return {replicate_, shard_, tp_}; }
  /// The number of processes in the mesh.
  int size() const { return replicate_ * shard_ * tp_; }
  /// The size of a dimension or of a flattened one ("dp", "dp_shard_cp", "dp_cp"); throws
  /// `c10::ValueError` for another name.
  int size(const std::string& dim) const;
  /// This process's place along `dim`.
  int get_local_rank(const std::string& dim) const;
  /// The processes of this process's group along `dim`, as a state whose collectives run over
  /// them (upstream: `mesh[dim].get_group()`).
  const PartialState& get_group(const std::string& dim) const;
  /// Their ranks in the job, in their order in the group.
  std::vector<int> group_ranks(const std::string& dim) const;
  /// The whole job.
  const PartialState& state() const { return state_; }

 private:
  // The dimension a name stands for: its groups' ranks are found by `group_ranks`.
  std::string canonical(const std::string& dim) const;
  std::vector<int> ranks_of(const std::string& canonical_dim, int rank) const;

  PartialState state_;
  int replicate_ = 1, shard_ = 1, tp_ = 1;
  std::map<std::string, PartialState> groups_;  // by canonical name
};

}  // namespace accelerate
