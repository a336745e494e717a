// The device mesh; see include/accelerate/device_mesh.h.
#include "accelerate/device_mesh.h"

#include "detail/state_impl.h"

#include <c10/util/Exception.h>

namespace accelerate {
namespace {

constexpr int kDims = 4;
constexpr std::array<const char*, kDims> kNames = {"dp_replicate", "dp_shard", "cp", "tp"};
constexpr unsigned kAll = (1u << kDims) - 1;

unsigned bit(int d) { return 1u << d; }

// The flattened dimensions upstream's ParallelismConfig makes, by the dimensions they join.
struct Flattened {
  const char* name;
  unsigned dims;
};
constexpr std::array<Flattened, 3> kFlattened = {{{"dp", 0b0011}, {"dp_shard_cp", 0b0110}, {"dp_cp", 0b0111}}};

std::string names_of(unsigned dims) {
  std::string out;
  for (int d = 0; d < kDims; ++d) {
    if (dims & bit(d)) out += std::string(out.empty() ? "" : ", ") + kNames[static_cast<size_t>(d)];
  }
  return "{" + out + "}";
}

}  // namespace

// Note [The mesh's rank layout]
// Process r sits at (replicate, shard, cp, tp) = the digits of r in the mixed radix R × S × C × T,
// tp the fastest, as upstream's mesh. A group over a set of dimensions holds the processes that
// agree on every other coordinate, ordered by rank; so the flattened "dp_cp" of one tp rank has
// the dp_shard_cp groups as its consecutive runs of S·C and the replicate groups as its residues
// modulo S·C (what the fully sharded engine finds when it splits "dp_cp" itself). Dimensions of
// size 1 change no group, so a set is keyed without them and equal sets share their group.
struct DeviceMesh::Layout {
  PartialState state;
  std::array<int, kDims> sizes{};
  std::map<unsigned, PartialState> groups;  // by the set of dimensions of size above 1

