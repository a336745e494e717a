// Big-model inference (big_modeling.h): building without memory, placing the parts by a device
// map, and loading a checkpoint straight into that placement.
#include "utils/checkpoint_file.h"
#include "accelerate/big_modeling.h"

#include "formats/checkpoint_index.h"
#include "detail/dtype_names.h"
#include "detail/module_table.h"
#include "detail/warn.h"

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <set>

namespace fs = std::filesystem;

namespace accelerate {

namespace detail {

// Note [Building on the meta device]
// Python's `init_empty_weights` patches `register_parameter`. LibTorch modules create their
// tensors with factory functions and then initialise them in place, so instead the Meta key is
// added to this thread's dispatch keys while the factory runs: factory functions still allocate
// (address space only — they go through backend selection), but every initialisation kernel
// dispatches to its meta version and touches nothing. The tensors are then swapped for real meta
// tensors. The thread's key set is restored exactly as saved: the scoped include guard of this
// LibTorch version removes more than it added for a per-backend key such as Meta.
void run_on_meta(const std::function<void()>& factory) {
  const auto saved = c10::impl::tls_local_dispatch_key_set();
  c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::Meta, true);
  try {
    factory();
  } catch (...) {
    c10::impl::_force_tls_local_dispatch_key_set(saved);
    throw;
  }
  c10::impl::_force_tls_local_dispatch_key_set(saved);
}

void move_to_meta(torch::nn::Module& module) {
  for (const auto& [name, tensor] : named_module_tensors(module, true, true)) {
    if (!tensor.defined() || tensor.is_meta()) continue;
    set_module_tensor_to_device(module, name, c10::kMeta);
  }
}

}  // namespace detail

namespace {

// The device map each dispatched model was given (upstream: its `hf_device_map` attribute).
detail::ModuleTable<DeviceMap>& device_maps() {
  static detail::ModuleTable<DeviceMap> table;
  return table;
}

TensorMap to_tensor_map(const StateDictMap& state_dict) {
  TensorMap out;
  for (const auto& item : state_dict) out[item.key()] = item.value();
  return out;
}

// The map entry whose module holds tensor `name` (the longest matching prefix).
const MapDevice* device_of(const DeviceMap& device_map, const std::string& name) {
  const MapDevice* best = nullptr;
  size_t best_length = 0;
  for (const auto& [module, device] : device_map) {
    const bool match =
        module.empty() || name == module ||
        (name.size() > module.size() && name.compare(0, module.size(), module) == 0 && name[module.size()] == '.');
    if (match && (best == nullptr || module.size() >= best_length)) {
      best = &device;
      best_length = module.size();
    }
  }
  return best;
}

std::optional<c10::Device> first_parameter_device(const torch::nn::Module& model) {
  for (const auto& p : model.named_parameters(true)) {
    if (p.value().defined() && !p.value().is_meta()) return p.value().device();
  }
  return std::nullopt;
}

}  // namespace

void cpu_offload(torch::nn::Module& model, std::optional<c10::Device> execution_device, bool offload_buffers,
                 std::optional<TensorMap> state_dict, const std::vector<std::string>& preload_module_classes) {
  const auto device = execution_device.value_or(first_parameter_device(model).value_or(c10::Device(c10::kCPU)));
  if (!state_dict) {
    state_dict = TensorMap{};
    for (const auto& item : get_state_dict(model)) (*state_dict)[item.key()] = item.value().to(c10::kCPU);
  }
  AlignDevicesOptions root;
  root.io_same_device = true;
  add_hook_to_module(model, std::make_shared<AlignDevicesHook>(root), /*append=*/true);
  auto weights = std::make_shared<OffloadedWeightsLoader>(std::move(*state_dict), std::nullopt, OffloadIndex{});
  attach_align_device_hook(model, device, true, weights, offload_buffers, "", preload_module_classes,
                           std::make_shared<OffloadPrefetcher>());
}

