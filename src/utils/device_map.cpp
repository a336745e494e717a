// Sizes of a model's parts and where each part goes (device_map.h), from shapes and dtypes only.
#include "accelerate/utils/device_map.h"

#include "accelerate/utils/modeling.h"
#include "detail/accelerator_device.h"
#include "detail/warn.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <unordered_map>

namespace accelerate {

namespace {

int64_t element_size(c10::ScalarType dtype) { return static_cast<int64_t>(c10::elementSize(dtype)); }

bool never_converted(c10::ScalarType dtype) { return !c10::isFloatingType(dtype) && !c10::isComplexType(dtype); }

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.size() >= prefix.size() && text.compare(0, prefix.size(), prefix) == 0;
}

// Whether `name` is `module` or lies inside it (the dotted-prefix rule upstream writes as
// `module + "." in name + "."`).
bool inside(const std::string& name, const std::string& module) {
  return module.empty() || name == module || starts_with(name, module + ".");
}

std::vector<NamedModuleOrTensor> direct_entries(const torch::nn::Module& module, const std::string& prefix,
                                                bool parameters, bool children, bool buffers) {
  std::vector<NamedModuleOrTensor> out;
  const std::string dot = prefix.empty() ? "" : prefix + ".";
  if (parameters) {
    for (const auto& p : module.named_parameters(false)) out.push_back({dot + p.key(), nullptr, p.value()});
  }
  if (children) {
    for (const auto& c : module.named_children()) out.push_back({dot + c.key(), c.value(), {}});
  }
  if (buffers) {
    for (const auto& b : module.named_buffers(false)) out.push_back({dot + b.key(), nullptr, b.value()});
  }
  return out;
}

bool is_no_split(const torch::nn::Module& module, const std::vector<std::string>& classes) {
  const std::string short_name = module_class_name(module);
  return std::any_of(classes.begin(), classes.end(),
                     [&](const std::string& c) { return c == short_name || c == module.name(); });
}

int64_t size_of(const std::map<std::string, int64_t>& sizes, const std::string& name) {
  auto it = sizes.find(name);
  return it == sizes.end() ? 0 : it->second;
}

// Resolves "a.b.c" to the module "a.b" and the leaf "c".
std::pair<torch::nn::Module*, std::string> owner_of(torch::nn::Module& module, const std::string& name) {
  torch::nn::Module* current = &module;
  size_t start = 0;
  for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', start)) {
    const std::string part = name.substr(start, dot - start);
    std::shared_ptr<torch::nn::Module> child;
    for (const auto& c : current->named_children()) {
      if (c.key() == part) child = c.value();
    }
    TORCH_CHECK_VALUE(child != nullptr, "[set_module_tensor_to_device] ", current->name(), " has no submodule '", part,
                      "' (looking for '", name, "')");
    current = child.get();
    start = dot + 1;
  }
  return {current, name.substr(start)};
}

at::Tensor find_direct_tensor(const torch::nn::Module& module, const std::string& leaf) {
  // The dictionaries are copies: keep them alive while reading from them.
  const auto parameters = module.named_parameters(false);
  if (const auto* p = parameters.find(leaf)) return *p;
  const auto buffers = module.named_buffers(false);
  if (const auto* b = buffers.find(leaf)) return *b;
  return {};
}

int64_t available_ram() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t value = 0;
  std::string unit;
  while (meminfo >> key >> value >> unit) {
    if (key == "MemAvailable:") return value * 1024;
  }
  return 0;
}

}  // namespace

MapDevice::MapDevice(int index) : rank_(0), index_(index) {
  TORCH_CHECK_VALUE(index >= 0, "[device_map] a GPU index must be non-negative, got ", index);
}

MapDevice::MapDevice(const char* name) : MapDevice(std::string(name)) {}

