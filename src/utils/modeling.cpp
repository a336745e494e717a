// Loading and saving a module's weights (upstream: `accelerate.utils.modeling`): state dicts split
// into shards and saved, safetensors checkpoints checked and loaded into a module, and module order
// helpers. `load_state_dict` of a pickled `.bin` file is defined with the state-dict files, in
// checkpoint/checkpointing.cpp.
#include "accelerate/utils/modeling.h"

#include "formats/checkpoint_index.h"
#include "utils/checkpoint_file.h"
#include "detail/files.h"
#include "detail/dtype_names.h"
#include "detail/warn.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <regex>
#include <set>
#include <tuple>
#include <unordered_map>

namespace fs = std::filesystem;

namespace accelerate {

namespace {

constexpr const char* kWeightsIndexName = "model.safetensors.index.json";

bool ends_with_upper(const std::string& text, const std::string& suffix) {
  if (text.size() < suffix.size()) return false;
  for (size_t i = 0; i < suffix.size(); ++i) {
    if (std::toupper(static_cast<unsigned char>(text[text.size() - suffix.size() + i])) != suffix[i]) return false;
  }
  return true;
}

void collect_state(const torch::nn::Module& module, const std::string& prefix, StateDictMap& out) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    if (item.value().defined()) out.insert(prefix + item.key(), item.value().detach());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    if (item.value().defined()) out.insert(prefix + item.key(), item.value().detach());
  }
  for (const auto& child : module.named_children()) collect_state(*child.value(), prefix + child.key() + ".", out);
}

// The module's own tensors (not detached), by name, for loading into them.
std::unordered_map<std::string, at::Tensor> module_tensors(const torch::nn::Module& module) {
  std::unordered_map<std::string, at::Tensor> tensors;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) tensors.emplace(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) tensors.emplace(item.key(), item.value());
  return tensors;
}

// Identifies the memory a tensor lives in, so that aliases are found (upstream: `id_tensor_storage`).
std::pair<int, const void*> storage_id(const at::Tensor& t) {
  return {static_cast<int>(t.device().type()) * 1000 + t.device().index(), t.storage().data()};
}

std::string shape_string(at::IntArrayRef sizes) { return c10::str(sizes); }

}  // namespace

int64_t convert_file_size_to_int(const std::string& size) {
  const auto error = [&] {
    return c10::str("[convert_file_size_to_int] `size` \"", size,
                    "\" is not in a valid format. Use an integer for bytes, or a string with a unit (like '5.0GB')");
  };
  const auto number = [&](size_t unit_length) {
    const std::string digits = size.substr(0, size.size() - unit_length);
    TORCH_CHECK_VALUE(!digits.empty() && std::all_of(digits.begin(), digits.end(),
                                                     [](char c) { return std::isdigit(static_cast<unsigned char>(c)) || c == '.'; }),
                      error());
    size_t used = 0;
    double value = 0;
    try {
      value = std::stod(digits, &used);
    } catch (const std::exception&) {
      C10_THROW_ERROR(ValueError, error());
    }
    TORCH_CHECK_VALUE(used == digits.size() && std::isfinite(value) && value >= 0 && value < 9.2e18, error());
    return value;
  };
  struct Unit {
    const char* suffix;
    double factor;
    bool bits_allowed;
  };
  static const Unit units[] = {{"GIB", 1073741824.0, false}, {"MIB", 1048576.0, false}, {"KIB", 1024.0, false},
                               {"GB", 1e9, true},            {"MB", 1e6, true},         {"KB", 1e3, true}};
  for (const auto& unit : units) {
    const size_t length = std::char_traits<char>::length(unit.suffix);
    if (!ends_with_upper(size, unit.suffix)) continue;
    const auto bytes = static_cast<int64_t>(number(length) * unit.factor);
    return unit.bits_allowed && size.back() == 'b' ? bytes / 8 : bytes;
  }
  TORCH_CHECK_VALUE(!size.empty() && std::all_of(size.begin(), size.end(),
                                                 [](char c) { return std::isdigit(static_cast<unsigned char>(c)); }),
                    error());
  TORCH_CHECK_VALUE(size.size() <= 18, error());
  return std::stoll(size);
}

