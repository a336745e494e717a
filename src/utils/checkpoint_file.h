// One weights file of a checkpoint as load_checkpoint_in_model reads it: a safetensors file
// (mapped, read tensor by tensor) or a pickled `.bin` file written by torch.save (read whole, as
// `load_state_dict` reads it: nothing but tensors, storages and OrderedDicts). Shared by the
// loaders of utils/modeling.cpp and big_modeling.cpp.
#pragma once

#include "accelerate/utils/modeling.h"
#include "accelerate/utils/safetensors.h"

#include <ATen/ATen.h>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace accelerate::detail {

class CheckpointFile {
 public:
  explicit CheckpointFile(const std::filesystem::path& path) : path_(path.string()) {
    if (path.extension() == ".bin") {
      pickled_ = load_state_dict(path_);
    } else {
      safetensors_.emplace(path_);
    }
  }

  const std::string& path() const { return path_; }
  bool pickled() const { return !safetensors_.has_value(); }
  std::vector<std::string> keys() const {
    if (safetensors_) return safetensors_->keys();
    std::vector<std::string> out;
    for (const auto& [name, tensor] : pickled_) out.push_back(name);
    return out;
  }
  std::vector<int64_t> shape(const std::string& key) const {
    return safetensors_ ? safetensors_->entry(key).shape : pickled_.at(key).sizes().vec();
  }
  c10::ScalarType dtype(const std::string& key) const {
    return safetensors_ ? safetensors_dtype(safetensors_->entry(key).dtype) : pickled_.at(key).scalar_type();
  }
  /// The tensor (a view of the mapped file, or of the pickled file's storage).
  at::Tensor get_tensor(const std::string& key) const {
    return safetensors_ ? safetensors_->get_tensor(key) : pickled_.at(key);
  }
  /// Copies each named tensor's values into the given tensor (of the same shape and dtype).
  void read_into(const TensorMap& targets) const {
    if (safetensors_) {
      safetensors_->read_into(targets);
      return;
    }
    at::NoGradGuard no_grad;
    for (const auto& [name, target] : targets) const_cast<at::Tensor&>(target).copy_(pickled_.at(name));
  }

 private:
  std::string path_;
  std::optional<SafetensorsFile> safetensors_;
  TensorMap pickled_;
};

/// The dtype a floating-point weight `name` is loaded in given the `dtype` asked for (upstream:
/// float32 instead of float16 for the weights of `keep_in_fp32_modules`: a name that contains
/// "<module>." or is the module's name).
inline std::optional<c10::ScalarType> load_dtype(const std::string& name, std::optional<c10::ScalarType> dtype,
                                                 const std::vector<std::string>& keep_in_fp32_modules) {
  if (dtype != c10::kHalf) return dtype;
  for (const auto& module : keep_in_fp32_modules) {
    if (name == module || name.find(module + ".") != std::string::npos) return c10::kFloat;
  }
  return dtype;
}

}  // namespace accelerate::detail
