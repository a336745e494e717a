// Running models larger than the memory given to them (upstream: accelerate/big_modeling.py):
// build the model without memory, compute where each part goes, load a checkpoint straight into
// that placement, and move offloaded weights in just before each part runs (see hooks.h for how
// the hooks reach LibTorch modules).
//
// Example:
//   auto model = accelerate::init_empty_weights([&] { return GPT(config); });
//   accelerate::load_checkpoint_and_dispatch(*model, "checkpoint/", {.device_map = "auto",
//       .max_memory = accelerate::MaxMemory{{"cpu", "2GiB"}}, .offload_folder = "offload"});
//   auto logits = accelerate::forward(model, tokens);
#pragma once

#include "accelerate/hooks.h"
#include "accelerate/utils/device_map.h"
#include "accelerate/utils/modeling.h"
#include "accelerate/utils/offload.h"

#include <c10/core/Device.h>
#include <torch/nn/module.h>

#include <functional>
#include <optional>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

namespace accelerate {

namespace detail {
/// Runs `factory` with tensor creation redirected to the meta device, then moves every tensor of
/// the module it returned to the meta device.
void run_on_meta(const std::function<void()>& factory);
void move_to_meta(torch::nn::Module& module);
}  // namespace detail

/// Builds a model whose parameters and buffers are on the meta device: shapes and dtypes without
/// memory (upstream: `init_empty_weights`, as a function taking the code that builds the model,
/// since LibTorch cannot patch `register_parameter`). `factory` returns a module holder or a
/// `shared_ptr` to a module. While it runs, initialisation code writes nothing; tensors it creates
/// get address space but no memory. Buffers go to the meta device too (upstream's
/// `include_buffers=True`): every LibTorch buffer is saved in checkpoints, so the checkpoint gives
/// them back. Use `set_module_tensor_to_device`, `load_checkpoint_in_model` or
/// `load_checkpoint_and_dispatch` to materialise it.
template <typename Factory>
auto init_empty_weights(Factory&& factory) {
  using Result = std::invoke_result_t<Factory>;
  std::optional<Result> result;
  detail::run_on_meta([&] { result.emplace(factory()); });
  detail::move_to_meta(detail::module_impl(*result));
  return std::move(*result);
}

/// Builds a model with its tensors on `device` (upstream: `init_on_device`). The meta device
/// behaves as `init_empty_weights`; other devices build on the CPU and then move there.
template <typename Factory>
auto init_on_device(const c10::Device& device, Factory&& factory) {
  if (device.is_meta()) return init_empty_weights(std::forward<Factory>(factory));
  auto result = factory();
  detail::module_impl(result).to(device);
  return result;
}

/// Adds hooks that keep `model`'s weights on the CPU (in `state_dict`, default: the model's own
/// tensors moved to the CPU) and bring each submodule's weights to `execution_device` only for its
/// forward (upstream: `cpu_offload`). Default execution device: that of the first parameter.
void cpu_offload(torch::nn::Module& model, std::optional<c10::Device> execution_device = std::nullopt,
                 bool offload_buffers = false, std::optional<TensorMap> state_dict = std::nullopt,
                 const std::vector<std::string>& preload_module_classes = {});

/// Like `cpu_offload` but with the weights in `offload_dir` (written there first, in the offload
/// layout, unless the folder already has an `index.json`) (upstream: `disk_offload`).
void disk_offload(torch::nn::Module& model, const std::string& offload_dir,
                  std::optional<c10::Device> execution_device = std::nullopt, bool offload_buffers = false,
                  const std::vector<std::string>& preload_module_classes = {});

/// Options of `dispatch_model`.
struct DispatchOptions {
  /// The device inputs go to and offloaded weights run on (default: the first GPU in the map,
  /// else the CPU).
  std::optional<c10::Device> main_device{};
  /// Weights of "cpu" entries when the main device is a GPU (default: taken from the model).
  std::optional<TensorMap> state_dict{};
  /// Folder of "disk" entries; written from the model unless it already has an `index.json`.
  std::optional<std::string> offload_dir{};
  /// An offload index to read "disk" weights from instead of a folder.
  std::optional<OffloadIndex> offload_index{};
  bool offload_buffers = false;
  std::vector<std::string> preload_module_classes{};
  /// Attach hooks even when everything is on one device.
  bool force_hooks = false;
};

/// Places `model` according to `device_map` and attaches the hooks that run it there (upstream:
/// `dispatch_model`): GPU entries are moved to their GPU, "cpu" and "disk" entries are offloaded
/// and run on the main device. The device map must cover every tensor (see `check_device_map`);
/// "disk" entries need `offload_dir` or `offload_index` (a ValueError naming them otherwise).
/// With one device and no disk, the model is simply moved there.
void dispatch_model(torch::nn::Module& model, const DeviceMap& device_map, const DispatchOptions& options = {});
/// The device map `model` was dispatched with by `dispatch_model` (or
/// `load_checkpoint_and_dispatch`), if it was (upstream: the model's `hf_device_map` attribute).
std::optional<DeviceMap> hf_device_map(const torch::nn::Module& model);

/// A device map, or how to compute one: "auto" / "balanced" / "balanced_low_0" (spread over the
/// GPUs with `get_balanced_memory`) or "sequential" (fill devices in order).
using DeviceMapSpec = std::variant<std::monostate, std::string, DeviceMap>;

/// Options of `load_checkpoint_in_model` with a device map and of `load_checkpoint_and_dispatch`.
struct BigModelLoadOptions {
  DeviceMapSpec device_map{};
  std::optional<MaxMemory> max_memory{};
  std::vector<std::string> no_split_module_classes{};
  /// Folder for weights mapped to "disk".
  std::optional<std::string> offload_folder{};
  bool offload_buffers = false;
  /// Floating-point weights are converted to this dtype.
  std::optional<c10::ScalarType> dtype{};
  /// With `dtype` float16, the floating-point weights of these modules stay float32 (see
  /// `LoadCheckpointOptions::keep_in_fp32_modules`).
  std::vector<std::string> keep_in_fp32_modules{};
  /// Raise on missing or unexpected keys.
  bool strict = false;
  std::vector<std::string> preload_module_classes{};
  bool force_hooks = false;
};

/// The device map `options.device_map` stands for, computed for `model` (upstream: the first half
/// of `load_checkpoint_and_dispatch`). A string other than the four known is a ValueError.
std::optional<DeviceMap> resolve_device_map(const torch::nn::Module& model, const BigModelLoadOptions& options);

/// Loads `checkpoint` (a safetensors or pickled `.bin` file, index or folder, as
/// `load_checkpoint_in_model`) into `model` according to `device_map`: weights mapped to a device
/// are materialised there, weights mapped to "disk" are recorded in `<offload_folder>/index.json`
/// (pointing into the checkpoint's safetensors files, so nothing is copied; a pickled file's
/// weights are written there as `<name>.dat`, as upstream's `offload_weight`) and left on the meta
/// device. Returns the offload index
/// (empty when nothing went to the disk).
OffloadIndex load_checkpoint_in_model(torch::nn::Module& model, const std::string& checkpoint,
                                      const DeviceMap& device_map, const BigModelLoadOptions& options = {});

/// Computes the device map, loads the checkpoint into it and dispatches the model (upstream:
/// `load_checkpoint_and_dispatch`). Without a device map the weights are loaded in place.
void load_checkpoint_and_dispatch(torch::nn::Module& model, const std::string& checkpoint,
                                  const BigModelLoadOptions& options = {});

/// The tensors of a safetensors checkpoint file, each on the device `device_map` gives its module
/// ("disk" entries load on the CPU) (upstream: `load_state_dict(checkpoint_file, device_map)`).
TensorMap load_state_dict(const std::string& checkpoint_file, const DeviceMap& device_map);

}  // namespace accelerate
