// Locating the files of a safetensors checkpoint given as a file, an index JSON
// (`model.safetensors.index.json`: {"metadata": …, "weight_map": {tensor: file}}) or a folder,
// for the commands that inspect or rewrite checkpoints without loading them into a module.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace accelerate::detail::checkpoint_index {

/// The files of a checkpoint.
struct CheckpointFiles {
  /// The index file; empty for a checkpoint of one file.
  std::filesystem::path index;
  /// Tensor name -> file name inside the index's folder (empty for one file).
  std::map<std::string, std::string> weight_map;
  /// The safetensors files: the one file, or the index's files sorted by name.
  std::vector<std::filesystem::path> files;
};

/// The `*.index.json` file of `folder`, or `std::nullopt` when it has none; more than one is an
/// error (a ValueError starting with "[caller]").
std::optional<std::filesystem::path> find_checkpoint_index(const std::filesystem::path& folder,
                                                           const std::string& caller);

/// Reads an index: a ValueError starting with "[caller]" and naming the file when it is not JSON,
/// does not map names to files, or names a file outside its folder (absolute or with "..").
CheckpointFiles read_checkpoint_index(const std::filesystem::path& index, const std::string& caller);

/// Resolves a file (an index when its name ends in `.json`), or a folder holding
/// `model.safetensors` or exactly one `*.index.json`. A missing path, a folder without either and
/// a pickled `pytorch_model.bin` are ValueErrors starting with "[caller]".
CheckpointFiles resolve_checkpoint(const std::string& checkpoint, const std::string& caller);

}  // namespace accelerate::detail::checkpoint_index
