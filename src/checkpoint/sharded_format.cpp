// The sharded checkpoint format; see sharded_format.h.
#include "checkpoint/sharded_format.h"

#include "fsdp/rows.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <utility>

namespace accelerate::detail::checkpoint {

// Note [Sharded checkpoint layout]
// A sharded state (SHARDED_STATE_DICT or LOCAL_STATE_DICT) is a folder of its own inside the
// checkpoint: `pytorch_model_fsdp_<i>` for the i-th model, `optimizer_<i>` for the i-th optimizer
// (upstream's names for its sharded folders). In it:
// - `shard-<r>-of-<n>.safetensors`, one per process r of the n that saved: that process's tensors
//   under their global names (for a row-sharded tensor, its rows, as `fsdp::rows_held` says: pieces of
//   ceil(rows / n) rows, the last ones shorter or empty), and the state's JSON values in the
//   metadata (as `save_state_dict_file` writes them);
// - `index.json`: {"format": "accelerate-cpp sharded state", "version": 1, "world_size": n,
//   "sharded": {name: whole shape}} — which tensors are split by rows, and their whole shapes.
// A tensor not in "sharded" is whole in every file.
// Under tensor parallelism (version 2) the fully sharded engine shards each process's piece, so
// a file is `shard-<r>-of-<n>-tp-<t>-of-<T>.safetensors`, from process r of the fully sharded
// group of tensor-parallel rank t, and the index adds "tp_size": T and "split": {name: {"dim": d,
// "shape": whole shape}}. A split tensor's piece t is the t-th of T equal parts along d; rows are
// then taken of the piece. So each file holds a box of each whole tensor (an offset and a length
// in each dimension: `box_of`), and a process that loads, at any number of processes and any
// tp_size, wants a box computed alike from its own place; it copies the overlap of every file's
// box with its own. The tensors neither split nor sharded are whole in every file, and are read
// from the process's own file (else the first). `accelerate merge-weights` copies every file's
// box into the whole tensors.

namespace {

constexpr const char* kShardedFormat = "accelerate-cpp sharded state";

std::string shard_file(int rank, int world, int tp_rank = 0, int tp_size = 1) {
  std::string name = "shard-" + std::to_string(rank) + "-of-" + std::to_string(world);
  if (tp_size > 1) name += "-tp-" + std::to_string(tp_rank) + "-of-" + std::to_string(tp_size);
  return name + ".safetensors";
}

// How a saved tensor lies in the files.
struct Layout {
  std::vector<int64_t> whole;
  bool rows = false;   // row-sharded by the fully sharded engine
  int64_t split = -1;  // the dimension tensor parallelism split it on
};

struct Index {
  int world = 1, tp_size = 1;
  std::map<std::string, Layout> tensors;  // those sharded or split
};

using Box = ShardBox;

Box box_of(const Layout& layout, const ShardPlace& place) {
  return shard_box(layout.whole, layout.rows, layout.split, place);
}

// Copies the overlap of `from` (the box `src` holds) and `to` (the box `dst` holds) into `dst`;
// the number of values copied.
int64_t copy_overlap(const at::Tensor& dst, const Box& to, const at::Tensor& src, const Box& from) {
  at::Tensor d = dst, s = src;
  int64_t n = 1;
  for (size_t k = 0; k < to.offset.size(); ++k) {
    const int64_t begin = std::max(to.offset[k], from.offset[k]);
    const int64_t end = std::min(to.offset[k] + to.length[k], from.offset[k] + from.length[k]);
    if (end <= begin) return 0;
    d = d.narrow(static_cast<int64_t>(k), begin - to.offset[k], end - begin);
    s = s.narrow(static_cast<int64_t>(k), begin - from.offset[k], end - begin);
    n *= end - begin;
  }
  d.copy_(s);
  return n;
}

// The files of a saved state, opened as they are needed.
class ShardFiles {
 public:
  ShardFiles(std::filesystem::path root, const Index& index, const char* api)
      : root_(std::move(root)), index_(index), api_(api) {}
  std::string path(int r, int t) const {
    const auto path = (root_ / shard_file(r, index_.world, t, index_.tp_size)).string();
    TORCH_CHECK_VALUE(std::filesystem::is_regular_file(path), "[", api_, "] ", root_.string(), " has no ",
                      shard_file(r, index_.world, t, index_.tp_size), " (saved by ", index_.world * index_.tp_size,
                      " processes)");
    return path;
  }
  // File (r, t)'s part of `name`, shaped as its box.
  at::Tensor part(int r, int t, const std::string& name, const Box& box) {
    auto& file = files_[{r, t}];
    if (!file) file = std::make_unique<SafetensorsFile>(path(r, t));
    TORCH_CHECK_VALUE(file->contains(name), "[", api_, "] ", file->path(), " has no ", name);
    auto tensor = file->get_tensor(name);
    TORCH_CHECK_VALUE(tensor.numel() == box.numel(), "[", api_, "] ", file->path(), ": ", name, " holds ",
                      tensor.numel(), " values where ", box.numel(), " (", c10::IntArrayRef(box.length),
                      ") were expected");
    return tensor.reshape(box.length);
  }
  // Copies every file's part of `name` that overlaps `want` into `out`; the values copied.
  int64_t assemble(const std::string& name, const Layout& saved, const at::Tensor& out, const Box& want) {
    int64_t copied = 0;
    for (int t = 0; t < (saved.split >= 0 ? index_.tp_size : 1); ++t) {
      for (int r = 0; r < (saved.rows ? index_.world : 1); ++r) {
        const Box have = box_of(saved, {index_.world, r, index_.tp_size, t});
        bool overlaps = true;
        for (size_t k = 0; k < want.offset.size(); ++k) {
          overlaps = overlaps && std::max(want.offset[k], have.offset[k]) <
                                     std::min(want.offset[k] + want.length[k], have.offset[k] + have.length[k]);
        }
        if (overlaps) copied += copy_overlap(out, want, part(r, t, name, have), have);
      }
    }
    return copied;
  }