void disk_offload(torch::nn::Module& model, const std::string& offload_dir, std::optional<c10::Device> execution_device,
                  bool offload_buffers, const std::vector<std::string>& preload_module_classes) {
  if (!fs::is_regular_file(fs::path(offload_dir) / "index.json")) {
    offload_state_dict(offload_dir, to_tensor_map(get_state_dict(model)));
  }
  const auto device = execution_device.value_or(first_parameter_device(model).value_or(c10::Device(c10::kCPU)));
  auto weights = std::make_shared<OffloadedWeightsLoader>(TensorMap{}, offload_dir);
  AlignDevicesOptions root;
  root.io_same_device = true;
  add_hook_to_module(model, std::make_shared<AlignDevicesHook>(root), /*append=*/true);
  attach_align_device_hook(model, device, true, weights, offload_buffers, "", preload_module_classes,
                           std::make_shared<OffloadPrefetcher>());
}

void dispatch_model(torch::nn::Module& model, const DeviceMap& device_map, const DispatchOptions& options) {
  check_device_map(model, device_map);
  std::set<MapDevice> devices;
  for (const auto& [name, device] : device_map) devices.insert(device);
  const bool has_disk = devices.count(MapDevice("disk")) > 0;
  if (devices.size() <= 1 && !has_disk && !options.force_hooks) {
    if (!devices.empty()) model.to(devices.begin()->device());
    device_maps().set(model, device_map);
    return;
  }
  c10::Device main_device = c10::kCPU;
  if (options.main_device) {
    main_device = *options.main_device;
  } else {
    for (const auto& d : devices) {
      if (d.is_gpu()) {
        main_device = d.device();
        break;
      }
    }
  }
  std::vector<std::string> cpu_modules;
  std::vector<std::string> disk_modules;
  for (const auto& [name, device] : device_map) {
    if (device.is_cpu()) cpu_modules.push_back(name);
    if (device.is_disk()) disk_modules.push_back(name);
  }
  std::optional<TensorMap> state_dict = options.state_dict;
  if (!main_device.is_cpu() && !state_dict && !cpu_modules.empty()) {
    state_dict = extract_submodules_state_dict(to_tensor_map(get_state_dict(model)), cpu_modules);
  }
  if (!disk_modules.empty() && !options.offload_dir && !options.offload_index) {
    TORCH_CHECK_VALUE(false,
                      "We need an `offload_dir` to dispatch this model according to this `device_map`, the "
                      "following submodules need to be offloaded: ",
                      c10::Join(", ", disk_modules), ".");
  }
  if (!disk_modules.empty() && !options.offload_index &&
      !fs::is_regular_file(fs::path(*options.offload_dir) / "index.json")) {
    offload_state_dict(*options.offload_dir,
                       extract_submodules_state_dict(to_tensor_map(get_state_dict(model)), disk_modules));
  }
  // A tied parameter shared by an offloaded and a resident module would be put on the meta device
  // after the offloaded one runs, under the resident one too.
  const bool cpu_offloaded = !main_device.is_cpu();
  auto offloaded = [&](const MapDevice& d) { return d.is_disk() || (cpu_offloaded && d.is_cpu()); };
  for (const auto& group : find_tied_parameters(model)) {
    std::set<bool> kinds;
    for (const auto& name : group) {
      if (const auto* d = device_of(device_map, name)) kinds.insert(offloaded(*d));
    }
    TORCH_CHECK_VALUE(kinds.size() <= 1, "[dispatch_model] the tied parameters ", c10::Join(", ", group),
                      " are split between offloaded and resident modules; put their modules on the same device");
  }
  std::map<std::string, c10::Device> execution_device;
  std::map<std::string, bool> offload;
  for (const auto& [name, device] : device_map) {
    execution_device.emplace(name, device.is_gpu() ? device.device() : main_device);
    offload.emplace(name, offloaded(device));
  }
  execution_device.insert_or_assign("", main_device);
  std::shared_ptr<const WeightsMap> weights_map;
  const bool use_folder = !disk_modules.empty() && options.offload_dir.has_value();
  if (state_dict || use_folder || options.offload_index) {
    std::optional<std::string> folder;
    if (use_folder) folder = *options.offload_dir;
    std::optional<c10::Device> device;
    if (options.offload_index) device = main_device;
    weights_map = std::make_shared<OffloadedWeightsLoader>(state_dict.value_or(TensorMap{}), folder,
                                                           options.offload_index, device);
  }
  const bool offloading = std::any_of(offload.begin(), offload.end(), [](const auto& o) { return o.second; });
  attach_align_device_hook_on_blocks(model, execution_device, offload, weights_map, options.offload_buffers, "",
                                     options.preload_module_classes,
                                     offloading ? std::make_shared<OffloadPrefetcher>() : nullptr);
  std::vector<std::string> places;
  if (!cpu_modules.empty() && cpu_offloaded) places.emplace_back("cpu");
  if (!disk_modules.empty()) places.emplace_back("disk");
  if (!places.empty()) {
    detail::warn("accelerate.big_modeling",
                 c10::str("Some parameters are on the meta device because they were offloaded to the ",
                          c10::Join(" and ", places), "."),
                 {.once = true});
  }
  device_maps().set(model, device_map);
}

