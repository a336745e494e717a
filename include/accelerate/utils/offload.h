// Weights kept on the disk while a model runs (upstream: accelerate/utils/offload.py). The folder
// layout is upstream's: one raw file per tensor, `<name>.dat` (little-endian, C order; bf16
// stored as its 16-bit pattern), and `index.json` mapping each name to {"dtype", "shape"}.
// Entries may instead point into a safetensors file ({"safetensors_file", "weight_name"}), which
// is how a safetensors checkpoint is offloaded without copying it. Loading maps the file
// (copy-on-write), so a weight costs memory only while something holds it.
#pragma once

#include "accelerate/utils/safetensors.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace accelerate {

/// One entry of an offload `index.json`.
struct OffloadIndexEntry {
  /// NumPy's name of the stored dtype ("float32", "float16", "bfloat16", "int64", "bool", …).
  std::string dtype;
  /// The tensor's shape ([] for a 0-dim tensor, stored as one element).
  std::vector<int64_t> shape;
  /// Set when the data lives in a safetensors file instead of `<name>.dat`.
  std::string safetensors_file;
  /// The tensor's name inside `safetensors_file` (defaults to the entry's name).
  std::string weight_name;
};

/// Name -> entry, as in `index.json`.
using OffloadIndex = std::map<std::string, OffloadIndexEntry>;

/// Writes `weight` to `<offload_folder>/<weight_name>.dat` and records it in `index` when given
/// (upstream: `offload_weight`).
void offload_weight(const at::Tensor& weight, const std::string& weight_name, const std::string& offload_folder,
                    OffloadIndex* index = nullptr);

/// Maps a `.dat` file written by `offload_weight` as a CPU tensor of `entry`'s dtype and shape
/// (upstream: `load_offloaded_weight`). A file whose size does not match is a ValueError naming it.
at::Tensor load_offloaded_weight(const std::string& weight_file, const OffloadIndexEntry& entry);

/// Merges `index` into `<offload_folder>/index.json` (upstream: `save_offload_index`); the file is
/// replaced atomically.
void save_offload_index(const OffloadIndex& index, const std::string& offload_folder);

/// Reads `<offload_folder>/index.json`; a missing or malformed file is a ValueError naming it.
OffloadIndex load_offload_index(const std::string& offload_folder);

/// Writes every tensor of `state_dict` to `save_dir` (created if needed) and merges their entries
/// into its `index.json` (upstream: `offload_state_dict`).
void offload_state_dict(const std::string& save_dir, const TensorMap& state_dict);

/// Loads every weight of `index` from `offload_folder` into `module`, on the CPU (upstream:
/// `load_offloaded_weights`).
void load_offloaded_weights(torch::nn::Module& module, const OffloadIndex& index, const std::string& offload_folder);

/// A name -> tensor lookup the hooks read offloaded weights from (upstream: the `Mapping` passed
/// as `weights_map`).
class WeightsMap {
 public:
  virtual ~WeightsMap() = default;
  /// The tensor `key`; a ValueError naming it when there is none.
  virtual at::Tensor get(const std::string& key) const = 0;
  virtual bool contains(const std::string& key) const = 0;
  virtual std::vector<std::string> keys() const = 0;
};

/// Tensors held in memory, then those of an offload folder or index, read on each access
/// (upstream: `OffloadedWeightsLoader`). At least one source is required (a ValueError otherwise).
class OffloadedWeightsLoader : public WeightsMap {
 public:
  OffloadedWeightsLoader(TensorMap state_dict, std::optional<std::string> save_folder = std::nullopt,
                         std::optional<OffloadIndex> index = std::nullopt,
                         std::optional<c10::Device> device = std::nullopt);
  at::Tensor get(const std::string& key) const override;
  bool contains(const std::string& key) const override;
  std::vector<std::string> keys() const override;

 private:
  TensorMap state_dict_;
  std::string save_folder_;
  OffloadIndex index_;
  std::optional<c10::Device> device_;
};

/// The entries of `base` under "<prefix>", seen without the prefix (upstream: `PrefixedDataset`).
class PrefixedWeightsMap : public WeightsMap {
 public:
  PrefixedWeightsMap(std::shared_ptr<const WeightsMap> base, std::string prefix);
  at::Tensor get(const std::string& key) const override;
  bool contains(const std::string& key) const override;
  std::vector<std::string> keys() const override;

 private:
  std::shared_ptr<const WeightsMap> base_;
  std::string prefix_;
};

/// The entries of `state_dict` that belong to one of `submodule_names` (the name itself or under
/// "<name>.") (upstream: `extract_submodules_state_dict`).
TensorMap extract_submodules_state_dict(const TensorMap& state_dict, const std::vector<std::string>& submodule_names);

}  // namespace accelerate