StateDictMap get_state_dict(const torch::nn::Module& module) {
  StateDictMap out;
  collect_state(module, "", out);
  return out;
}

StateDictMap clean_state_dict_for_safetensors(const StateDictMap& state_dict) {
  std::set<std::pair<int, const void*>> seen;
  std::vector<std::string> removed;
  StateDictMap out;
  for (const auto& item : state_dict) {
    const auto& t = item.value();
    if (t.numel() > 0 && !seen.insert(storage_id(t)).second) {
      removed.push_back(item.key());
      continue;
    }
    out.insert(item.key(), t.contiguous());
  }
  if (!removed.empty()) {
    detail::warn("accelerate.utils.modeling",
                 c10::str("Removed shared tensor ", c10::Join(", ", removed),
                          " while saving. This should be OK, but check by verifying that you don't receive any "
                          "warning while reloading"));
  }
  return out;
}

StateDictSplit split_state_dict_into_shards(const StateDictMap& state_dict, int64_t max_shard_size,
                                            const std::string& filename_pattern) {
  TORCH_CHECK_VALUE(max_shard_size > 0, "[split_state_dict_into_shards] max_shard_size must be positive, got ",
                    max_shard_size);
  const auto suffix_at = filename_pattern.find("{suffix}");
  TORCH_CHECK_VALUE(suffix_at != std::string::npos, "[split_state_dict_into_shards] filename_pattern \"",
                    filename_pattern, "\" must contain {suffix}");
  std::vector<std::vector<std::string>> shards;
  std::vector<std::string> current;
  int64_t current_size = 0;
  StateDictSplit split;
  for (const auto& item : state_dict) {
    const auto bytes = static_cast<int64_t>(item.value().numel() * item.value().element_size());
    split.total_size += bytes;
    if (bytes > max_shard_size) {
      shards.push_back({item.key()});
      continue;
    }
    if (current_size + bytes > max_shard_size) {
      shards.push_back(std::move(current));
      current.clear();
      current_size = 0;
    }
    current.push_back(item.key());
    current_size += bytes;
  }
  if (!current.empty() || shards.empty()) shards.push_back(std::move(current));
  const auto name_of = [&](const std::string& suffix) {
    return filename_pattern.substr(0, suffix_at) + suffix + filename_pattern.substr(suffix_at + 8);
  };
  if (shards.size() == 1) {
    const auto file = name_of("");
    std::vector<std::string> keys;
    for (const auto& item : state_dict) {
      keys.push_back(item.key());
      split.tensor_to_filename[item.key()] = file;
    }
    split.filename_to_tensors.emplace_back(file, std::move(keys));
    return split;
  }
  char suffix[64];
  for (size_t i = 0; i < shards.size(); ++i) {
    std::snprintf(suffix, sizeof(suffix), "-%05zu-of-%05zu", i + 1, shards.size());
    const auto file = name_of(suffix);
    for (const auto& key : shards[i]) split.tensor_to_filename[key] = file;
    split.filename_to_tensors.emplace_back(file, std::move(shards[i]));
  }
  return split;
}