  unsigned key(unsigned dims) const {
    unsigned out = 0;
    for (int d = 0; d < kDims; ++d) {
      if ((dims & bit(d)) && sizes[static_cast<size_t>(d)] > 1) out |= bit(d);
    }
    return out;
  }
  std::array<int, kDims> coordinates(int rank) const {
    std::array<int, kDims> c{};
    for (int d = kDims - 1; d >= 0; --d) {
      c[static_cast<size_t>(d)] = rank % sizes[static_cast<size_t>(d)];
      rank /= sizes[static_cast<size_t>(d)];
    }
    return c;
  }
  int rank_of(const std::array<int, kDims>& c) const {
    int r = 0;
    for (int d = 0; d < kDims; ++d) r = r * sizes[static_cast<size_t>(d)] + c[static_cast<size_t>(d)];
    return r;
  }
  // The ranks of `rank`'s group over `dims`, in increasing order (the last dimension counts fastest).
  std::vector<int> ranks_of(unsigned dims, int rank) const {
    std::vector<int> out;
    std::array<int, kDims> c = coordinates(rank);
    for (int d = 0; d < kDims; ++d) {
      if (dims & bit(d)) c[static_cast<size_t>(d)] = 0;
    }
    while (true) {
      out.push_back(rank_of(c));
      int d = kDims - 1;
      for (; d >= 0; --d) {
        if (!(dims & bit(d))) continue;
        if (++c[static_cast<size_t>(d)] < sizes[static_cast<size_t>(d)]) break;
        c[static_cast<size_t>(d)] = 0;
      }
      if (d < 0) return out;
    }
  }
  int size_of(unsigned dims) const {
    int n = 1;
    for (int d = 0; d < kDims; ++d) {
      if (dims & bit(d)) n *= sizes[static_cast<size_t>(d)];
    }
    return n;
  }
};

DeviceMesh::DeviceMesh(const PartialState& state, int dp_replicate_size, int dp_shard_size, int cp_size, int tp_size)
    : dims_(kAll) {
  TORCH_CHECK_VALUE(dp_replicate_size >= 1 && dp_shard_size >= 1 && cp_size >= 1 && tp_size >= 1,
                    "[DeviceMesh] every size must be at least 1, got dp_replicate ", dp_replicate_size, ", dp_shard ",
                    dp_shard_size, ", cp ", cp_size, ", tp ", tp_size);
  TORCH_CHECK_VALUE(dp_replicate_size * dp_shard_size * cp_size * tp_size == state.num_processes(),
                    "[DeviceMesh] dp_replicate_size (", dp_replicate_size, ") x dp_shard_size (", dp_shard_size,
                    ") x cp_size (", cp_size, ") x tp_size (", tp_size, ") must equal the number of processes, ",
                    state.num_processes());
  auto layout = std::make_shared<Layout>();
  layout->state = state;
  layout->sizes = {dp_replicate_size, dp_shard_size, cp_size, tp_size};
  std::vector<unsigned> sets;
  for (int d = 0; d < kDims; ++d) sets.push_back(bit(d));
  for (const auto& f : kFlattened) sets.push_back(f.dims);
  for (unsigned dims : sets) {
    const unsigned key = layout->key(dims);
    if (layout->groups.count(key)) continue;
    std::vector<std::vector<int>> groups;
    std::vector<bool> placed(static_cast<size_t>(state.num_processes()), false);
    for (int r = 0; r < state.num_processes(); ++r) {
      if (placed[static_cast<size_t>(r)]) continue;
      groups.push_back(layout->ranks_of(key, r));
      for (int member : groups.back()) placed[static_cast<size_t>(member)] = true;
    }
    std::string label = "mesh";
    for (int d = 0; d < kDims; ++d) {
      if (key & bit(d)) label += std::string("-") + kNames[static_cast<size_t>(d)];
    }
    layout->groups.emplace(key, detail::split_state(state, groups, label));
  }
  layout_ = std::move(layout);
}

unsigned DeviceMesh::dims_of(const std::string& dim) const {
  unsigned dims = 0;
  for (int d = 0; d < kDims; ++d) {
    if (dim == kNames[static_cast<size_t>(d)]) dims = bit(d);
  }
  for (const auto& f : kFlattened) {
    if (dim == f.name) dims = f.dims;
  }
  TORCH_CHECK_VALUE(dims != 0 && (dims & ~dims_) == 0, "[DeviceMesh] no dimension named \"", dim, "\" in this mesh, ",
                    "whose dimensions are ", names_of(dims_), (dims_ == kAll ? " and the flattened dp, dp_shard_cp "
                                                                               "and dp_cp"
                                                                             : ""));
  return dims;
}

const PartialState& DeviceMesh::group_of(unsigned dims, const std::string& name) const {
  auto it = layout_->groups.find(layout_->key(dims));
  TORCH_CHECK_VALUE(it != layout_->groups.end(), "[DeviceMesh] the dimensions ", name, " have no process group of "
                    "their own; groups exist for each dimension and for the flattened dp, dp_shard_cp and dp_cp");
  return it->second;
}

std::vector<std::string> DeviceMesh::mesh_dim_names() const {
  std::vector<std::string> out;
  for (int d = 0; d < kDims; ++d) {
    if (dims_ & bit(d)) out.emplace_back(kNames[static_cast<size_t>(d)]);
  }
  return out;
}

std::vector<int> DeviceMesh::shape() const {
  std::vector<int> out;
  for (int d = 0; d < kDims; ++d) {
    if (dims_ & bit(d)) out.push_back(layout_->sizes[static_cast<size_t>(d)]);
  }
  return out;
}

int DeviceMesh::size() const { return layout_->size_of(dims_); }
int DeviceMesh::size(const std::string& dim) const { return layout_->size_of(dims_of(dim)); }
int DeviceMesh::get_local_rank(const std::string& dim) const { return get_group(dim).process_index(); }
int DeviceMesh::get_local_rank() const { return get_group().process_index(); }

const PartialState& DeviceMesh::get_group(const std::string& dim) const { return group_of(dims_of(dim), dim); }

const PartialState& DeviceMesh::get_group() const {
  if (dims_ == kAll) return layout_->state;
  return group_of(dims_, names_of(dims_));
}

std::vector<int> DeviceMesh::group_ranks(const std::string& dim) const {
  return layout_->ranks_of(dims_of(dim), layout_->state.process_index());
}

DeviceMesh DeviceMesh::operator[](const std::string& dim) const { return DeviceMesh(layout_, dims_of(dim)); }

DeviceMesh DeviceMesh::operator[](const std::vector<std::string>& dims) const {
  TORCH_CHECK_VALUE(!dims.empty(), "[DeviceMesh] a sub-mesh needs at least one dimension");
  unsigned selected = 0;
  int last = -1;
  for (const auto& name : dims) {
    const unsigned d = dims_of(name);
    const int first = __builtin_ctz(d);
    TORCH_CHECK_VALUE(first > last && (selected & d) == 0, "[DeviceMesh] the dimensions of a sub-mesh go outermost ",
                      "first, each once (dp_replicate, dp_shard, cp, tp); got \"", name, "\" after ",
                      names_of(selected));
    last = 31 - __builtin_clz(d);
    selected |= d;
  }
  return DeviceMesh(layout_, selected);
}

const PartialState& DeviceMesh::state() const { return layout_->state; }

}  // namespace accelerate
