// The layouts of a `save_state` folder: the project's own (safetensors and JSON) and upstream
// Python Accelerate's (torch.save archives under upstream's names). One `Layout` object, chosen
// once from `CheckpointLayout` by `layout_to_save` or `layout_to_load`, is what every writer of
// save_state.cpp and every reader of load_state.cpp asks for a file's name and for how an object
// is written or read, so that a new layout is one more subclass in layout.cpp. What does not depend
// on the layout (sharded states, the commit protocol, registered objects' files found by
// extension) stays with the writers and readers.
#pragma once

#include "accelerate/checkpointing.h"
#include "accelerate/lr_scheduler.h"
#include "accelerate/state.h"
#include "accelerate/utils/dataclasses.h"
#include "accelerate/utils/safetensors.h"

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace accelerate::detail::checkpoint {

struct CheckpointObjects;

/// How a checkpoint folder holds each kind of object: file names, and the writing and reading of
/// the objects whose files differ between layouts. Models' safetensors files, sharded states and
/// data loaders' files are the same in every layout that keeps them.
class Layout {
 public:
  virtual ~Layout() = default;

  /// Refuses, on every process and before anything is written, what this layout cannot hold.
  virtual void check_savable(const CheckpointObjects& objects) const = 0;

  /// The files of model `i` when the layout names them itself (upstream's safetensors, pickled
  /// or sharded files), or `std::nullopt` for the project's own `model[_i].safetensors` beside
  /// its sharded folders `pytorch_model_fsdp_<i>`. Raises when the layout names files and none is
  /// there.
  virtual std::optional<std::vector<std::filesystem::path>> model_files(const std::filesystem::path& folder,
                                                                        size_t i) const = 0;

  /// Whether an optimizer's sharded folder `optimizer_<i>` is read, for an optimizer with or
  /// without a fully sharded engine.
  virtual bool reads_sharded_optimizer(bool has_engine) const = 0;
  virtual std::string optimizer_file(size_t i) const = 0;
  /// `names`: each parameter's name in its model, given for an optimizer over fully sharded
  /// parameters (upstream's FSDP files name them), empty otherwise.
  virtual void write_optimizer(const StateDict& state, const std::string& path,
                               const std::vector<std::string>& names) const = 0;

  /// Whether fully sharded models' and their optimizers' sharded states (SHARDED_STATE_DICT) are
  /// written as torch.distributed.checkpoint folders (upstream's) rather than the project's
  /// sharded format.
  virtual bool writes_dcp() const = 0;
  /// The file of fully sharded model `i`'s whole state (FULL_STATE_DICT) when the layout names
  /// one of its own (upstream's `pytorch_model_fsdp[_i].bin`, written by `write_fsdp_model`), or
  /// `std::nullopt` to write it as any model's.
  virtual std::optional<std::string> fsdp_model_file(size_t i) const = 0;
  virtual void write_fsdp_model(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                const std::string& path) const = 0;
  /// The state of `optimizer` in `path`; `file` is set when the tensors are views of it (to be
  /// read in bulk once every check passed).
  /// `names` gives each of the optimizer's parameters' name in its model ("" where none).
  virtual StateDict read_optimizer(const std::string& path, const torch::optim::Optimizer& optimizer,
                                   const std::vector<std::string>& names,
                                   std::unique_ptr<SafetensorsFile>& file) const = 0;

  virtual std::string scheduler_file(size_t i) const = 0;
  virtual void write_scheduler(const LRScheduler& scheduler, const std::string& path) const = 0;
  virtual StateDict read_scheduler(const std::string& path, const LRScheduler& scheduler) const = 0;

  /// Whether data loaders' states are written and read (upstream's hold pickled Python samplers).
  virtual bool keeps_data_loaders() const = 0;
  /// Warns, when loading, about what the folder holds that is not read.
  virtual void warn_skipped(const CheckpointObjects& objects, const std::filesystem::path& folder,
                            const PartialState& state) const = 0;

  virtual std::string scaler_file() const = 0;
  virtual void write_scaler(const nlohmann::json& state, const std::string& path) const = 0;
  virtual StateDict read_scaler(const std::string& path) const = 0;

  /// The file of registered object `i`, whose state is `state`.
  virtual std::string custom_file(size_t i, const StateDict& state) const = 0;
  virtual void write_custom(const StateDict& state, const std::string& path) const = 0;

  virtual std::string random_file(int process_index) const = 0;
  virtual void write_random(StateDict generators, int64_t step, const std::string& path) const = 0;
  /// The generators' states and the step in `path`, before they are checked.
  virtual StateDict read_random(const std::filesystem::path& path, const PartialState& state) const = 0;
};

/// The layout `save_state` writes; `CheckpointLayout::kDetect` is refused.
const Layout& layout_to_save(CheckpointLayout layout);
/// The layout `load_state` reads `folder` in: `layout`, or with `kDetect` the one the folder's
/// files are in.
const Layout& layout_to_load(CheckpointLayout layout, const std::filesystem::path& folder);

}  // namespace accelerate::detail::checkpoint
