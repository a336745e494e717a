// Upstream's `save_state` folder (Python Accelerate): its file names, and each kind of object's
// state converted between PyTorch's pickled form and the project's. save_state.cpp and
// load_state.cpp choose this layout; see Note [Checkpoints from and for Python] in
// python_layout.cpp.
#pragma once

#include "accelerate/checkpointing.h"
#include "accelerate/lr_scheduler.h"
#include "accelerate/utils/constants.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>
#include <vector>

namespace accelerate::detail::checkpoint::python_layout {

/// Upstream's file names: `model.safetensors` / `model_1.safetensors` (or `pytorch_model.bin` /
/// `pytorch_model_1.bin`), `optimizer.bin`, `scheduler.bin`, `scaler.pt`, `random_states_<p>.pkl`,
/// `custom_checkpoint_<i>.pkl`, `sampler.bin`, `dl_state_dict.bin`.
std::string model_file(size_t i, bool safetensors);
/// Upstream's FSDP's FULL_STATE_DICT file of model `i`: `pytorch_model_fsdp[_i].bin`.
std::string fsdp_model_file(size_t i);
std::string optimizer_file(size_t i);
std::string scheduler_file(size_t i);
std::string sampler_file(size_t i);
std::string loader_state_file(size_t i);
inline constexpr const char* kScalerFile = SCALER_NAME.data();
std::string random_file(int process_index);
std::string custom_file(size_t i);

/// Whether `folder` holds upstream's files rather than the project's: any of its pickled files
/// and no `random_states_<p>.safetensors`.
bool is_python_folder(const std::filesystem::path& folder);

/// The files of model `i` in `folder`: model[_i].safetensors, its sharded variant's index,
/// pytorch_model[_i].bin or its index, or upstream's FSDP's pytorch_model_fsdp[_i].bin; empty
/// when there are none. Safetensors first, as upstream.
std::vector<std::filesystem::path> model_files(const std::filesystem::path& folder, size_t i);
/// The tensors of a model's pickled files (pytorch_model.bin or the shards of its index).
TensorMap read_pickled_model(const std::vector<std::filesystem::path>& files);

/// An optimizer's state in PyTorch's layout (`py`, as read_torch_save lays out
/// `optimizer.state_dict()` or FSDP's `optim_state_dict`, whose parameters are named by module
/// path: `names` gives each of `optimizer`'s parameters' name, "" where none) in the project's
/// layout for `optimizer` (`optimizer_state_dict`'s): "step" tensors become integers, None entries
/// are dropped. Refuses `maximize=True` (LibTorch has none) and LBFGS, naming them; `path` names
/// the file in messages.
StateDict optimizer_from_pytorch(StateDict py, const torch::optim::Optimizer& optimizer,
                                 const std::vector<std::string>& names, const std::string& path);
/// The same, of the file `optimizer.bin`.
StateDict read_optimizer(const std::string& path, const torch::optim::Optimizer& optimizer,
                         const std::vector<std::string>& names = {});
/// Writes `state` (`optimizer_state_dict`'s layout) as PyTorch's `optimizer.state_dict()`, or,
/// given each parameter's name in `names`, as FSDP's `optim_state_dict` (parameters named).
void write_optimizer(const StateDict& state, const std::string& path, const std::vector<std::string>& names = {});
/// Adds to a param group of optimizer `kind` ("AdamW") the options PyTorch's groups carry and
/// LibTorch's lack, at PyTorch's defaults (maximize, foreach, fused, capturable, ...): a
/// torch.distributed.checkpoint load wants every key its own optimizer has.
void add_pytorch_group_options(const std::string& kind, nlohmann::json& group);
/// Writes a model's tensors as torch.save writes a state dict (an OrderedDict).
void write_pickled_model(const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& path);

/// A LambdaLR's state (the transformers schedules' too) from `scheduler.bin`, for `scheduler`.
/// OneCycleLR is refused: PyTorch keeps part of its state in the optimizer's param groups.
nlohmann::json read_scheduler(const std::string& path, const LRScheduler& scheduler);
void write_scheduler(const LRScheduler& scheduler, const std::string& path);

/// Why LBFGS's state does not cross (in the messages that refuse it).
extern const char* const kLbfgsReason;

/// The GradScaler's state (the same keys on both sides).
nlohmann::json read_scaler(const std::string& path);
void write_scaler(const nlohmann::json& state, const std::string& path);

/// A process's generators and step from `random_states_<p>.pkl`: tensor "torch_manual_seed",
/// "torch_cuda_manual_seed.<d>", and values {"step"}. What has no C++ counterpart (Python's
/// `random`, numpy, XLA) is added to `skipped`.
StateDict read_random(const std::string& path, std::vector<std::string>& skipped);
/// Writes `rng_state_dict()` and `step` as upstream does, with `random_state` and
/// `numpy_random_seed` holding the Mersenne Twister seeded with the CPU generator's initial seed
/// (numpy's `seed(s)` state), so that Python's `load_state` can restore them.
void write_random(const StateDict& generators, int64_t step, const std::string& path);

/// A registered object's state: a dict's plain values as JSON, its tensors by name.
StateDict read_custom(const std::string& path);
void write_custom(const StateDict& state, const std::string& path);

}  // namespace accelerate::detail::checkpoint::python_layout