 private:
  std::filesystem::path root_;
  const Index& index_;
  const char* api_;
  std::map<std::pair<int, int>, std::unique_ptr<SafetensorsFile>> files_;
};

}  // namespace

ShardBox shard_box(const std::vector<int64_t>& whole, bool rows, int64_t split, const ShardPlace& place) {
  ShardBox b{std::vector<int64_t>(whole.size(), 0), whole};
  if (b.length.empty()) b = ShardBox{{0}, {1}};
  if (split >= 0) {
    b.length[split] /= place.tp_size;
    b.offset[split] = b.length[split] * place.tp_rank;
  }
  if (rows) {
    const auto [first, count] = fsdp::rows_held(b.length[0], place.world, place.rank);
    b.offset[0] += first;
    b.length[0] = count;
  }
  return b;
}

void save_sharded_state(const ShardPlace& place, const std::string& folder, const nlohmann::json& values,
                        const std::map<std::string, at::Tensor>& tensors,
                        const std::map<std::string, std::vector<int64_t>>& sharded,
                        const std::map<std::string, std::pair<int64_t, std::vector<int64_t>>>& split) {
  std::filesystem::create_directories(folder);
  StateDict mine{values, {}};
  for (const auto& [name, t] : tensors) mine.tensors.emplace(name, t.detach().contiguous());
  save_state_dict_file(mine, (std::filesystem::path(folder) /
                              shard_file(place.rank, place.world, place.tp_rank, place.tp_size)).string());
  if (place.rank == 0 && place.tp_rank == 0) {
    nlohmann::json index = {{"format", kShardedFormat}, {"version", place.tp_size > 1 ? 2 : 1},
                            {"world_size", place.world}};
    index["sharded"] = nlohmann::json::object();
    for (const auto& [name, shape] : sharded) index["sharded"][name] = shape;
    if (place.tp_size > 1) {
      index["tp_size"] = place.tp_size;
      index["split"] = nlohmann::json::object();
      for (const auto& [name, how] : split) index["split"][name] = {{"dim", how.first}, {"shape", how.second}};
    }
    save_state_dict_file(StateDict{index, {}}, (std::filesystem::path(folder) / "index.json").string());
  }
}

namespace {

bool is_shape(const nlohmann::json& shape) {
  bool valid = shape.is_array();
  for (const auto& d : shape) valid = valid && d.is_number_integer() && d.get<int64_t>() >= 0;
  return valid;
}

Index read_sharded_index(const std::filesystem::path& root, const char* api) {
  const auto index_path = (root / "index.json").string();
  TORCH_CHECK_VALUE(std::filesystem::is_regular_file(index_path), "[", api, "] ", root.string(), " has no index.json");
  const auto json = load_state_dict_file(index_path).values;
  const auto count = [&](const char* key, int64_t fallback) {
    if (!json.contains(key)) return fallback;
    return json[key].is_number_integer() ? json[key].get<int64_t>() : int64_t{-1};
  };
  const int64_t world = count("world_size", -1), tp_size = count("tp_size", 1);
  TORCH_CHECK_VALUE(json.value("format", "") == kShardedFormat && world >= 1 && world <= 1000000 && tp_size >= 1 &&
                        tp_size <= 1000000 && json.contains("sharded") && json["sharded"].is_object() &&
                        (!json.contains("split") || json["split"].is_object()),
                    "[", api, "] ", index_path, " is not the index of a sharded state");
  Index index{static_cast<int>(world), static_cast<int>(tp_size), {}};
  for (const auto& [name, shape] : json["sharded"].items()) {
    TORCH_CHECK_VALUE(is_shape(shape), "[", api, "] ", index_path, ": the shape of ", name, " is not a list of sizes");
    index.tensors[name] = Layout{shape.get<std::vector<int64_t>>(), true, -1};
  }
  if (json.contains("split")) {
    for (const auto& [name, how] : json["split"].items()) {
      const bool valid = how.is_object() && how.contains("dim") && how["dim"].is_number_integer() &&
                         how.contains("shape") && is_shape(how["shape"]);
      TORCH_CHECK_VALUE(valid, "[", api, "] ", index_path, ": the split of ", name, " is not {\"dim\", \"shape\"}");
      auto& layout = index.tensors[name];
      const auto shape = how["shape"].get<std::vector<int64_t>>();
      const int64_t dim = how["dim"].get<int64_t>();
      TORCH_CHECK_VALUE(dim >= 0 && dim < static_cast<int64_t>(shape.size()) && shape[dim] % tp_size == 0 &&
                            (!layout.rows || layout.whole == shape),
                        "[", api, "] ", index_path, ": ", name, " cannot be split along dimension ", dim, " of ",
                        c10::IntArrayRef(shape), " in ", tp_size, " pieces");
      layout.whole = shape;
      layout.split = dim;
    }
  }
  return index;
}

}  // namespace

TensorMap merge_sharded_state(const std::string& folder) {
  const std::filesystem::path root(folder);
  const auto index = read_sharded_index(root, "merge_weights");
  ShardFiles files(root, index, "merge_weights");
  for (int t = 0; t < index.tp_size; ++t) {
    for (int r = 0; r < index.world; ++r) (void)files.path(r, t);  // every file is there
  }
  TensorMap out;
  for (const auto& name : SafetensorsFile(files.path(0, 0)).keys()) {
    auto it = index.tensors.find(name);
    if (it == index.tensors.end()) {
      out.emplace(name, SafetensorsFile(files.path(0, 0)).get_tensor(name).clone());
      continue;
    }
    const Layout& saved = it->second;
    const Box whole = box_of(Layout{saved.whole, false, -1}, {});
    auto first = SafetensorsFile(files.path(0, 0)).get_tensor(name);
    auto merged = at::empty(whole.length, first.options());
    const int64_t copied = files.assemble(name, saved, merged, whole);
    TORCH_CHECK_VALUE(copied == whole.numel(), "[merge_weights] ", folder, ": the files hold ", copied, " of the ",
                      whole.numel(), " values of ", name);
    out.emplace(name, merged.reshape(saved.whole));
  }
  return out;
}

StateDict load_sharded_state(const ShardPlace& place, const std::string& folder, bool same_world,
                             const SplitDimOf& split_dim) {
  const std::filesystem::path root(folder);
  const auto index = read_sharded_index(root, "load_state");
  const auto processes = [](int world, int tp_size) {
    return tp_size == 1 ? std::to_string(world)
                        : c10::str(world * tp_size, " (", world, " sharded x tp_size ", tp_size, ")");
  };
  TORCH_CHECK_VALUE(!same_world || (index.world == place.world && index.tp_size == place.tp_size), "[load_state] ",
                    folder, " was saved by ", processes(index.world, index.tp_size), " processes as a LOCAL_STATE_DICT, "
                    "which only loads on as many; this job has ", processes(place.world, place.tp_size),
                    " (SHARDED_STATE_DICT reshards)");
  ShardFiles files(root, index, "load_state");
  StateDict own = load_state_dict_file(
      files.path(place.rank < index.world ? place.rank : 0, place.tp_rank < index.tp_size ? place.tp_rank : 0));
  if (index.world == place.world && index.tp_size == 1 && place.tp_size == 1) return own;
  for (auto& [name, tensor] : own.tensors) {
    auto it = index.tensors.find(name);
    const Layout saved = it != index.tensors.end() ? it->second : Layout{tensor.sizes().vec(), false, -1};
    Layout here = saved;
    here.split = split_dim && place.tp_size > 1 ? split_dim(name, saved.whole) : -1;
    if (!saved.rows && saved.split < 0 && here.split < 0) continue;  // whole in every file
    TORCH_CHECK_VALUE(here.split < static_cast<int64_t>(saved.whole.size()) &&
                          (here.split < 0 || saved.whole[here.split] % place.tp_size == 0),
                      "[load_state] ", folder, ": ", name, " has shape ", c10::IntArrayRef(saved.whole),
                      ", which tp_size ", place.tp_size, " does not divide along dimension ", here.split);
    const Box want = box_of(here, place);
    auto out = at::empty(want.length, tensor.options());
    files.assemble(name, saved, out, want);
    tensor = out;
  }
  return own;
}

}  // namespace accelerate::detail::checkpoint
