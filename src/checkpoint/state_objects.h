// What `Accelerator::save_state` and `load_state` work on: the objects an Accelerator
// checkpoints, copied under its lock, with the sharded engines behind them, and the names of the
// files each kind of object is kept in (upstream's names). save_state.cpp writes them,
// load_state.cpp reads them back.
#pragma once

#include "accelerate/accelerator.h"
#include "accelerator_impl.h"
#include "checkpoint/sharded_format.h"
#include "fsdp/engine.h"

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace accelerate::detail::tensor_parallel {
class TensorParallelEngine;
}  // namespace accelerate::detail::tensor_parallel

namespace accelerate::detail::checkpoint {

/// The objects of a checkpoint, copied under the accelerator's lock.
struct CheckpointObjects {
  std::vector<DistributedDataParallel> models;
  std::vector<AcceleratedOptimizer> optimizers;
  std::vector<AcceleratedScheduler> schedulers;
  std::vector<DataLoader> loaders;
  std::vector<CheckpointObject> custom;
  std::vector<SaveStatePreHook> save_hooks;
  std::vector<LoadStatePreHook> load_hooks;
  int64_t step = 0;
  /// The fully sharded engine of each model, and of each optimizer's parameters (null: none;
  /// Note [Sharded checkpoint layout]).
  std::vector<fsdp::FsdpEngine*> model_engines;
  std::vector<fsdp::FsdpEngine*> optimizer_engines;
  /// The tensor-parallel engine of each model, and of each optimizer's parameters (null: none;
  /// Note [Checkpoints of split layers]).
  std::vector<tensor_parallel::TensorParallelEngine*> model_splits;
  std::vector<tensor_parallel::TensorParallelEngine*> optimizer_splits;
};

/// The accelerator's objects now.
CheckpointObjects checkpoint_objects(AcceleratorImpl& impl);

/// "<stem><ext>" for the first object, "<stem>_<i><ext>" for the others (upstream's naming).
std::string numbered(const std::string& stem, size_t i, const std::string& ext);
/// The file of data loader `i`.
std::string loader_file(const DataLoader& loader, size_t i);
/// A data loader's state as `save_state` stores it: without `use_stateful_dataloader` only the
/// order (epoch and generator) is kept and a resumed pass starts at its first batch, as upstream.
DataLoaderState sampler_state(const DataLoader& loader);
/// The custom checkpoint files of a folder, by index.
std::map<size_t, std::filesystem::path> custom_checkpoint_files(const std::filesystem::path& folder);

/// Whether `engine` saves sharded states (SHARDED_STATE_DICT or LOCAL_STATE_DICT), and whether
/// they only load at the same number of processes (LOCAL_STATE_DICT).
bool sharded_state(fsdp::FsdpEngine* engine);
bool local_state(fsdp::FsdpEngine* engine);
/// Where this process's part of a sharded state lies (Note [Sharded checkpoint layout]): rows of
/// `engine`'s shard group, of its piece of `split`'s group (either may be null).
ShardPlace shard_place(fsdp::FsdpEngine* engine, tensor_parallel::TensorParallelEngine* split);
/// The shape of the whole tensor of which `param` holds this process's part: all of `engine`'s
/// rows (when it shards `param`), and all of `split`'s pieces joined on its dimension (when it
/// splits `param`). Either may be null.
std::vector<int64_t> whole_tensor_shape(fsdp::FsdpEngine* engine, tensor_parallel::TensorParallelEngine* split,
                                        const at::Tensor& param);
/// The parameters of an optimizer in the numbering of `optimizer_state_dict`.
std::vector<at::Tensor> optimizer_params(const torch::optim::Optimizer& optimizer);
/// The name of each parameter of optimizer `i` (in `optimizer_params`' order) in the model that
/// holds it, "" for a parameter no model holds: FSDP's files name an optimizer's parameters so.
std::vector<std::string> optimizer_param_names(const CheckpointObjects& objects, size_t i);
/// The parameter number in an optimizer state tensor's name, "state.<index>.<name>".
size_t state_param_index(const std::string& key);

}  // namespace accelerate::detail::checkpoint