std::optional<DeviceMap> hf_device_map(const torch::nn::Module& model) { return device_maps().get(model); }

std::optional<DeviceMap> resolve_device_map(const torch::nn::Module& model, const BigModelLoadOptions& options) {
  if (std::holds_alternative<std::monostate>(options.device_map)) return std::nullopt;
  if (const auto* map = std::get_if<DeviceMap>(&options.device_map)) return *map;
  const auto& how = std::get<std::string>(options.device_map);
  TORCH_CHECK_VALUE(how == "auto" || how == "balanced" || how == "balanced_low_0" || how == "sequential",
                    "If passing a string for `device_map`, please choose 'auto', 'balanced', 'balanced_low_0' or "
                    "'sequential' (got '",
                    how, "').");
  DeviceMapOptions map_options;
  map_options.max_memory = options.max_memory;
  map_options.no_split_module_classes = options.no_split_module_classes;
  map_options.dtype = options.dtype;
  map_options.offload_buffers = options.offload_buffers;
  if (how != "sequential") {
    map_options.low_zero = how == "balanced_low_0";
    map_options.max_memory = get_balanced_memory(model, map_options);
  }
  return infer_auto_device_map(model, map_options);
}

OffloadIndex load_checkpoint_in_model(torch::nn::Module& model, const std::string& checkpoint,
                                      const DeviceMap& device_map, const BigModelLoadOptions& options) {
  check_device_map(model, device_map);
  const auto layout = detail::checkpoint_index::resolve_checkpoint(checkpoint, "load_checkpoint_in_model");
  bool any_disk = false;
  for (const auto& [name, device] : device_map) any_disk = any_disk || device.is_disk();
  TORCH_CHECK_VALUE(!any_disk || options.offload_folder.has_value(),
                    "At least one of the model submodule will be offloaded to disk, please pass along an "
                    "`offload_folder`.");
  std::map<std::string, at::Tensor> targets;
  for (const auto& [name, tensor] : named_module_tensors(model, true, true)) targets.emplace(name, tensor);
  std::set<std::string> seen;
  std::vector<std::string> unexpected;
  // Validate every file's names and shapes before anything changes.
  std::vector<detail::CheckpointFile> files;
  for (const auto& path : layout.files) files.emplace_back(path);
  for (const auto& file : files) {
    for (const auto& key : file.keys()) {
      auto it = targets.find(key);
      if (it == targets.end()) {
        unexpected.push_back(key);
        continue;
      }
      seen.insert(key);
      TORCH_CHECK_VALUE(it->second.sizes() == at::IntArrayRef(file.shape(key)),
                        "[load_checkpoint_in_model] size mismatch for ", key, " in ", file.path(),
                        ": the checkpoint has shape ", c10::IntArrayRef(file.shape(key)), ", the module has ",
                        it->second.sizes());
    }
  }
  std::vector<std::string> missing;
  for (const auto& [name, tensor] : targets) {
    if (!seen.count(name)) missing.push_back(name);
  }
  TORCH_CHECK_VALUE(!options.strict || (missing.empty() && unexpected.empty()),
                    "[load_checkpoint_in_model] error(s) in loading ", checkpoint, ": missing keys [",
                    c10::Join(", ", missing), "], unexpected keys [", c10::Join(", ", unexpected), "]");
  std::set<std::string> buffers;
  for (const auto& b : model.named_buffers(true)) buffers.insert(b.key());
  const MapDevice cpu("cpu");
  OffloadIndex index;
  for (const auto& file : files) {
    for (const auto& key : file.keys()) {
      if (!targets.count(key)) continue;
      const MapDevice* place = device_of(device_map, key);
      TORCH_CHECK_VALUE(place != nullptr, "[load_checkpoint_in_model] the device map gives no device for ", key);
      // Buffers of offloaded modules stay in memory unless `offload_buffers` (as upstream).
      if (place->is_disk() && !options.offload_buffers && buffers.count(key)) place = &cpu;
      const auto stored = file.dtype(key);
      const auto asked = detail::load_dtype(key, options.dtype, options.keep_in_fp32_modules);
      if (place->is_disk()) {
        const auto held = asked && c10::isFloatingType(stored) ? *asked : stored;
        if (file.pickled()) {  // written out, as upstream's offload_weight does
          offload_weight(file.get_tensor(key).to(held), key, *options.offload_folder, &index);
        } else {
          OffloadIndexEntry entry;
          entry.safetensors_file = fs::absolute(file.path()).string();
          entry.weight_name = key;
          if (held != stored) entry.dtype = detail::numpy_dtype_name(held);
          entry.shape = file.shape(key);
          index[key] = entry;
        }
        set_module_tensor_to_device(model, key, c10::kMeta,
                                    at::empty({}, at::TensorOptions().dtype(held).device(c10::kMeta)));
        continue;
      }
      // A copy, so the model never depends on the checkpoint file staying as it is.
      // Read through a mapping of its own, dropped right after the copy, so the pages read do not
      // stay resident while the rest of the checkpoint loads.
      at::Tensor value = file.pickled() ? file.get_tensor(key) : SafetensorsFile(file.path()).get_tensor(key);
      std::optional<c10::ScalarType> dtype = asked;
      if (!dtype && c10::isFloatingType(stored)) dtype = stored;
      value = value.to(place->device(), dtype.has_value() && c10::isFloatingType(stored) ? *dtype : stored,
                       /*non_blocking=*/false, /*copy=*/true);
      set_module_tensor_to_device(model, key, place->device(), value, dtype);
    }
  }
  if (!index.empty()) {
    fs::create_directories(*options.offload_folder);
    save_offload_index(index, *options.offload_folder);
  }
  if (!options.strict && (!missing.empty() || !unexpected.empty())) {
    detail::warn("accelerate.big_modeling",
                 c10::str("[load_checkpoint_in_model] ", checkpoint, ": missing keys [", c10::Join(", ", missing),
                          "], unexpected keys [", c10::Join(", ", unexpected), "]"));
  }
  return index;
}