void save_state_dict_sharded(const StateDictMap& state_dict, const std::string& save_directory,
                             const std::string& max_shard_size) {
  const fs::path folder(save_directory);
  TORCH_CHECK_VALUE(!fs::is_regular_file(folder), "[save_model] provided path (", save_directory,
                    ") should be a directory, not a file");
  const int64_t limit = convert_file_size_to_int(max_shard_size);
  for (const auto& item : state_dict) {
    TORCH_CHECK_VALUE(!item.value().is_meta(), "[save_model] you can't save the model since ", item.key(),
                      " is on the meta device");
  }
  const auto clean = clean_state_dict_for_safetensors(state_dict);
  const auto split = split_state_dict_into_shards(clean, limit);
  fs::create_directories(folder);

  // Files of an earlier save that the new one does not overwrite would confuse a loader: stale
  // shards, and a single-file model next to a new index (loaders take model.safetensors first).
  static const std::regex old_file(R"(model(-\d{5}-of-\d{5})?\.safetensors)");
  std::set<std::string> new_files;
  for (const auto& [file, keys] : split.filename_to_tensors) new_files.insert(file);
  for (const auto& entry : fs::directory_iterator(folder)) {
    const auto name = entry.path().filename().string();
    if (entry.is_regular_file() && std::regex_match(name, old_file) && !new_files.count(name)) fs::remove(entry.path());
  }
  for (const auto& [file, keys] : split.filename_to_tensors) {
    TensorMap shard;
    for (const auto& key : keys) shard.emplace(key, clean[key]);
    save_file(shard, (folder / file).string(), {{"format", "pt"}});
  }
  const auto index_path = folder / kWeightsIndexName;
  if (split.is_sharded()) {
    nlohmann::json index;
    index["metadata"] = {{"total_size", split.total_size}};
    index["weight_map"] = split.tensor_to_filename;
    detail::write_file_atomically(index_path.string(), index.dump(2) + "\n");
  } else if (fs::exists(index_path)) {
    fs::remove(index_path);
    detail::fsync_directory(folder.string());
  }
}

namespace {

// Refuses loading a tensor stored as `stored` into `target` when that would change its dtype
// without being asked for (Note [Dtypes are checked like shapes] in docs/design.md).
void check_dtype(const at::Tensor& target, c10::ScalarType stored, const LoadCheckpointOptions& options,
                 const char* api, const std::string& key, const std::string& file) {
  if (options.convert_dtypes || target.is_meta() || target.scalar_type() == stored) return;
  if (options.dtype && c10::isFloatingType(stored)) return;
  TORCH_CHECK_VALUE(false, "[", api, "] dtype mismatch for ", key, file.empty() ? "" : " in ", file,
                    ": the checkpoint holds ", detail::dtype_name(stored), ", the module holds ",
                    detail::dtype_name(target.scalar_type()),
                    "; set LoadCheckpointOptions::convert_dtypes to convert");
}

// Whether every value of `t` is finite: one pass, no copy (a finite sum in double precision
// cannot overflow for finite elements of any dtype narrower than double, so only NaN or infinity
// makes it non-finite).
bool all_finite(const at::Tensor& t) {
  if (!t.is_floating_point() || t.numel() == 0 || t.is_meta()) return true;
  if (t.scalar_type() == at::kDouble) return at::isfinite(t).all().item<bool>();
  return std::isfinite(t.sum(at::kDouble).item<double>());
}

// Warns about the tensors of `file` that hold NaN or infinity where the module's had none.
void warn_non_finite(const std::vector<std::string>& names, const std::string& file) {
  if (names.empty()) return;
  detail::warn("accelerate.utils.modeling",
               c10::str("[load_checkpoint_in_model] ", file, ": ", names.size(),
                        " tensor(s) hold NaN or infinite values where the module's had none: ",
                        c10::Join(", ", std::vector<std::string>(names.begin(),
                                                                 names.begin() + std::min<size_t>(names.size(), 8))),
                        names.size() > 8 ? ", …" : ""));
}

}  // namespace

