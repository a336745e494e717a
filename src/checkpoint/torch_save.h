// Files in torch.save's format (a zip archive holding `data.pkl` and one record per storage):
// read into a StateDict without running any Python, and written so that Python's `torch.load`
// (weights_only included) reads them: the tensors' side, over the torch-free container of
// formats/torch_save.h. See Note [torch.save files] in torch_save.cpp.
#pragma once

#include "accelerate/checkpointing.h"
#include "detail/files.h"
#include "formats/pickle.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace accelerate::detail::checkpoint {

/// Options of `read_torch_save`.
struct TorchReadOptions {
  /// Modules whose objects may appear and are skipped: their place in the values becomes null
  /// and their qualified names are added to `skipped` (e.g. {"numpy"} for random states).
  std::vector<std::string> skippable_modules;
  std::vector<std::string>* skipped = nullptr;
};

/// Reads a torch.save file: plain values (None, bools, numbers, strings, lists, tuples, dicts and
/// OrderedDicts with string or integer keys) become JSON, tuples as arrays and integer keys as
/// strings; each tensor is taken out of the values into `tensors` under its dotted path
/// ("state.0.exp_avg"). Anything else (a class other than PyTorch's tensor, storage and
/// OrderedDict, the legacy non-zip format, a truncated archive, a storage too small for its
/// tensor) is refused with a c10::ValueError naming the path and what was found.
StateDict read_torch_save(const std::string& path, const TorchReadOptions& options = {});
/// The same, of the archive that lies `size` bytes from `offset` within the file at `path` (an
/// item of a torch.distributed.checkpoint file); a tensor at the top level is named "".
StateDict read_torch_save_at(const std::string& path, uint64_t offset, uint64_t size,
                             const TorchReadOptions& options = {});

/// Builds the values of a torch.save file, then writes it.
class TorchSaveWriter {
 public:
  pickle::Tree& tree() { return tree_; }
  /// A tensor (a contiguous CPU copy of it is written; its storage is not shared with others).
  const pickle::Value* tensor(const at::Tensor& tensor);
  /// `value` as Python values: objects become dicts with string keys, arrays lists.
  const pickle::Value* from_json(const nlohmann::json& value);
  /// `collections.OrderedDict` with `entries`.
  const pickle::Value* ordered_dict(std::vector<std::pair<const pickle::Value*, const pickle::Value*>> entries);
  /// Writes `root` to `path` (flushed to the disk and renamed into place).
  void write(const pickle::Value* root, const std::string& path);
  /// Appends the archive of `root` to `out`; the bytes appended. `what` names it in errors.
  uint64_t write_to(const pickle::Value* root, SequentialWriter& out, const std::string& what);

 private:
  pickle::Tree tree_;
  std::vector<at::Tensor> storages_;
};

}  // namespace accelerate::detail::checkpoint
