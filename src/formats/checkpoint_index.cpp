// The files of a safetensors checkpoint; see checkpoint_index.h.
#include "formats/checkpoint_index.h"

#include "detail/check.h"
#include "detail/files.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <set>

namespace accelerate::detail::checkpoint_index {

namespace fs = std::filesystem;

std::optional<fs::path> find_checkpoint_index(const fs::path& folder, const std::string& caller) {
  std::vector<fs::path> indexes;
  for (const auto& entry : fs::directory_iterator(folder)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && name.size() > 11 && name.compare(name.size() - 11, 11, ".index.json") == 0) {
      indexes.push_back(entry.path());
    }
  }
  if (indexes.empty()) return std::nullopt;
  std::sort(indexes.begin(), indexes.end());
  if (indexes.size() != 1) {
    raise_value_error(concat("[", caller, "] ", folder.string(), " contains more than one `.index.json` file (",
                             indexes[0].filename().string(), ", ", indexes[1].filename().string(),
                             "); delete the irrelevant ones"));
  }
  return indexes.front();
}

CheckpointFiles read_checkpoint_index(const fs::path& index, const std::string& caller) {
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(read_file(index.string()));
  } catch (const nlohmann::json::exception& e) {
    raise_value_error(concat("[", caller, "] the index ", index.string(), " is not valid JSON: ", e.what()));
  }
  if (json.is_object() && json.contains("weight_map")) json = json.at("weight_map");
  if (!json.is_object()) {
    raise_value_error(concat("[", caller, "] the index ", index.string(),
                             " should map tensor names to files (an object, or one under \"weight_map\")"));
  }
  CheckpointFiles files;
  files.index = index;
  std::set<std::string> names;
  for (const auto& [tensor, file] : json.items()) {
    if (!file.is_string()) {
      raise_value_error(concat("[", caller, "] the index ", index.string(), " maps ", tensor, " to ", file.dump(),
                               " where a file name was expected"));
    }
    const auto name = file.get<std::string>();
    const fs::path relative(name);
    bool escapes = relative.is_absolute() || relative.has_root_name() || name.empty();
    for (const auto& part : relative) escapes = escapes || part == "..";
    if (escapes) {
      raise_value_error(concat("[", caller, "] the index ", index.string(), " maps ", tensor, " to \"", name,
                               "\", which is outside the index's folder; only files inside it are read"));
    }
    files.weight_map.emplace(tensor, name);
    names.insert(name);
  }
  for (const auto& name : names) files.files.push_back(index.parent_path() / name);
  return files;
}

CheckpointFiles resolve_checkpoint(const std::string& checkpoint, const std::string& caller) {
  const fs::path path(checkpoint);
  if (fs::is_regular_file(path)) {
    if (path.extension() == ".json") return read_checkpoint_index(path, caller);
    return {.index = {}, .weight_map = {}, .files = {path}};
  }
  if (!fs::is_directory(path)) {
    raise_value_error(concat("[", caller, "] ", checkpoint,
                             " does not exist; pass a .safetensors file, a model.safetensors.index.json file or a "
                             "folder holding either"));
  }
  // The whole state first, pickled before safetensors (upstream's order), then an index.
  for (const auto* name : {"pytorch_model.bin", "model.safetensors"}) {
    if (fs::is_regular_file(path / name)) return {.index = {}, .weight_map = {}, .files = {path / name}};
  }
  if (auto index = find_checkpoint_index(path, caller)) return read_checkpoint_index(*index, caller);
  raise_value_error(concat("[", caller, "] ", checkpoint,
                           " is not a checkpoint: it holds neither pytorch_model.bin nor model.safetensors nor a "
                           "`.index.json` file"));
}

}  // namespace accelerate::detail::checkpoint_index
