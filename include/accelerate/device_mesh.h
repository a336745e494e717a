// The processes of a job laid out as an N-D mesh of parallel dimensions (upstream: the
// `torch.distributed.DeviceMesh` that `accelerator.torch_device_mesh` builds from a
// `ParallelismConfig`). Dimensions, outermost first: "dp_replicate", "dp_shard", "cp", "tp";
// tensor parallelism is innermost, so the processes of one tensor-parallel group are neighbouring
// ranks. Each dimension, and the flattened "dp" (dp_replicate × dp_shard), "dp_shard_cp"
// (dp_shard × cp) and "dp_cp" (dp_replicate × dp_shard × cp), is a group of processes with its own
// c10d process group: `get_group(name)` is a `PartialState` over it, for collectives. `mesh["tp"]`
// and `mesh[{"dp_shard", "cp"}]` are sub-meshes over some of the dimensions, whose `get_group()`
// is the group they flatten to.
//
// Example:
//   auto mesh = accelerator.torch_device_mesh();
//   if (mesh) {
//     accelerator.print("tp rank ", (*mesh)["tp"].get_local_rank(), " of ", (*mesh)["tp"].size());
//     auto loss_sum = accelerate::reduce(mesh->get_group("dp"), loss.detach(), "sum");
//     auto shard_group = (*mesh)[{"dp_shard", "cp"}].get_group();  // the same as "dp_shard_cp"
//   }
#pragma once

#include "accelerate/state.h"

#include <array>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace accelerate {

class DeviceMesh {
 public:
  /// Lays the processes of `state` out as dp_replicate × dp_shard × cp × tp and makes every group
  /// of every dimension and flattened dimension. A collective: every process of the job must
  /// build it at the same point. The product of the sizes must be the number of processes.
  DeviceMesh(const PartialState& state, int dp_replicate_size, int dp_shard_size, int cp_size, int tp_size);
  /// The same without context parallelism (cp 1).
  DeviceMesh(const PartialState& state, int dp_replicate_size, int dp_shard_size, int tp_size)
      : DeviceMesh(state, dp_replicate_size, dp_shard_size, 1, tp_size) {}

  /// The names of this mesh's dimensions, outermost first (all four on the whole mesh).
  std::vector<std::string> mesh_dim_names() const;
  /// Their sizes, outermost first.
  std::vector<int> shape() const;
  /// The number of processes in one group of this mesh (every process of the job, on the whole
  /// mesh).
  int size() const;
  /// The size of a dimension or a flattened one ("dp", "dp_shard_cp", "dp_cp"); throws
  /// `c10::ValueError` for a name this mesh does not have.
  int size(const std::string& dim) const;
  /// This process's place along `dim`.
  int get_local_rank(const std::string& dim) const;
  /// This process's place in this mesh's group (the flattened dimensions, on a sub-mesh).
  int get_local_rank() const;
  /// The processes of this process's group along `dim`, as a state whose collectives run over
  /// them (upstream: `mesh[dim].get_group()`).
  const PartialState& get_group(const std::string& dim) const;
  /// The group of this mesh, all its dimensions flattened (on the whole mesh: the job).
  const PartialState& get_group() const;
  /// The ranks in the job of this process's group along `dim`, in their order in the group.
  std::vector<int> group_ranks(const std::string& dim) const;
  /// The sub-mesh of one dimension or flattened dimension (upstream: `mesh["tp"]`).
  DeviceMesh operator[](const std::string& dim) const;
  /// The sub-mesh of several dimensions, outermost first (upstream: `mesh["dp_shard", "cp"]`);
  /// its group is those dimensions flattened. Groups exist for each dimension and for the
  /// flattened dp, dp_shard_cp and dp_cp (dimensions of size 1 aside); `get_group` on another
  /// sub-mesh throws `c10::ValueError`.
  DeviceMesh operator[](const std::vector<std::string>& dims) const;
  /// The same for a braced list of names (`mesh[{"dp_shard", "cp"}]`).
  DeviceMesh operator[](std::initializer_list<const char*> dims) const {
    return (*this)[std::vector<std::string>(dims.begin(), dims.end())];
  }
  /// The whole job.
  const PartialState& state() const;

 private:
  struct Layout;
  DeviceMesh(std::shared_ptr<const Layout> layout, unsigned dims) : layout_(std::move(layout)), dims_(dims) {}
  // The dimensions (a bit per dimension, outermost the lowest) a name stands for, within this mesh.
  unsigned dims_of(const std::string& dim) const;
  const PartialState& group_of(unsigned dims, const std::string& name) const;

  std::shared_ptr<const Layout> layout_;
  unsigned dims_ = 0;
};

}  // namespace accelerate
