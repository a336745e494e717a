// The sharded checkpoint format; see sharded_format.h.
#include "checkpoint/sharded_format.h"

#include "fsdp/rows.h"

#include <c10/util/Exception.h>

#include <filesystem>
#include <memory>

namespace accelerate::detail {

// Note [Sharded checkpoint layout]
// A sharded state (SHARDED_STATE_DICT or LOCAL_STATE_DICT) is a folder of its own inside the
// checkpoint: `pytorch_model_fsdp_<i>` for the i-th model, `optimizer_<i>` for the i-th optimizer
// (upstream's names for its sharded folders). In it:
// - `shard-<r>-of-<n>.safetensors`, one per process r of the n that saved: that process's tensors
//   under their global names (for a row-sharded tensor, its rows, as `rows_held` says: pieces of
//   ceil(rows / n) rows, the last ones shorter or empty), and the state's JSON values in the
//   metadata (as `save_state_dict_file` writes them);
// - `index.json`: {"format": "accelerate-cpp sharded state", "version": 1, "world_size": n,
//   "sharded": {name: whole shape}} — which tensors are split by rows, and their whole shapes.
// A tensor not in "sharded" is whole in every file. Loading with m processes gives each the rows
// `rows_held(rows, m, rank)` of every sharded tensor, copied from whichever files hold them (all
// of them at once when m = n: its own file), and its own file's (else the first file's) values
// and whole tensors. `accelerate merge-weights` joins the rows of every file into whole tensors.

namespace {

constexpr const char* kShardedFormat = "accelerate-cpp sharded state";

std::string shard_file(int rank, int world) {
  return "shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".safetensors";
}

}  // namespace

void save_sharded_state(const PartialState& state, const std::string& folder, const nlohmann::json& values,
                        const std::map<std::string, at::Tensor>& tensors,
                        const std::map<std::string, std::vector<int64_t>>& sharded) {
  const int world = state.num_processes();
  std::filesystem::create_directories(folder);
  StateDict mine{values, {}};
  for (const auto& [name, t] : tensors) mine.tensors.emplace(name, t.detach().contiguous());
  save_state_dict_file(mine, (std::filesystem::path(folder) / shard_file(state.process_index(), world)).string());
  if (state.process_index() == 0) {
    nlohmann::json index = {{"format", kShardedFormat}, {"version", 1}, {"world_size", world}};
    index["sharded"] = nlohmann::json::object();
    for (const auto& [name, shape] : sharded) index["sharded"][name] = shape;
    save_state_dict_file(StateDict{index, {}}, (std::filesystem::path(folder) / "index.json").string());
  }
}

namespace {

nlohmann::json read_sharded_index(const std::filesystem::path& root, const char* api) {
  const auto index_path = (root / "index.json").string();
  TORCH_CHECK_VALUE(std::filesystem::is_regular_file(index_path), "[", api, "] ", root.string(), " has no index.json");
  const auto index = load_state_dict_file(index_path).values;
  TORCH_CHECK_VALUE(index.value("format", "") == kShardedFormat && index.contains("world_size") &&
                        index["world_size"].is_number_integer() && index["world_size"].get<int64_t>() >= 1 &&
                        index["world_size"].get<int64_t>() <= 1000000 && index.contains("sharded") &&
                        index["sharded"].is_object(),
                    "[", api, "] ", index_path, " is not the index of a sharded state");
  for (const auto& [name, shape] : index["sharded"].items()) {
    bool valid = shape.is_array();
    for (const auto& d : shape) valid = valid && d.is_number_integer() && d.get<int64_t>() >= 0;
    TORCH_CHECK_VALUE(valid, "[", api, "] ", index_path, ": the shape of ", name, " is not a list of sizes");
  }
  return index;
}

}  // namespace

TensorMap merge_sharded_state(const std::string& folder) {
  const std::filesystem::path root(folder);
  const auto index = read_sharded_index(root, "merge_weights");
  const int saved = index["world_size"].get<int>();
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  for (int r = 0; r < saved; ++r) {
    const auto path = root / shard_file(r, saved);
    TORCH_CHECK_VALUE(std::filesystem::is_regular_file(path), "[merge_weights] ", folder, " has no ",
                      shard_file(r, saved), " (saved by ", saved, " processes)");
    files.push_back(std::make_unique<SafetensorsFile>(path.string()));
  }
  TensorMap out;
  for (const auto& name : files[0]->keys()) {
    if (!index["sharded"].contains(name)) {
      out.emplace(name, files[0]->get_tensor(name).clone());
      continue;
    }
    const auto shape = index["sharded"][name].get<std::vector<int64_t>>();
    const int64_t rows = shape.empty() ? 1 : shape[0];
    int64_t row_numel = 1;
    for (size_t d = 1; d < shape.size(); ++d) row_numel *= shape[d];
    std::vector<at::Tensor> pieces;
    for (int r = 0; r < saved; ++r) {
      TORCH_CHECK_VALUE(files[r]->contains(name), "[merge_weights] ", shard_file(r, saved), " has no ", name);
      auto piece = files[r]->get_tensor(name);
      const int64_t count = rows_held(rows, saved, r).second;
      TORCH_CHECK_VALUE(piece.numel() == count * row_numel, "[merge_weights] ", shard_file(r, saved), ": ", name,
                        " holds ", piece.numel(), " values where ", count, " rows of ", row_numel, " were expected");
      pieces.push_back(piece.reshape({count, row_numel}));
    }
    out.emplace(name, at::cat(pieces).reshape(shape));
  }
  return out;
}

StateDict load_sharded_state(const PartialState& state, const std::string& folder, bool same_world) {
  const std::filesystem::path root(folder);
  const auto index = read_sharded_index(root, "load_state");
  const int saved = index["world_size"].get<int>();
  const int world = state.num_processes();
  const int rank = state.process_index();
  TORCH_CHECK_VALUE(!same_world || saved == world, "[load_state] ", folder, " was saved by ", saved,
                    " processes as a LOCAL_STATE_DICT, which only loads on as many; this job has ", world,
                    " (SHARDED_STATE_DICT reshards)");
  const auto path_of = [&](int r) {
    const auto path = (root / shard_file(r, saved)).string();
    TORCH_CHECK_VALUE(std::filesystem::is_regular_file(path), "[load_state] ", folder, " has no ", shard_file(r, saved),
                      " (saved by ", saved, " processes)");
    return path;
  };
  StateDict own = load_state_dict_file(path_of(rank < saved ? rank : 0));
  if (saved == world) return own;
  std::map<int, std::unique_ptr<SafetensorsFile>> files;
  for (const auto& [name, shape_json] : index["sharded"].items()) {
    const auto shape = shape_json.get<std::vector<int64_t>>();
    const int64_t rows = shape.empty() ? 1 : shape[0];
    int64_t row_numel = 1;
    for (size_t d = 1; d < shape.size(); ++d) row_numel *= shape[d];
    const auto [first, count] = rows_held(rows, world, rank);
    std::vector<int64_t> local_shape = shape.empty() ? std::vector<int64_t>{count} : shape;
    if (!shape.empty()) local_shape[0] = count;
    at::Tensor out;
    for (int j = 0; j < saved; ++j) {
      const auto [their_first, their_count] = rows_held(rows, saved, j);
      const int64_t begin = std::max(first, their_first), end = std::min(first + count, their_first + their_count);
      auto& file = files[j];
      if (!file) file = std::make_unique<SafetensorsFile>(path_of(j));
      TORCH_CHECK_VALUE(file->contains(name), "[load_state] ", path_of(j), " has no ", name);
      auto theirs = file->get_tensor(name);
      TORCH_CHECK_VALUE(theirs.numel() == their_count * row_numel, "[load_state] ", path_of(j), ": ", name, " holds ",
                        theirs.numel(), " values where ", their_count, " rows of ", row_numel, " were expected");
      if (!out.defined()) out = at::empty({count, row_numel}, theirs.options());
      if (end > begin) {
        out.narrow(0, begin - first, end - begin)
            .copy_(theirs.reshape({their_count, row_numel}).narrow(0, begin - their_first, end - begin));
      }
    }
    own.tensors[name] = out.reshape(local_shape);
  }
  return own;
}


}  // namespace accelerate::detail
