// Upstream's `accelerate.utils.save` and `load` (see include/accelerate/checkpointing.h).
#include "accelerate/checkpointing.h"

#include "accelerate/state.h"
#include "accelerate/utils/safetensors.h"
#include "checkpoint/torch_save.h"
#include "detail/files.h"
#include "formats/torch_save.h"

#include <c10/util/Exception.h>

#include <filesystem>
#include <fstream>

namespace accelerate::utils {

namespace {

bool writes(const SaveOptions& options) {
  const PartialState state;
  return options.save_on_each_node ? state.is_local_main_process() : state.is_main_process();
}

}  // namespace

void save(const StateDictMap& tensors, const std::string& path, const SaveOptions& options) {
  if (!writes(options)) return;
  if (options.safe_serialization) {
    TensorMap map;
    for (const auto& item : tensors) map.emplace(item.key(), item.value());
    save_file(map, path, {{"format", "pt"}});
    return;
  }
  detail::checkpoint::TorchSaveWriter w;
  std::vector<std::pair<const detail::pickle::Value*, const detail::pickle::Value*>> entries;
  for (const auto& item : tensors) entries.emplace_back(w.tree().string(item.key()), w.tensor(item.value()));
  w.write(w.ordered_dict(std::move(entries)), path);
}

void save(const TensorMap& tensors, const std::string& path, const SaveOptions& options) {
  StateDictMap ordered;
  for (const auto& [name, tensor] : tensors) ordered.insert(name, tensor);
  save(ordered, path, options);
}

void save(const nlohmann::json& values, const std::string& path, const SaveOptions& options) {
  if (!writes(options)) return;
  if (options.safe_serialization) {
    detail::write_file_atomically(path, values.dump(2) + "\n");
    return;
  }
  detail::checkpoint::TorchSaveWriter w;
  w.write(w.from_json(values), path);
}

StateDict load(const std::string& path, std::optional<c10::Device> map_location) {
  TORCH_CHECK_VALUE(std::filesystem::is_regular_file(path), "[load] ", path, " does not exist");
  StateDict out;
  if (detail::torch_save::is_zip_file(path)) {
    out = detail::checkpoint::read_torch_save(path);
  } else if (std::filesystem::path(path).extension() == ".json") {
    std::ifstream in(path);
    try {
      out.values = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      C10_THROW_ERROR(ValueError, c10::str("[load] ", path, " is not valid JSON: ", e.what()));
    }
  } else {
    out.tensors = load_file(path);  // refuses, naming the file, what is not safetensors either
  }
  if (map_location) {
    for (auto& [name, tensor] : out.tensors) tensor = tensor.to(*map_location);
  }
  return out;
}

}  // namespace accelerate::utils
