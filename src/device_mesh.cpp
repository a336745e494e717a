// The device mesh; see include/accelerate/device_mesh.h.
#include "accelerate/device_mesh.h"

#include "detail/state_impl.h"

#include <c10/util/Exception.h>

namespace accelerate {

// Note [The mesh's rank layout]
// Process r sits at (replicate, shard, tp) = (r / (S·T), (r / T) % S, r % T) for sizes R × S × T,
// as upstream's mesh (tp innermost). A group along a dimension holds the processes that agree on
// every other coordinate; the flattened "dp" holds those that agree on tp, ordered by rank, so
// that its consecutive runs of S are the shard groups and its residues modulo S the replicate
// groups (what the fully sharded engine finds when it splits "dp" itself).
DeviceMesh::DeviceMesh(const PartialState& state, int dp_replicate_size, int dp_shard_size, int tp_size)
    : state_(state), replicate_(dp_replicate_size), shard_(dp_shard_size), tp_(tp_size) {
  TORCH_CHECK_VALUE(replicate_ >= 1 && shard_ >= 1 && tp_ >= 1, "[DeviceMesh] every size must be at least 1, got "
                    "dp_replicate ", replicate_, ", dp_shard ", shard_, ", tp ", tp_);
  TORCH_CHECK_VALUE(size() == state.num_processes(), "[DeviceMesh] dp_replicate_size (", replicate_,
                    ") x dp_shard_size (", shard_, ") x tp_size (", tp_, ") must equal the number of processes, ",
                    state.num_processes());
  for (const char* dim : {"dp_replicate", "dp_shard", "tp", "dp"}) {
    std::vector<std::vector<int>> groups;
    std::vector<bool> placed(static_cast<size_t>(size()), false);
    for (int r = 0; r < size(); ++r) {
      if (placed[static_cast<size_t>(r)]) continue;
      groups.push_back(ranks_of(dim, r));
      for (int member : groups.back()) placed[static_cast<size_t>(member)] = true;
    }
    groups_.emplace(dim, detail::split_state(state, groups, std::string("mesh-") + dim));
  }
}

std::string DeviceMesh::canonical(const std::string& dim) const {
  if (dim == "dp_replicate" || dim == "dp_shard" || dim == "tp" || dim == "dp") return dim;
  if (dim == "dp_shard_cp") return "dp_shard";  // context parallelism is 1
  if (dim == "dp_cp") return "dp";
  C10_THROW_ERROR(ValueError, c10::str("[DeviceMesh] no dimension named \"", dim, "\"; the mesh has dp_replicate, "
                                       "dp_shard, tp and the flattened dp, dp_shard_cp and dp_cp"));
}

std::vector<int> DeviceMesh::ranks_of(const std::string& dim, int rank) const {
  const int t = rank % tp_, s = (rank / tp_) % shard_, p = rank / (tp_ * shard_);
  std::vector<int> out;
  if (dim == "tp") {
    for (int i = 0; i < tp_; ++i) out.push_back((p * shard_ + s) * tp_ + i);
  } else if (dim == "dp_shard") {
    for (int i = 0; i < shard_; ++i) out.push_back((p * shard_ + i) * tp_ + t);
  } else if (dim == "dp_replicate") {
    for (int i = 0; i < replicate_; ++i) out.push_back((i * shard_ + s) * tp_ + t);
  } else {  // dp
    for (int i = 0; i < replicate_ * shard_; ++i) out.push_back(i * tp_ + t);
  }
  return out;
}

int DeviceMesh::size(const std::string& dim) const {
  const std::string d = canonical(dim);
  if (d == "tp") return tp_;
  if (d == "dp_shard") return shard_;
  if (d == "dp_replicate") return replicate_;
  return replicate_ * shard_;
}

int DeviceMesh::get_local_rank(const std::string& dim) const { return get_group(dim).process_index(); }

const PartialState& DeviceMesh::get_group(const std::string& dim) const { return groups_.at(canonical(dim)); }

std::vector<int> DeviceMesh::group_ranks(const std::string& dim) const {
  return ranks_of(canonical(dim), state_.process_index());
}

}  // namespace accelerate