LoadCheckpointResult load_state_dict_into_module(torch::nn::Module& module, const TensorMap& tensors,
                                                 const LoadCheckpointOptions& options) {
  auto targets = module_tensors(module);
  LoadCheckpointResult result;
  std::set<const void*> loaded_storages;
  for (const auto& [name, value] : tensors) {
    auto it = targets.find(name);
    if (it == targets.end()) {
      result.unexpected_keys.push_back(name);
      continue;
    }
    TORCH_CHECK_VALUE(it->second.sizes() == value.sizes(), "[load_state_dict] size mismatch for ", name,
                      ": the checkpoint has shape ", shape_string(value.sizes()), ", the module has ",
                      shape_string(it->second.sizes()));
    check_dtype(it->second, value.scalar_type(), options, "load_state_dict", name, "");
    if (it->second.numel() > 0 && !it->second.is_meta()) loaded_storages.insert(it->second.storage().data());
  }
  std::vector<std::string> names;
  for (const auto& [name, tensor] : targets) names.push_back(name);
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    if (tensors.count(name)) continue;
    const auto& t = targets.at(name);
    if (t.numel() > 0 && !t.is_meta() && loaded_storages.count(t.storage().data())) continue;  // a tied twin was loaded
    result.missing_keys.push_back(name);
  }
  TORCH_CHECK_VALUE(!options.strict || (result.missing_keys.empty() && result.unexpected_keys.empty()),
                    "[load_state_dict] error(s) in loading the state dict: missing keys [",
                    c10::Join(", ", result.missing_keys), "], unexpected keys [",
                    c10::Join(", ", result.unexpected_keys), "]");
  at::NoGradGuard no_grad;
  for (const auto& [name, value] : tensors) {
    auto it = targets.find(name);
    if (it == targets.end()) continue;
    auto& target = it->second;
    if (target.is_meta()) {
      // A model built with `init_empty_weights`: the weight is materialised on the CPU (copying
      // into a meta tensor would silently do nothing).
      set_module_tensor_to_device(module, name, c10::kCPU, value.to(c10::kCPU, value.scalar_type(), false, true),
                                  options.dtype);
    } else if (options.dtype && value.is_floating_point() && target.scalar_type() != *options.dtype) {
      target.set_data(value.to(target.device(), *options.dtype, /*non_blocking=*/false, /*copy=*/true));
    } else {
      target.copy_(options.dtype && value.is_floating_point() ? value.to(*options.dtype) : value);
    }
  }
  return result;
}

namespace {

// The files of `checkpoint`, opened (and so validated), and what a load into `module` would find,
// after every check of names, shapes and dtypes.
struct CheckedCheckpoint {
  std::vector<detail::CheckpointFile> opened;
  LoadCheckpointResult result;
  std::unordered_map<std::string, at::Tensor> targets;
};

CheckedCheckpoint check_checkpoint(torch::nn::Module& module, const std::string& checkpoint,
                                   const LoadCheckpointOptions& options) {
  const auto files = detail::checkpoint_index::resolve_checkpoint(checkpoint, "load_checkpoint_in_model").files;
  // Every file is opened (and so validated) before anything is loaded.
  std::vector<detail::CheckpointFile> opened;
  std::set<std::string> in_files;
  for (const auto& file : files) {
    TORCH_CHECK_VALUE(fs::is_regular_file(file), "[load_checkpoint_in_model] the checkpoint file ", file.string(),
                      " does not exist");
    opened.emplace_back(file.string());
    for (const auto& key : opened.back().keys()) in_files.insert(key);
  }
  LoadCheckpointResult result;
  auto targets = module_tensors(module);
  std::set<const void*> loaded_storages;
  for (const auto& key : in_files) {
    auto it = targets.find(key);
    if (it == targets.end()) {
      result.unexpected_keys.push_back(key);
    } else if (it->second.numel() > 0) {
      loaded_storages.insert(it->second.storage().data());
    }
  }
  std::vector<std::string> names;
  for (const auto& [name, tensor] : targets) names.push_back(name);
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    const auto& t = targets.at(name);
    if (in_files.count(name) || (t.numel() > 0 && loaded_storages.count(t.storage().data()))) continue;
    result.missing_keys.push_back(name);
  }
  TORCH_CHECK_VALUE(!options.strict || (result.missing_keys.empty() && result.unexpected_keys.empty()),
                    "[load_checkpoint_in_model] error(s) in loading ", checkpoint, ": missing keys [",
                    c10::Join(", ", result.missing_keys), "], unexpected keys [",
                    c10::Join(", ", result.unexpected_keys), "]");
  // Shapes are checked for every file before the first tensor is copied.
  for (const auto& file : opened) {
    for (const auto& key : file.keys()) {
      auto it = targets.find(key);
      if (it == targets.end()) continue;
      const auto shape = file.shape(key);
      TORCH_CHECK_VALUE(it->second.sizes() == at::IntArrayRef(shape), "[load_checkpoint_in_model] size mismatch for ",
                        key, " in ", file.path(), ": the checkpoint has shape ", shape_string(shape),
                        ", the module has ", shape_string(it->second.sizes()));
      check_dtype(it->second, file.dtype(key), options, "load_checkpoint_in_model", key, file.path());
    }
  }
  return {std::move(opened), std::move(result), std::move(targets)};
}

}  // namespace