MapDevice::MapDevice(const std::string& name) {
  if (name == "cpu") {
    rank_ = 1;
  } else if (name == "disk") {
    rank_ = 2;
  } else if (name == "cuda") {
    rank_ = 0;
    index_ = 0;
  } else if (starts_with(name, "cuda:") && name.size() > 5 && std::all_of(name.begin() + 5, name.end(), [](char c) {
               return std::isdigit(static_cast<unsigned char>(c));
             })) {
    rank_ = 0;
    index_ = std::stoi(name.substr(5));
  } else if (!name.empty() && std::all_of(name.begin(), name.end(), [](char c) { return std::isdigit(c); })) {
    rank_ = 0;
    index_ = std::stoi(name);
  } else {
    TORCH_CHECK_VALUE(false, "[device_map] device '", name,
                      "' is not recognized; use GPU indices (integers or \"cuda:N\"), \"cpu\" or \"disk\"");
  }
}

MapDevice::MapDevice(const c10::Device& device) {
  if (device.is_cpu()) {
    rank_ = 1;
  } else if (device.is_cuda() || device.type() == c10::DeviceType::PrivateUse1) {
    rank_ = 0;
    index_ = device.has_index() ? device.index() : 0;
  } else {
    TORCH_CHECK_VALUE(false, "[device_map] device ", device.str(), " is not supported; use cuda, cpu or disk");
  }
}

c10::Device MapDevice::device() const {
  TORCH_CHECK_VALUE(!is_disk(), "[device_map] \"disk\" is a storage place, not a device tensors can live on");
  if (!is_gpu()) return c10::Device(c10::kCPU);
  // Integers name the accelerator's devices (Note [Accelerators other than CUDA]); CUDA's when
  // there is none, so that the error names what was asked for.
  const c10::DeviceType type = detail::accelerator_type();
  return c10::Device(type == c10::kCPU ? c10::kCUDA : type, static_cast<c10::DeviceIndex>(index_));
}

std::string MapDevice::str() const { return is_gpu() ? std::to_string(index_) : is_cpu() ? "cpu" : "disk"; }

std::ostream& operator<<(std::ostream& out, const MapDevice& device) { return out << device.str(); }

MemorySize::MemorySize(const char* text) : bytes(convert_file_size_to_int(text)) {}
MemorySize::MemorySize(const std::string& text) : bytes(convert_file_size_to_int(text)) {}

MaxMemory get_max_memory(const std::optional<MaxMemory>& max_memory) {
  if (max_memory.has_value()) {
    const auto gpus = detail::accelerator_count();
    for (const auto& [device, size] : *max_memory) {
      TORCH_CHECK_VALUE(size.bytes >= 0, "[get_max_memory] the budget of ", device.str(), " is negative");
      if (device.is_gpu() && device.index() >= gpus) {
        detail::warn("accelerate.utils.modeling",
                     c10::str("Device ", device.index(), " is not available, available devices are ", gpus,
                              " accelerator device(s)"),
                     {.once = true});
      }
    }
    return *max_memory;
  }
  TORCH_CHECK_VALUE(detail::accelerator_count() == 0,
                    "[get_max_memory] accelerator devices are visible but their free memory cannot be queried here; pass "
                    "max_memory with a budget for each GPU (e.g. {{0, \"20GiB\"}, {\"cpu\", \"60GiB\"}})");
  return MaxMemory{{"cpu", available_ram()}};
}

std::vector<std::pair<std::string, at::Tensor>> named_module_tensors(const torch::nn::Module& module,
                                                                     bool include_buffers, bool recurse) {
  // A tensor registered under several names (tied) is listed once, under its first name, as
  // PyTorch's `named_parameters()` does.
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::set<const c10::TensorImpl*> seen;
  auto add = [&](const std::string& name, const at::Tensor& t) {
    if (t.defined() && !seen.insert(t.unsafeGetTensorImpl()).second) return;
    out.emplace_back(name, t);
  };
  for (const auto& p : module.named_parameters(recurse)) add(p.key(), p.value());
  if (include_buffers) {
    for (const auto& b : module.named_buffers(recurse)) add(b.key(), b.value());
  }
  return out;
}

