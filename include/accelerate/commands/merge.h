// `accelerate merge-weights`: merges a sharded checkpoint into one `model.safetensors` (upstream:
// accelerate/commands/merge.py and `merge_fsdp_weights`): a Hugging Face index and its shards (what
// `save_model` writes), a fully sharded model's folder of the project's sharded format, or a
// torch.distributed.checkpoint folder (`pytorch_model_fsdp_<i>`, what upstream's FSDP writes for
// SHARDED_STATE_DICT, or a checkpoint holding one). The output is written atomically; with
// `safe_serialization = false` it is torch.save's `pytorch_model.bin`.
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
  /// Write safetensors (`model.safetensors`); false: torch.save's `pytorch_model.bin`.
  bool safe_serialization = true;
  /// Remove `checkpoint_directory` after the merged file is safely written.
  bool remove_checkpoint_dir = false;
};

/// Merges the sharded checkpoint in `checkpoint_directory` into `<output_path>/model.safetensors`
/// (or `pytorch_model.bin`; the folder is created if needed) and returns that file's path
/// (upstream: `merge_fsdp_weights`). A torch.distributed.checkpoint folder must hold a model's
/// state (`{"model": ...}`, as upstream's FSDP saves it), whose chunks cover each tensor once.
/// Every shard the index lists must exist and every tensor it lists must be found in its shard,
/// and no tensor may be in two shards; otherwise, or when `output_path` is the input folder, a
/// ValueError is raised and nothing is written. The index's `metadata` is not copied; the merged
/// file carries {"format": "pt"}.
std::string merge_weights(const std::string& checkpoint_directory, const std::string& output_path,
                          const MergeWeightsOptions& options = {});

/// `accelerate merge-weights <checkpoint_directory> <output_path> [--unsafe_serialization]
/// [--remove_checkpoint_dir]`.
/// Returns 0, 1 on an error (printed to `err`), 2 for a usage error.
int merge_weights_main(const std::vector<std::string>& args, std::istream& in, std::ostream& out, std::ostream& err);

}  // namespace accelerate::commands
