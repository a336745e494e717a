// `accelerate merge-weights`: merges a sharded safetensors checkpoint (`model.safetensors.index.json`
// and its shards) into one `model.safetensors` (upstream: accelerate/commands/merge.py and
// `merge_fsdp_weights`, which merge the per-rank files of FSDP's sharded state dict; sharded
// checkpoints here are the Hugging Face index and shards that `save_model` writes). The output is
// written atomically; pickled (`.bin`) output is not supported.
//
// Example:
//   accelerate merge-weights out/sharded out/merged     # writes out/merged/model.safetensors
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

namespace accelerate::commands {

/// Options of `merge_weights`.
struct MergeWeightsOptions {
  /// Write safetensors (the only format supported; false raises a ValueError, as pickled output
  /// is never written).
  bool safe_serialization = true;
  /// Remove `checkpoint_directory` after the merged file is safely written.
  bool remove_checkpoint_dir = false;
};

/// Merges the sharded checkpoint in `checkpoint_directory` into `<output_path>/model.safetensors`
/// (the folder is created if needed) and returns that file's path (upstream: `merge_fsdp_weights`).
/// Every shard the index lists must exist and every tensor it lists must be found in its shard,
/// and no tensor may be in two shards; otherwise, or when `output_path` is the input folder, a
/// ValueError is raised and nothing is written. The index's `metadata` is not copied; the merged
/// file carries {"format": "pt"}.
std::string merge_weights(const std::string& checkpoint_directory, const std::string& output_path,
                          const MergeWeightsOptions& options = {});

/// `accelerate merge-weights <checkpoint_directory> <output_path> [--remove_checkpoint_dir]`.
/// Returns 0, 1 on an error (printed to `err`), 2 for a usage error.
int merge_weights_main(const std::vector<std::string>& args, std::istream& in, std::ostream& out, std::ostream& err);

}  // namespace accelerate::commands