namespace modeling_detail {

void check_checkpoint_in_model(torch::nn::Module& module, const std::string& checkpoint,
                               const LoadCheckpointOptions& options) {
  (void)check_checkpoint(module, checkpoint, options);
}

}  // namespace modeling_detail

LoadCheckpointResult load_checkpoint_in_model(torch::nn::Module& module, const std::string& checkpoint,
                                              const LoadCheckpointOptions& options) {
  auto [opened, result, targets] = check_checkpoint(module, checkpoint, options);
  for (const auto& file : opened) {
    // Tensors that only need their values are read in bulk straight into the module; those
    // materialised from the meta device or given a new dtype go through load_state_dict.
    // By the dtype each is loaded in (keep_in_fp32_modules keeps some in float32).
    TensorMap in_place;
    std::map<std::optional<c10::ScalarType>, TensorMap> replaced;
    std::vector<std::string> non_finite;
    for (const auto& key : file.keys()) {
      auto it = targets.find(key);
      if (it == targets.end()) continue;
      const auto& target = it->second;
      // The module's tensor is looked at only when the checkpoint's is not finite (rare).
      if (!all_finite(file.get_tensor(key)) && all_finite(target)) non_finite.push_back(key);
      const bool floating = at::isFloatingType(file.dtype(key));
      const auto dtype = detail::load_dtype(key, options.dtype, options.keep_in_fp32_modules);
      if (!target.is_meta() && (!dtype || !floating || target.scalar_type() == *dtype)) {
        in_place.emplace(key, target);
      } else {
        replaced[dtype].emplace(key, file.get_tensor(key));
      }
    }
    warn_non_finite(non_finite, file.path());
    file.read_into(in_place);
    for (const auto& [dtype, tensors] : replaced) {
      load_state_dict_into_module(module, tensors,
                                  {.dtype = dtype, .strict = false, .convert_dtypes = options.convert_dtypes});
    }
  }
  if (!options.strict && (!result.missing_keys.empty() || !result.unexpected_keys.empty())) {
    detail::warn("accelerate.utils.modeling",
                 c10::str("[load_checkpoint_in_model] ", checkpoint, ": missing keys [",
                          c10::Join(", ", result.missing_keys), "], unexpected keys [",
                          c10::Join(", ", result.unexpected_keys), "]"));
  }
  return result;
}

std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> get_named_module_children_bottom_up(
    const std::shared_ptr<torch::nn::Module>& model) {
  TORCH_CHECK_VALUE(model != nullptr, "[get_module_children_bottom_up] expected a module, got null");
  // Depth first with a stack: a module is emitted when popped, its children pushed in order, so
  // the reversed emission order has every child, in order, before its parent.
  using Named = std::pair<std::string, std::shared_ptr<torch::nn::Module>>;
  std::vector<Named> stack{{"", model}};
  std::vector<Named> emitted;
  while (!stack.empty()) {
    Named current = std::move(stack.back());
    stack.pop_back();
    std::set<const torch::nn::Module*> seen;
    for (const auto& child : current.second->named_children()) {
      if (!seen.insert(child.value().get()).second) continue;
      stack.emplace_back(current.first.empty() ? child.key() : current.first + "." + child.key(), child.value());
    }
    emitted.push_back(std::move(current));
  }
  std::reverse(emitted.begin(), emitted.end());
  return emitted;
}

std::vector<std::shared_ptr<torch::nn::Module>> get_module_children_bottom_up(
    const std::shared_ptr<torch::nn::Module>& model) {
  std::vector<std::shared_ptr<torch::nn::Module>> modules;
  for (auto& [name, module] : get_named_module_children_bottom_up(model)) modules.push_back(std::move(module));
  return modules;
}

}  // namespace accelerate
