// Sizes of a model's parts and where each part goes (upstream: the device-map half of
// accelerate/utils/modeling.py). Everything here reads only shapes and dtypes, so the model may
// live on the meta device (see `init_empty_weights` in big_modeling.h).
//
// Example:
//   auto device_map = accelerate::infer_auto_device_map(
//       *model, {.max_memory = accelerate::MaxMemory{{0, "10GiB"}, {"cpu", "30GiB"}}});
//   // {"embed": 0, "blocks.0": 0, …, "blocks.7": "cpu", "head": "disk"}
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace accelerate {

/// A place in a device map or a memory budget (upstream: an int for a GPU, or "cpu", "disk").
/// Ordered as upstream allocates: GPUs by index, then "cpu", then "disk".
class MapDevice {
 public:
  /// CUDA device `index` (an int key or value, as upstream's `{0: "10GiB"}`).
  MapDevice(int index);  // NOLINT(google-explicit-constructor): mirrors upstream's int keys
  /// "cpu", "disk", "cuda" (device 0) or "cuda:N"; anything else is a ValueError.
  MapDevice(const char* name);         // NOLINT(google-explicit-constructor)
  MapDevice(const std::string& name);  // NOLINT(google-explicit-constructor)
  /// A CPU or CUDA device.
  MapDevice(const c10::Device& device);  // NOLINT(google-explicit-constructor)

  bool is_gpu() const { return rank_ == 0; }
  bool is_cpu() const { return rank_ == 1; }
  bool is_disk() const { return rank_ == 2; }
  /// The CUDA index of a GPU (-1 otherwise).
  int index() const { return index_; }
  /// The device tensors go to: cuda:N or cpu. Raises a ValueError for "disk".
  c10::Device device() const;
  /// "0", "cpu" or "disk" (as upstream prints device maps).
  std::string str() const;

  friend bool operator==(const MapDevice& a, const MapDevice& b) { return a.rank_ == b.rank_ && a.index_ == b.index_; }
  friend bool operator<(const MapDevice& a, const MapDevice& b) {
    return a.rank_ != b.rank_ ? a.rank_ < b.rank_ : a.index_ < b.index_;
  }

 private:
  int rank_ = 1;    // 0 GPU, 1 cpu, 2 disk
  int index_ = -1;  // GPU index
};

std::ostream& operator<<(std::ostream& out, const MapDevice& device);

/// A memory budget in bytes, given as a number or as text ("10GiB", "200MB"; see
/// `convert_file_size_to_int`).
struct MemorySize {
  MemorySize(int64_t bytes) : bytes(bytes) {}  // NOLINT(google-explicit-constructor)
  MemorySize(int bytes) : bytes(bytes) {}      // NOLINT(google-explicit-constructor)
  MemorySize(const char* text);                // NOLINT(google-explicit-constructor)
  MemorySize(const std::string& text);         // NOLINT(google-explicit-constructor)
  int64_t bytes = 0;
};

/// Memory each device may hold (upstream: `max_memory`).
using MaxMemory = std::map<MapDevice, MemorySize>;
/// Module (or tensor) name -> where it goes; "" is the whole model (upstream: `device_map`).
using DeviceMap = std::map<std::string, MapDevice>;

/// `max_memory` with every device known (upstream: `get_max_memory`). Without one: the available
/// RAM (`MemAvailable`) for "cpu"; CUDA devices must then be given explicitly (LibTorch offers no
/// free-memory query without the CUDA runtime), which is a ValueError when some are visible.
MaxMemory get_max_memory(const std::optional<MaxMemory>& max_memory = std::nullopt);

/// The parameters and then the buffers of `module` (with `recurse`, of its submodules too) in
/// PyTorch's order (upstream: `named_module_tensors`); a tied tensor appears once, under its first
/// name. LibTorch has no non-persistent buffers, so every buffer counts.
std::vector<std::pair<std::string, at::Tensor>> named_module_tensors(const torch::nn::Module& module,
                                                                     bool include_buffers = true, bool recurse = false);

/// Bytes of each submodule and tensor, by dotted name; "" is the whole model (upstream:
/// `compute_module_sizes`). With `dtype`, floating-point tensors count at the smaller of their
/// size and `dtype`'s (integer and bool tensors are never converted); `special_dtypes` overrides
/// the dtype of single tensors. With `buffers_only`, only buffers count.
std::map<std::string, int64_t> compute_module_sizes(const torch::nn::Module& model,
                                                    std::optional<c10::ScalarType> dtype = std::nullopt,
                                                    const std::map<std::string, c10::ScalarType>& special_dtypes = {},
                                                    bool buffers_only = false);

/// One entry of the work lists the device-map search walks: a submodule or a direct tensor.
struct NamedModuleOrTensor {
  std::string name;
  std::shared_ptr<torch::nn::Module> module;  ///< null for a tensor
  at::Tensor tensor;
};

/// The class name a `no_split_module_classes` entry matches: `module.name()` without its
/// namespace and without a trailing "Impl" ("torch::nn::LinearImpl" -> "Linear",
/// "Block" -> "Block"). The full `name()` matches too.
std::string module_class_name(const torch::nn::Module& module);

/// The largest layer among `modules` and the names reaching that size (upstream:
/// `get_max_layer_size`): a layer is a module without children or one whose class is in
/// `no_split_module_classes`; other modules are opened up.
std::pair<int64_t, std::vector<std::string>> get_max_layer_size(
    const std::vector<NamedModuleOrTensor>& modules, const std::map<std::string, int64_t>& module_sizes,
    const std::vector<std::string>& no_split_module_classes);

/// Total size of a model and its largest layer (upstream: `calculate_maximum_sizes`).
struct MaximumSizes {
  int64_t total_size = 0;
  int64_t largest_layer_size = 0;
  std::vector<std::string> largest_layer_names;
};
MaximumSizes calculate_maximum_sizes(const torch::nn::Module& model,
                                     const std::vector<std::string>& no_split_module_classes = {});

/// Groups of parameter names that are the same tensor (upstream: `find_tied_parameters`). In
/// LibTorch a parameter is tied when a module registers another module's parameter (the same
/// tensor object) under its own name. Each group is sorted; groups are sorted by first name.
std::vector<std::vector<std::string>> find_tied_parameters(const torch::nn::Module& model);

/// Makes every name of each group hold the data of the first one not on the meta device again,
/// after loading broke the link (upstream: `retie_parameters`).
void retie_parameters(torch::nn::Module& model, const std::vector<std::vector<std::string>>& tied_params);

/// Options of `infer_auto_device_map` and `get_balanced_memory` (upstream's keyword arguments).
struct DeviceMapOptions {
  /// Budget per device; unset means what `get_max_memory()` finds.
  std::optional<MaxMemory> max_memory{};
  /// Class names (see `module_class_name`) never split across devices, e.g. residual blocks.
  std::vector<std::string> no_split_module_classes{};
  /// The dtype weights will be loaded in (sizes are computed for it).
  std::optional<c10::ScalarType> dtype{};
  /// Per-tensor dtypes overriding `dtype`.
  std::map<std::string, c10::ScalarType> special_dtypes{};
  /// Group submodules on one device under their parent's name.
  bool clean_result = true;
  /// Count the buffers of offloaded layers as offloaded too (otherwise they stay on the
  /// execution device and a warning says when they do not fit any GPU).
  bool offload_buffers = false;
  /// When nothing fits a device, search breadth-first for a smaller module that does.
  bool fallback_allocation = false;
  /// `get_balanced_memory` only: put as little as possible on GPU 0.
  bool low_zero = false;
  /// Print each decision.
  bool verbose = false;
};

/// A `max_memory` that spreads the model evenly over the GPUs it names (upstream:
/// `get_balanced_memory`): each GPU but the last gets the model size divided by the GPU count,
/// plus a buffer of 1.25 × the larger of the biggest no-split block and the mean leaf-module size.
/// With `low_zero`, GPU 0 gets only what the others cannot hold. CPU and disk budgets pass through.
MaxMemory get_balanced_memory(const torch::nn::Module& model, const DeviceMapOptions& options = {});

/// Where each part of `model` goes: GPUs in order, then the CPU, then the disk, never exceeding a
/// budget, always keeping room for the largest layer on the main devices (GPU 0 and the CPU), and
/// keeping tied parameters with the module that uses them first (upstream: `infer_auto_device_map`).
DeviceMap infer_auto_device_map(const torch::nn::Module& model, const DeviceMapOptions& options = {});

/// Groups the entries under `module_name` into one when they all go to the same place, then does
/// the same for each child (upstream: `clean_device_map`).
DeviceMap& clean_device_map(DeviceMap& device_map, const std::string& module_name = "");

/// Raises a ValueError naming every parameter and buffer of `model` that `device_map` gives no
/// place; warns about keys that name no submodule (upstream: `check_device_map`).
void check_device_map(const torch::nn::Module& model, const DeviceMap& device_map);

/// Moves the tensor `tensor_name` (dotted, e.g. "blocks.0.weight") of `module` to `device`, or
/// puts `value` there in its place (upstream: `set_module_tensor_to_device`). The module's tensor
/// object itself changes — every handle to it, tied names included, sees the new data, and a
/// parameter stays a parameter. `value` must have the tensor's shape (a ValueError otherwise);
/// floating-point values take `dtype` if given, else the tensor's current dtype. Moving a meta
/// tensor anywhere but "meta" without a value is a ValueError. Never records autograd history.
void set_module_tensor_to_device(torch::nn::Module& module, const std::string& tensor_name, const c10::Device& device,
                                 const std::optional<at::Tensor>& value = std::nullopt,
                                 std::optional<c10::ScalarType> dtype = std::nullopt);

/// The tensor named `tensor_name` (dotted) of `module`; a ValueError names it when there is none.
at::Tensor get_module_tensor(const torch::nn::Module& module, const std::string& tensor_name);

}  // namespace accelerate
