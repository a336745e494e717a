// Offload folders (upstream: `accelerate.utils.offload`): weights written as raw files with an
// `index.json` of their dtypes and shapes, and read back through a map of weights that loads each
// on access. The dtype names are detail/dtype_names.cpp's.
#include "accelerate/utils/offload.h"

#include "accelerate/utils/device_map.h"
#include "detail/dtype_names.h"
#include "detail/files.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace fs = std::filesystem;

namespace accelerate {

namespace {

void check_weight_name(const std::string& name, const std::string& where) {
  TORCH_CHECK_VALUE(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..", "[offload] ",
                    where, ": '", name, "' is not a valid weight name");
}

std::string index_path(const std::string& folder) { return (fs::path(folder) / "index.json").string(); }

nlohmann::json to_json(const OffloadIndexEntry& entry) {
  nlohmann::json j;
  if (!entry.dtype.empty()) j["dtype"] = entry.dtype;
  if (entry.safetensors_file.empty() || !entry.shape.empty()) j["shape"] = entry.shape;
  if (!entry.safetensors_file.empty()) {
    j["safetensors_file"] = entry.safetensors_file;
    if (!entry.weight_name.empty()) j["weight_name"] = entry.weight_name;
  }
  return j;
}

OffloadIndex parse_index(const std::string& text, const std::string& path) {
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK_VALUE(false, "[offload] ", path, " is not valid JSON: ", e.what());
  }
  TORCH_CHECK_VALUE(root.is_object(), "[offload] ", path, " must hold a JSON object of weight entries");
  OffloadIndex index;
  for (const auto& [name, value] : root.items()) {
    check_weight_name(name, path);
    TORCH_CHECK_VALUE(value.is_object(), "[offload] ", path, ": the entry of '", name, "' is not an object");
    OffloadIndexEntry entry;
    try {
      if (value.contains("dtype")) entry.dtype = value.at("dtype").get<std::string>();
      if (value.contains("shape")) entry.shape = value.at("shape").get<std::vector<int64_t>>();
      if (value.contains("safetensors_file") && !value.at("safetensors_file").is_null()) {
        entry.safetensors_file = value.at("safetensors_file").get<std::string>();
      }
      if (value.contains("weight_name")) entry.weight_name = value.at("weight_name").get<std::string>();
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK_VALUE(false, "[offload] ", path, ": the entry of '", name, "' is malformed: ", e.what());
    }
    if (entry.safetensors_file.empty()) {
      TORCH_CHECK_VALUE(!entry.dtype.empty() && value.contains("shape"), "[offload] ", path, ": the entry of '", name,
                        "' needs \"dtype\" and \"shape\"");
      detail::numpy_dtype(entry.dtype, path);
      for (auto d : entry.shape) TORCH_CHECK_VALUE(d >= 0, "[offload] ", path, ": negative size in '", name, "'");
    }
    index.emplace(name, std::move(entry));
  }
  return index;
}

}  // namespace

void offload_weight(const at::Tensor& weight, const std::string& weight_name, const std::string& offload_folder,
                    OffloadIndex* index) {
  check_weight_name(weight_name, offload_folder);
  TORCH_CHECK_VALUE(!weight.is_meta(), "[offload_weight] ", weight_name, " is on the meta device and has no data");
  const auto data = weight.detach().to(c10::kCPU).contiguous();
  const std::string dtype = detail::numpy_dtype_name(data.scalar_type());
  const auto path = (fs::path(offload_folder) / (weight_name + ".dat")).string();
  detail::write_file_atomically(
      path,
      [&](detail::SequentialWriter& writer) { writer.write(static_cast<const char*>(data.data_ptr()), data.nbytes()); },
      /*durable=*/false);
  if (index != nullptr) (*index)[weight_name] = {dtype, data.sizes().vec(), {}, {}};
}