std::map<std::string, int64_t> compute_module_sizes(const torch::nn::Module& model,
                                                    std::optional<c10::ScalarType> dtype,
                                                    const std::map<std::string, c10::ScalarType>& special_dtypes,
                                                    bool buffers_only) {
  std::map<std::string, int64_t> sizes;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  if (buffers_only) {
    for (const auto& b : model.named_buffers(true)) tensors.emplace_back(b.key(), b.value());
  } else {
    tensors = named_module_tensors(model, true, true);
  }
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.defined()) continue;
    int64_t size = 0;
    const auto own = element_size(tensor.scalar_type());
    if (auto it = special_dtypes.find(name); it != special_dtypes.end()) {
      size = tensor.numel() * element_size(it->second);
    } else if (!dtype.has_value() || never_converted(tensor.scalar_type())) {
      size = tensor.numel() * own;
    } else {
      size = tensor.numel() * std::min(element_size(*dtype), own);
    }
    sizes[""] += size;
    for (size_t dot = name.find('.'); dot != std::string::npos; dot = name.find('.', dot + 1)) {
      sizes[name.substr(0, dot)] += size;
    }
    sizes[name] += size;
  }
  if (sizes.find("") == sizes.end()) sizes[""] = 0;
  return sizes;
}

std::string module_class_name(const torch::nn::Module& module) {
  std::string name = module.name();
  if (auto colon = name.rfind("::"); colon != std::string::npos) name = name.substr(colon + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

std::pair<int64_t, std::vector<std::string>> get_max_layer_size(
    const std::vector<NamedModuleOrTensor>& modules, const std::map<std::string, int64_t>& module_sizes,
    const std::vector<std::string>& no_split_module_classes) {
  int64_t max_size = 0;
  std::vector<std::string> names;
  std::vector<NamedModuleOrTensor> todo(modules.begin(), modules.end());
  while (!todo.empty()) {
    auto entry = todo.front();
    todo.erase(todo.begin());
    const bool leaf = entry.module == nullptr || entry.module->children().empty() ||
                      is_no_split(*entry.module, no_split_module_classes);
    if (leaf) {
      const auto size = size_of(module_sizes, entry.name);
      if (size > max_size) {
        max_size = size;
        names = {entry.name};
      } else if (size == max_size) {
        names.push_back(entry.name);
      }
    } else {
      auto children = direct_entries(*entry.module, entry.name, false, true, false);
      todo.insert(todo.begin(), children.begin(), children.end());
    }
  }
  return {max_size, names};
}

MaximumSizes calculate_maximum_sizes(const torch::nn::Module& model,
                                     const std::vector<std::string>& no_split_module_classes) {
  const auto sizes = compute_module_sizes(model);
  auto [largest, names] =
      get_max_layer_size(direct_entries(model, "", true, true, true), sizes, no_split_module_classes);
  return {sizes.at(""), largest, names};
}

std::vector<std::vector<std::string>> find_tied_parameters(const torch::nn::Module& model) {
  std::map<const c10::TensorImpl*, std::vector<std::string>> by_tensor;
  std::vector<const c10::TensorImpl*> order;
  for (const auto& p : model.named_parameters(true)) {
    if (!p.value().defined()) continue;
    auto* impl = p.value().unsafeGetTensorImpl();
    auto& names = by_tensor[impl];
    if (names.empty()) order.push_back(impl);
    names.push_back(p.key());
  }
  std::vector<std::vector<std::string>> groups;
  for (const auto* impl : order) {
    auto names = by_tensor[impl];
    if (names.size() < 2) continue;
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    if (names.size() > 1) groups.push_back(names);
  }
  std::sort(groups.begin(), groups.end());
  return groups;
}

void retie_parameters(torch::nn::Module& model, const std::vector<std::vector<std::string>>& tied_params) {
  for (const auto& group : tied_params) {
    at::Tensor source;
    for (const auto& name : group) {
      auto t = get_module_tensor(model, name);
      if (!t.is_meta()) {
        source = t;
        break;
      }
    }
    if (!source.defined()) continue;
    for (const auto& name : group) {
      auto t = get_module_tensor(model, name);
      if (t.unsafeGetTensorImpl() != source.unsafeGetTensorImpl()) {
        set_module_tensor_to_device(model, name, source.device(), source);
      }
    }
  }
}

MaxMemory get_balanced_memory(const torch::nn::Module& model, const DeviceMapOptions& options) {
  const bool user_set = options.max_memory.has_value();
  MaxMemory max_memory = get_max_memory(options.max_memory);
  int num_devices = 0;
  for (const auto& [device, size] : max_memory) {
    if (device.is_gpu() && size.bytes > 0) ++num_devices;
  }
  if (num_devices == 0) return max_memory;
  bool low_zero = options.low_zero;
  if (num_devices == 1) {
    low_zero = false;
    if (!user_set) {
      for (auto& [device, size] : max_memory) {
        if (device.is_gpu()) {
          size.bytes = static_cast<int64_t>(static_cast<double>(size.bytes) * 0.9);
          break;
        }
      }
    }
  }
  auto module_sizes = compute_module_sizes(model, options.dtype, options.special_dtypes);
  int64_t per_gpu = module_sizes.at("") / (low_zero ? num_devices - 1 : num_devices);

  int64_t buffer = 0;
  if (!options.no_split_module_classes.empty()) {
    std::map<std::string, int64_t> no_split_children;
    for (const auto& item : model.named_modules("", false)) {
      const auto cls = module_class_name(*item.value());
      const bool match = is_no_split(*item.value(), options.no_split_module_classes);
      if (match && !no_split_children.count(cls)) no_split_children[cls] = size_of(module_sizes, item.key());
      if (no_split_children.size() == options.no_split_module_classes.size()) break;
    }
    for (const auto& [cls, size] : no_split_children) buffer = std::max(buffer, size);
  }
  // Leaves of the size table are tensors; drop them, and the leaves of what remains are the
  // final modules.
  auto leaves_of = [](const std::map<std::string, int64_t>& sizes) {
    std::map<std::string, int> children;
    for (const auto& [name, size] : sizes) {
      if (name.empty() || name.find('.') == std::string::npos) continue;
      children[name.substr(0, name.rfind('.'))] += 1;
    }
    std::vector<std::string> leaves;
    for (const auto& [name, size] : sizes) {
      if (!name.empty() && children[name] == 0) leaves.push_back(name);
    }
    return leaves;
  };
  for (const auto& leaf : leaves_of(module_sizes)) module_sizes.erase(leaf);
  const auto final_modules = leaves_of(module_sizes);
  int64_t total = 0;
  for (const auto& name : final_modules) total += module_sizes[name];
  const int64_t mean_leaves =
      static_cast<int64_t>(static_cast<double>(total) / static_cast<double>(std::max<size_t>(final_modules.size(), 1)));
  buffer = static_cast<int64_t>(1.25 * static_cast<double>(std::max(buffer, mean_leaves)));
  per_gpu += buffer;

  std::vector<MapDevice> gpus;
  for (const auto& [device, size] : max_memory) {
    if (device.is_gpu() && size.bytes > 0) gpus.push_back(device);
  }
  for (size_t i = 0; i + 1 < gpus.size(); ++i) {
    auto& budget = max_memory.at(gpus[i]).bytes;
    const int64_t cap = (low_zero && gpus[i].index() == 0) ? max_memory.at(gpus[i]).bytes : per_gpu;
    budget = std::min(cap, budget);
  }
  if (low_zero) {
    int64_t others = 0;
    for (int i = 1; i < num_devices; ++i) {
      if (auto it = max_memory.find(MapDevice(i)); it != max_memory.end()) others += it->second.bytes;
    }
    const int64_t min_zero = std::max<int64_t>(0, module_sizes.at("") - others);
    auto& zero = max_memory.at(MapDevice(0)).bytes;
    zero = std::min(min_zero, zero);
  }
  return max_memory;
}

namespace {

// Size of `name` plus the modules holding its tied parameters outside it, and those modules
// (upstream: `get_module_size_with_ties`).
struct SizeWithTies {
  int64_t size = 0;
  std::vector<std::string> names;
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
};

SizeWithTies size_with_ties(const std::vector<std::string>& tied_params, int64_t module_size,
                            const std::map<std::string, int64_t>& module_sizes,
                            const std::vector<NamedModuleOrTensor>& modules_to_treat) {
  SizeWithTies out{module_size, {}, {}};
  for (const auto& tied : tied_params) {
    auto it = std::find_if(modules_to_treat.begin(), modules_to_treat.end(),
                           [&](const NamedModuleOrTensor& e) { return starts_with(tied, e.name + "."); });
    if (it == modules_to_treat.end()) continue;
    out.names.push_back(it->name);
    out.modules.push_back(it->module);
    out.size += size_of(module_sizes, it->name) - size_of(module_sizes, tied);
  }
  return out;
}

// The tied parameters outside `name` whose group has a member inside it.
std::vector<std::string> outside_ties(const std::string& name, const std::vector<std::vector<std::string>>& tied) {
  std::vector<std::string> out;
  for (const auto& group : tied) {
    const bool any_in = std::any_of(group.begin(), group.end(), [&](const auto& k) { return inside(k, name); });
    const bool all_in = std::all_of(group.begin(), group.end(), [&](const auto& k) { return inside(k, name); });
    if (!any_in || all_in) continue;
    for (const auto& k : group) {
      if (!inside(k, name)) out.push_back(k);
    }
  }
  return out;
}

std::vector<NamedModuleOrTensor> splittable_children(const NamedModuleOrTensor& entry) {
  return direct_entries(*entry.module, entry.name, true, true, false);
}

// Breadth-first search for a module that fits `size_limit` (upstream: `fallback_allocate`).
std::optional<NamedModuleOrTensor> fallback_allocate(std::vector<NamedModuleOrTensor>& modules,
                                                     const std::map<std::string, int64_t>& module_sizes,
                                                     int64_t size_limit, const std::vector<std::string>& no_split,
                                                     const std::vector<std::vector<std::string>>& tied) {
  std::vector<NamedModuleOrTensor> search = modules;
  std::optional<NamedModuleOrTensor> found;
  while (!search.empty()) {
    auto entry = search.front();
    search.erase(search.begin());
    const auto ties = outside_ties(entry.name, tied);
    const auto with_ties = size_with_ties(ties, size_of(module_sizes, entry.name), module_sizes, search);
    if (with_ties.size <= size_limit) {
      found = entry;
      break;
    }
    if (entry.module == nullptr || entry.module->children().empty() || is_no_split(*entry.module, no_split)) continue;
    auto children = splittable_children(entry);
    search.insert(search.begin(), children.begin(), children.end());
  }
  if (!found) return std::nullopt;
  // Open up the parents of the found module in the work list so it can be taken out.
  for (size_t dot = found->name.find('.'); dot != std::string::npos; dot = found->name.find('.', dot + 1)) {
    const std::string parent = found->name.substr(0, dot);
    auto it = std::find_if(modules.begin(), modules.end(), [&](const auto& e) { return e.name == parent; });
    if (it == modules.end() || it->module == nullptr) continue;
    auto children = splittable_children(*it);
    const auto pos = it - modules.begin();
    modules.erase(it);
    modules.insert(modules.begin() + pos, children.begin(), children.end());
  }
  auto it = std::find_if(modules.begin(), modules.end(), [&](const auto& e) { return e.name == found->name; });
  if (it == modules.end()) return std::nullopt;
  auto result = *it;
  modules.erase(it);
  return result;
}

std::vector<NamedModuleOrTensor> only_modules(const std::vector<NamedModuleOrTensor>& entries) {
  std::vector<NamedModuleOrTensor> out;
  for (const auto& e : entries) {
    if (e.module) out.push_back(e);
  }
  return out;
}

}  // namespace

DeviceMap infer_auto_device_map(const torch::nn::Module& model, const DeviceMapOptions& options) {
  const MaxMemory max_memory = get_max_memory(options.max_memory);
  const auto& no_split = options.no_split_module_classes;
  std::vector<MapDevice> devices;
  for (const auto& [device, size] : max_memory) devices.push_back(device);
  if (std::find(devices.begin(), devices.end(), MapDevice("disk")) == devices.end()) devices.emplace_back("disk");
  std::vector<MapDevice> gpus;
  for (const auto& d : devices) {
    if (d.is_gpu()) gpus.push_back(d);
  }
  std::vector<MapDevice> main_devices =
      gpus.empty() ? std::vector<MapDevice>{"cpu"} : std::vector<MapDevice>{gpus.front(), "cpu"};
  auto is_main = [&](const MapDevice& d) {
    return std::find(main_devices.begin(), main_devices.end(), d) != main_devices.end();
  };
  const auto module_sizes = compute_module_sizes(model, options.dtype, options.special_dtypes);
  const auto tied_parameters = find_tied_parameters(model);
  auto modules_to_treat = direct_entries(model, "", true, true, true);

  DeviceMap device_map;
  size_t current = 0;
  std::map<MapDevice, int64_t> used;
  std::map<MapDevice, int64_t> buffer_sizes;
  auto [max_layer_size, max_layer_names] = get_max_layer_size(modules_to_treat, module_sizes, no_split);
  auto say = [&](const std::string& text) {
    if (options.verbose) std::cout << text << "\n";
  };

  while (!modules_to_treat.empty()) {
    auto entry = modules_to_treat.front();
    modules_to_treat.erase(modules_to_treat.begin());
    const std::string& name = entry.name;
    say("Treating module " + name + ".");
    max_layer_names.erase(std::remove_if(max_layer_names.begin(), max_layer_names.end(),
                                         [&](const std::string& n) { return n == name || starts_with(n, name + "."); }),
                          max_layer_names.end());
    if (max_layer_names.empty()) {
      std::tie(max_layer_size, max_layer_names) =
          get_max_layer_size(only_modules(modules_to_treat), module_sizes, no_split);
    }
    const int64_t module_size = size_of(module_sizes, name);
    const auto tied_params = outside_ties(name, tied_parameters);
    TORCH_CHECK(current < devices.size(), "[infer_auto_device_map] internal error: ran out of devices at ", name);
    const MapDevice device = devices[current];
    std::optional<int64_t> current_max_size;
    if (!device.is_disk()) current_max_size = max_memory.at(device).bytes;
    int64_t reserved = 0;
    if (is_main(device)) {
      *current_max_size -= max_layer_size;
      reserved = max_layer_size;
    }
    auto ties = size_with_ties(tied_params, module_size, module_sizes, modules_to_treat);

    if (!current_max_size || used[device] + ties.size <= *current_max_size) {
      say("Putting " + name + " on " + device.str() + ".");
      used[device] += ties.size;
      device_map.insert_or_assign(name, device);
      for (const auto& tied_name : ties.names) {
        auto it = std::find_if(modules_to_treat.begin(), modules_to_treat.end(),
                               [&](const auto& e) { return e.name == tied_name; });
        if (it != modules_to_treat.end()) modules_to_treat.erase(it);
        device_map.insert_or_assign(tied_name, device);
      }
      if (!options.offload_buffers && entry.module) {
        buffer_sizes[device] += compute_module_sizes(*entry.module, options.dtype, options.special_dtypes, true).at("");
      }
      continue;
    }

    if (!tied_params.empty() && used[device] + module_size <= *current_max_size) {
      bool split = false;
      for (size_t i = 0; i < ties.names.size(); ++i) {
        const auto& tied_module = ties.modules[i];
        if (!tied_module || tied_module->children().empty() || is_no_split(*tied_module, no_split)) continue;
        say("Splitting " + ties.names[i] + ".");
        auto children = direct_entries(*tied_module, ties.names[i], true, true, false);
        auto it = std::find_if(modules_to_treat.begin(), modules_to_treat.end(),
                               [&](const auto& e) { return e.name == ties.names[i]; });
        const auto pos = it - modules_to_treat.begin();
        modules_to_treat.erase(it);
        modules_to_treat.insert(modules_to_treat.begin() + pos, children.begin(), children.end());
        modules_to_treat.insert(modules_to_treat.begin(), entry);
        std::tie(max_layer_size, max_layer_names) =
            get_max_layer_size(only_modules(modules_to_treat), module_sizes, no_split);
        split = true;
        break;
      }
      if (split) continue;
    }

    if (used[device] + module_size >= *current_max_size) {
      const bool can_split = entry.module && !entry.module->children().empty() && !is_no_split(*entry.module, no_split);
      if (can_split) {
        say("Splitting " + name + ".");
        auto children = direct_entries(*entry.module, name, true, true, false);
        modules_to_treat.insert(modules_to_treat.begin(), children.begin(), children.end());
        std::tie(max_layer_size, max_layer_names) =
            get_max_layer_size(only_modules(modules_to_treat), module_sizes, no_split);
        continue;
      }
    }

    if (used[device] == 0 && options.fallback_allocation && !device.is_disk()) {
      const int64_t limit = max_memory.at(device).bytes - std::max(max_layer_size, ties.size);
      auto found = fallback_allocate(modules_to_treat, module_sizes, limit - used[device], no_split, tied_parameters);
      if (found) {
        modules_to_treat.insert(modules_to_treat.begin(), entry);
        modules_to_treat.insert(modules_to_treat.begin(), *found);
        continue;
      }
    }

    used[device] += reserved;
    ++current;
    modules_to_treat.insert(modules_to_treat.begin(), entry);
  }

  if (options.clean_result) clean_device_map(device_map);

  const int64_t non_gpu_buffers = buffer_sizes[MapDevice("cpu")] + buffer_sizes[MapDevice("disk")];
  if (non_gpu_buffers > 0 && !options.offload_buffers && !gpus.empty()) {
    bool fits = false;
    for (const auto& gpu : gpus) {
      if (max_memory.count(gpu) && max_memory.at(gpu).bytes >= non_gpu_buffers + used[gpu]) fits = true;
    }
    if (!fits) {
      detail::warn("accelerate.utils.modeling",
                   c10::str("Current model requires ", non_gpu_buffers,
                            " bytes of buffer for offloaded layers, which seems does not fit any GPU's remaining "
                            "memory. If you are experiencing a OOM later, please consider using "
                            "offload_buffers=true."),
                   {.once = true});
    }
  }
  return device_map;
}

DeviceMap& clean_device_map(DeviceMap& device_map, const std::string& module_name) {
  const std::string prefix = module_name.empty() ? "" : module_name + ".";
  std::vector<std::string> keys;
  std::set<MapDevice> values;
  for (const auto& [key, value] : device_map) {
    if (starts_with(key, prefix)) {
      keys.push_back(key);
      values.insert(value);
    }
  }
  if (values.size() == 1 && keys.size() > 1) {
    const MapDevice value = *values.begin();
    for (const auto& key : keys) device_map.erase(key);
    device_map.insert_or_assign(module_name, value);
  }
  const size_t depth =
      module_name.empty() ? 1 : static_cast<size_t>(std::count(module_name.begin(), module_name.end(), '.')) + 2;
  std::set<std::string> children;
  for (const auto& [key, value] : device_map) {
    if (!starts_with(key, prefix) || key.size() <= module_name.size()) continue;
    size_t end = 0;
    for (size_t parts = 0; parts < depth && end != std::string::npos; ++parts) {
      end = key.find('.', parts == 0 ? 0 : end + 1);
    }
    children.insert(end == std::string::npos ? key : key.substr(0, end));
  }
  for (const auto& child : children) clean_device_map(device_map, child);
  return device_map;
}

void check_device_map(const torch::nn::Module& model, const DeviceMap& device_map) {
  std::set<std::string> modules;
  for (const auto& item : model.named_modules("", true)) modules.insert(item.key());
  std::vector<std::string> invalid;
  for (const auto& [key, value] : device_map) {
    if (!key.empty() && !modules.count(key)) invalid.push_back(key);
  }
  if (!invalid.empty()) {
    detail::warn("accelerate.utils.modeling",
                 c10::str("The following device_map keys do not match any submodules in the model: ",
                          c10::Join(", ", invalid)));
  }
  if (device_map.count("")) return;
  std::vector<std::string> uncovered;
  for (const auto& [name, tensor] : named_module_tensors(model, true, true)) {
    const bool covered =
        std::any_of(device_map.begin(), device_map.end(), [&](const auto& entry) { return inside(name, entry.first); });
    if (!covered) uncovered.push_back(name);
  }
  TORCH_CHECK_VALUE(
      uncovered.empty(),
      "The device_map provided does not give any device for the following parameters: ", c10::Join(", ", uncovered));
}

at::Tensor get_module_tensor(const torch::nn::Module& module, const std::string& tensor_name) {
  auto [owner, leaf] = owner_of(const_cast<torch::nn::Module&>(module), tensor_name);
  auto tensor = find_direct_tensor(*owner, leaf);
  TORCH_CHECK_VALUE(tensor.defined(), "[set_module_tensor_to_device] ", owner->name(), " has no parameter or buffer '",
                    leaf, "' (looking for '", tensor_name, "')");
  return tensor;
}

void set_module_tensor_to_device(torch::nn::Module& module, const std::string& tensor_name, const c10::Device& device,
                                 const std::optional<at::Tensor>& value, std::optional<c10::ScalarType> dtype) {
  at::Tensor old = get_module_tensor(module, tensor_name);
  at::NoGradGuard no_grad;
  at::Tensor fresh;
  if (device.is_meta()) {
    const auto type = value.has_value() && value->defined() ? value->scalar_type() : old.scalar_type();
    fresh = at::empty(old.sizes(), old.options().device(c10::kMeta).dtype(type));
  } else if (value.has_value() && value->defined()) {
    TORCH_CHECK_VALUE(value->sizes() == old.sizes(), "Trying to set a tensor of shape ", value->sizes(), " in \"",
                      tensor_name, "\" (which has shape ", old.sizes(), "), this looks incorrect.");
    auto target = value->scalar_type();
    if (c10::isFloatingType(target)) target = dtype.value_or(old.scalar_type());
    fresh = value->to(device, target);
  } else {
    TORCH_CHECK_VALUE(!old.is_meta(), tensor_name, " is on the meta device, we need a `value` to put in on ",
                      device.str(), ".");
    fresh = old.to(device, dtype.has_value() && c10::isFloatingType(old.scalar_type()) ? *dtype : old.scalar_type());
  }
  if (fresh.unsafeGetTensorImpl() == old.unsafeGetTensorImpl()) return;
  // Changing the tensor object in place (not the module's dictionary entry) is what makes every
  // handle — the module's member, tied names, an optimizer's list — see the new data; LibTorch's
  // own `set_data` refuses moves to and from the meta device, which this needs.
  old.unsafeGetTensorImpl()->shallow_copy_from(fresh.getIntrusivePtr());
}

}  // namespace accelerate