void load_checkpoint_and_dispatch(torch::nn::Module& model, const std::string& checkpoint,
                                  const BigModelLoadOptions& options) {
  const auto device_map = resolve_device_map(model, options);
  if (!device_map) {
    LoadCheckpointOptions plain;
    plain.dtype = options.dtype;
    plain.strict = options.strict;
    plain.keep_in_fp32_modules = options.keep_in_fp32_modules;
    load_checkpoint_in_model(model, checkpoint, plain);
    return;
  }
  load_checkpoint_in_model(model, checkpoint, *device_map, options);
  DispatchOptions dispatch;
  dispatch.offload_dir = options.offload_folder;
  dispatch.offload_buffers = options.offload_buffers;
  dispatch.preload_module_classes = options.preload_module_classes;
  dispatch.force_hooks = options.force_hooks;
  dispatch_model(model, *device_map, dispatch);
}

TensorMap load_state_dict(const std::string& checkpoint_file, const DeviceMap& device_map) {
  SafetensorsFile file(checkpoint_file);
  TensorMap out;
  for (const auto& key : file.keys()) {
    const MapDevice* place = device_of(device_map, key);
    const c10::Device device = place == nullptr || place->is_disk() ? c10::Device(c10::kCPU) : place->device();
    out[key] = file.get_tensor(key).to(device, /*non_blocking=*/false, /*copy=*/true);
  }
  return out;
}

}  // namespace accelerate
