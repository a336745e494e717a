// Model weights on disk (upstream: accelerate/utils/modeling.py and huggingface_hub's
// serialization helpers): a module's state dict, sharding it into safetensors files with
// Hugging Face's index (`model.safetensors`, or `model-00001-of-00003.safetensors` … plus
// `model.safetensors.index.json`), and loading a file, an index or a folder back into a module.
// Files written here load in Python with `transformers`' or Accelerate's loaders, and theirs here.
//
// Example:
//   accelerate::save_state_dict_sharded(accelerate::get_state_dict(*net), "out", "200MB");  // shards ≤ 200 MB
//   auto result = accelerate::load_checkpoint_in_model(*net, "out", {.strict = true});
#pragma once

#include "accelerate/utils/device_map.h"  // the device-map half of upstream's modeling module
#include "accelerate/utils/safetensors.h"

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/ordered_dict.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace accelerate {

/// Name -> tensor in the module's order (PyTorch's `state_dict()` order: a module's parameters,
/// then its buffers, then each child's entries under "<child>.").
using StateDictMap = torch::OrderedDict<std::string, at::Tensor>;

/// Bytes of a size written as digits and a unit: "10GB" (10^9), "5MiB" (2^20), "512KB", "1.5GiB",
/// a trailing lower-case "b" for bits ("8Mb" = 10^6 bytes), or plain digits for bytes (upstream:
/// `convert_file_size_to_int`). Raises a ValueError naming the text for anything else.
int64_t convert_file_size_to_int(const std::string& size);

/// The parameters and buffers of `module` and its children, detached, in PyTorch's order. Tied
/// tensors appear under every name they have (upstream: `model.state_dict()`).
StateDictMap get_state_dict(const torch::nn::Module& module);

/// `state_dict` without aliases: of the names sharing one storage only the first is kept
/// (with a warning listing the others), as safetensors cannot store shared memory
/// (upstream: `clean_state_dict_for_safetensors`).
StateDictMap clean_state_dict_for_safetensors(const StateDictMap& state_dict);

/// How a state dict is cut into files (upstream: huggingface_hub's `StateDictSplit`).
struct StateDictSplit {
  /// Each file and the names it holds, files in order.
  std::vector<std::pair<std::string, std::vector<std::string>>> filename_to_tensors;
  /// The file of each name.
  std::map<std::string, std::string> tensor_to_filename;
  /// Bytes of all tensors (the index's `metadata.total_size`).
  int64_t total_size = 0;
  /// Whether there is more than one file.
  bool is_sharded() const { return filename_to_tensors.size() > 1; }
};

/// Cuts `state_dict` into files of at most `max_shard_size` bytes, walking it in order and
/// starting a new file when the next tensor would overflow the current one; a tensor larger than
/// the limit gets a file of its own (upstream: `split_torch_state_dict_into_shards`). Names are
/// `filename_pattern` with "{suffix}" replaced by "" for one file, else by "-00001-of-00003" ….
StateDictSplit split_state_dict_into_shards(const StateDictMap& state_dict, int64_t max_shard_size,
                                            const std::string& filename_pattern = "model{suffix}.safetensors");

/// Writes `state_dict` (as from `get_state_dict`) to the folder `save_directory` (created if
/// needed): `model.safetensors` when it fits in `max_shard_size` (e.g. "10GB", see
/// `convert_file_size_to_int`), else numbered shards and `model.safetensors.index.json` with
/// `metadata.total_size` and `weight_map`. Aliased tensors are stored once; files carry the
/// metadata {"format": "pt"}. Weight files of an earlier save that the new one does not replace
/// are removed (shards of another count, `model.safetensors` when the new save is sharded, the
/// index when it is not), so a loader never mixes two saves. Every file is written to a
/// temporary name, flushed to the disk and renamed into place. This is the per-process part of
/// `Accelerator::save_model` (which writes on the main process only). A path that is a file is
/// refused with a ValueError.
void save_state_dict_sharded(const StateDictMap& state_dict, const std::string& save_directory,
                             const std::string& max_shard_size = "10GB");

/// The tensors of a checkpoint file (upstream: `accelerate.utils.load_state_dict` without a
/// device map): a safetensors file, or a `.bin` file written by torch.save holding a state dict
/// of tensors, read without running any of its code (anything but tensors, storages and
/// OrderedDicts is refused by name, like `torch.load(weights_only=True)`).
TensorMap load_state_dict(const std::string& checkpoint_file);

/// Options of `load_checkpoint_in_model`.
struct LoadCheckpointOptions {
  /// Convert floating-point weights to this dtype while loading (the module's tensors take it).
  std::optional<c10::ScalarType> dtype{};
  /// Raise when the checkpoint lacks a name of the module or holds a name the module lacks
  /// (otherwise both are warned about and returned).
  bool strict = false;
  /// Convert a tensor whose dtype differs from the module tensor it is loaded into (otherwise
  /// refused with a ValueError naming the file, the key and both dtypes, before anything changes;
  /// `dtype` asks for the conversion of floating-point weights by itself).
  bool convert_dtypes = false;
  /// With `dtype` float16, the floating-point weights of these modules are loaded in float32
  /// instead: a weight whose name contains "<module>." or is "<module>" (upstream's rule).
  std::vector<std::string> keep_in_fp32_modules{};
};

/// What a load found besides the weights it loaded.
struct LoadCheckpointResult {
  /// Names of the module that no file held (tied names count as loaded through their twin).
  std::vector<std::string> missing_keys;
  /// Names in the files that the module does not have.
  std::vector<std::string> unexpected_keys;
};

/// Loads weights into `module` from `checkpoint` (upstream: `load_checkpoint_in_model`): a
/// safetensors file or a pickled `.bin` file (torch.save's, read as `load_state_dict` reads it),
/// an index JSON (`weight_map` or a plain name -> file map, of either kind of file), or a folder
/// with `pytorch_model.bin`, `model.safetensors` (in upstream's order) or exactly one
/// `*.index.json`. Index entries must name files inside the
/// index's folder: absolute paths and ".." are refused. Each tensor is copied into the module's
/// own tensor (so optimizers and gradient-synchronisation buckets keep pointing at it); a shape
/// that differs is refused with a ValueError naming the key and both shapes, and so is a dtype
/// that differs unless `dtype` or `convert_dtypes` asks for the conversion (upstream converts
/// silently, which turns a checkpoint of another model's integers into NaN weights). A tensor goes
/// through `dtype` (floating-point ones only) and then to the module tensor's device and dtype.
/// Tensors holding NaN or infinity where the module's had none are named in a warning.
LoadCheckpointResult load_checkpoint_in_model(torch::nn::Module& module, const std::string& checkpoint,
                                              const LoadCheckpointOptions& options = {});

/// Copies the tensors of `tensors` into `module`'s tensors of the same names, as
/// `load_checkpoint_in_model` does for one file (upstream: `model.load_state_dict(state_dict,
/// strict)`). Raises before changing anything when a shape or (without `dtype` or
/// `convert_dtypes`) a dtype differs or, with `strict`, when a name is missing or unexpected.
LoadCheckpointResult load_state_dict_into_module(torch::nn::Module& module, const TensorMap& tensors,
                                                 const LoadCheckpointOptions& options = {});

/// Every module of `model`, each after all of its descendants and children in their order, with
/// `model` itself last (upstream: `get_module_children_bottom_up`): for a model R with children
/// A (a1, a2) and B, the order is a1, a2, A, B, R. A module registered twice under one parent
/// appears once there; one shared by two parents appears under each. Throws on a null model.
std::vector<std::shared_ptr<torch::nn::Module>> get_module_children_bottom_up(
    const std::shared_ptr<torch::nn::Module>& model);
/// `get_module_children_bottom_up` with each module's dotted name, "" for `model` (upstream: the
/// same function with `return_fqns=True`).
std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> get_named_module_children_bottom_up(
    const std::shared_ptr<torch::nn::Module>& model);

namespace modeling_detail {

/// Raises what `load_checkpoint_in_model(module, checkpoint, options)` would raise before its
/// first copy (files, names, shapes, dtypes), changing nothing. Not part of the API: what
/// `Accelerator::load_state` runs on every model before it changes any of them (Note [Loading
/// changes nothing or all]), so that one that fails cannot leave another loaded.
void check_checkpoint_in_model(torch::nn::Module& module, const std::string& checkpoint,
                               const LoadCheckpointOptions& options);

}  // namespace modeling_detail

}  // namespace accelerate