at::Tensor load_offloaded_weight(const std::string& weight_file, const OffloadIndexEntry& entry) {
  const auto dtype = detail::numpy_dtype(entry.dtype, weight_file);
  int64_t numel = 1;
  for (auto d : entry.shape) numel *= d;
  const auto expected = static_cast<off_t>(numel * static_cast<int64_t>(c10::elementSize(dtype)));
  const int fd = ::open(weight_file.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK_VALUE(fd >= 0, "[offload] cannot open ", weight_file, ": ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size != expected) {
    const auto size = st.st_size;
    ::close(fd);
    TORCH_CHECK_VALUE(false, "[offload] ", weight_file, " holds ", size, " bytes but its index entry (", entry.dtype,
                      ", shape ", c10::IntArrayRef(entry.shape), ") needs ", expected,
                      "; the offload folder is damaged");
  }
  const auto options = at::TensorOptions().dtype(dtype);
  if (expected == 0) {
    ::close(fd);
    return at::empty(entry.shape, options);
  }
  void* addr = ::mmap(nullptr, static_cast<size_t>(expected), PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  TORCH_CHECK(addr != MAP_FAILED, "[offload] cannot map ", weight_file, ": ", std::strerror(map_errno));
  const auto length = static_cast<size_t>(expected);
  return at::from_blob(
      addr, entry.shape, [length](void* p) { ::munmap(p, length); }, options);
}

void save_offload_index(const OffloadIndex& index, const std::string& offload_folder) {
  if (index.empty()) return;
  const auto path = index_path(offload_folder);
  nlohmann::json merged = nlohmann::json::object();
  if (fs::is_regular_file(path)) {
    for (const auto& [name, entry] : parse_index(detail::read_file(path), path)) merged[name] = to_json(entry);
  }
  for (const auto& [name, entry] : index) merged[name] = to_json(entry);
  detail::write_file_atomically(path, merged.dump(2));
}

OffloadIndex load_offload_index(const std::string& offload_folder) {
  const auto path = index_path(offload_folder);
  TORCH_CHECK_VALUE(fs::is_regular_file(path), "[offload] ", path, " does not exist");
  return parse_index(detail::read_file(path), path);
}

void offload_state_dict(const std::string& save_dir, const TensorMap& state_dict) {
  fs::create_directories(save_dir);
  OffloadIndex index;
  for (const auto& [name, tensor] : state_dict) offload_weight(tensor, name, save_dir, &index);
  save_offload_index(index, save_dir);
}

void load_offloaded_weights(torch::nn::Module& module, const OffloadIndex& index, const std::string& offload_folder) {
  if (index.empty()) return;
  OffloadedWeightsLoader loader({}, offload_folder, index);
  for (const auto& [name, entry] : index) {
    set_module_tensor_to_device(module, name, c10::kCPU, loader.get(name));
  }
}

OffloadedWeightsLoader::OffloadedWeightsLoader(TensorMap state_dict, std::optional<std::string> save_folder,
                                               std::optional<OffloadIndex> index, std::optional<c10::Device> device)
    : state_dict_(std::move(state_dict)), save_folder_(save_folder.value_or("")), device_(device) {
  TORCH_CHECK_VALUE(!state_dict_.empty() || save_folder.has_value() || index.has_value(),
                    "Need either a `state_dict`, a `save_folder` or an `index` containing offloaded weights.");
  if (index.has_value()) {
    index_ = std::move(*index);
  } else if (save_folder.has_value()) {
    index_ = load_offload_index(*save_folder);
  }
}

at::Tensor OffloadedWeightsLoader::get(const std::string& key) const {
  if (auto it = state_dict_.find(key); it != state_dict_.end()) return it->second;
  auto it = index_.find(key);
  TORCH_CHECK_VALUE(it != index_.end(), "[offload] no offloaded weight named '", key, "'");
  const auto& entry = it->second;
  at::Tensor tensor;
  if (!entry.safetensors_file.empty()) {
    SafetensorsFile file(entry.safetensors_file);
    tensor = file.get_tensor(entry.weight_name.empty() ? key : entry.weight_name);
    if (!entry.dtype.empty()) tensor = tensor.to(detail::numpy_dtype(entry.dtype, entry.safetensors_file));
  } else {
    TORCH_CHECK_VALUE(!save_folder_.empty(), "[offload] '", key,
                      "' has no safetensors file and no folder to read from");
    tensor = load_offloaded_weight((fs::path(save_folder_) / (key + ".dat")).string(), entry);
  }
  if (device_.has_value() && tensor.device() != *device_) tensor = tensor.to(*device_);
  return tensor;
}

bool OffloadedWeightsLoader::contains(const std::string& key) const {
  return state_dict_.count(key) > 0 || index_.count(key) > 0;
}

std::vector<std::string> OffloadedWeightsLoader::keys() const {
  std::vector<std::string> out;
  for (const auto& [name, tensor] : state_dict_) out.push_back(name);
  for (const auto& [name, entry] : index_) {
    if (!state_dict_.count(name)) out.push_back(name);
  }
  return out;
}

PrefixedWeightsMap::PrefixedWeightsMap(std::shared_ptr<const WeightsMap> base, std::string prefix)
    : base_(std::move(base)), prefix_(std::move(prefix)) {}

at::Tensor PrefixedWeightsMap::get(const std::string& key) const { return base_->get(prefix_ + key); }

bool PrefixedWeightsMap::contains(const std::string& key) const { return base_->contains(prefix_ + key); }

std::vector<std::string> PrefixedWeightsMap::keys() const {
  std::vector<std::string> out;
  for (const auto& key : base_->keys()) {
    if (key.compare(0, prefix_.size(), prefix_) == 0) out.push_back(key.substr(prefix_.size()));
  }
  return out;
}

TensorMap extract_submodules_state_dict(const TensorMap& state_dict, const std::vector<std::string>& submodule_names) {
  TensorMap out;
  for (const auto& module : submodule_names) {
    for (const auto& [key, tensor] : state_dict) {
      if (module.empty() || key == module || key.compare(0, module.size() + 1, module + ".") == 0) out[key] = tensor;
    }
  }
  return out;
}

}  // namespace accelerate
