// State-dict files and generator states: `save_state_dict_file` / `load_state_dict_file` (a
// StateDict as one safetensors file whose metadata holds the JSON values, or as a JSON file without
// tensors), views of such a file for loads that check before they copy (`checkpointing.h`), the
// states of the CPU, CUDA and other accelerators' generators (`rng_state_dict`,
// `load_rng_state_dict`), and modules registered for checkpointing. Upstream pickles these with
// torch.save; that layout is python_layout.cpp's. Optimizer state is optimizer_state.cpp's.
#include "accelerate/checkpointing.h"
#include "checkpoint/checkpointing.h"

#include "accelerate/utils/modeling.h"
#include "accelerate/utils/safetensors.h"
#include "checkpoint/python_layout.h"

#include "detail/accelerator_device.h"
#include "detail/files.h"
#include "detail/torch_compat.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>

#include <filesystem>
#include <mutex>
#include <vector>

namespace accelerate {

namespace {

constexpr const char* kJsonKey = "json";

}  // namespace

// ---- files ---------------------------------------------------------------------------------

void save_state_dict_file(const StateDict& state, const std::string& path) {
  if (path.ends_with(".json")) {
    TORCH_CHECK_VALUE(state.tensors.empty(), "[save_state_dict_file] ", path,
                      ": a JSON file cannot hold tensors; use a .safetensors path");
    detail::write_file_atomically(path, state.values.dump(2) + "\n");
  } else {
    TORCH_CHECK_VALUE(path.ends_with(".safetensors"), "[save_state_dict_file] ", path,
                      ": expected a path ending in .safetensors or .json");
    save_file(state.tensors, path, {{kJsonKey, state.values.dump()}}, /*fsync=*/true);
  }
}

namespace {

// The JSON values that save_state_dict_file put in the file's metadata.
nlohmann::json values_of(const SafetensorsFile& file) {
  const auto& path = file.path();
  const auto& metadata = file.metadata();
  auto it = metadata.find(kJsonKey);
  TORCH_CHECK_VALUE(it != metadata.end(), "[load_state_dict_file] ", path, " has no \"", kJsonKey,
                    "\" entry in its metadata; it was not written by save_state_dict_file");
  try {
    return nlohmann::json::parse(it->second);
  } catch (const nlohmann::json::exception& e) {
    C10_THROW_ERROR(ValueError, c10::str("[load_state_dict_file] the \"", kJsonKey, "\" metadata of ", path,
                                         " is not valid JSON: ", e.what()));
  }
}

}  // namespace

StateDict load_state_dict_file(const std::string& path) {
  StateDict state;
  if (path.ends_with(".json")) {
    try {
      state.values = nlohmann::json::parse(detail::read_file(path));
    } catch (const nlohmann::json::exception& e) {
      C10_THROW_ERROR(ValueError, c10::str("[load_state_dict_file] ", path, " is not valid JSON: ", e.what()));
    } catch (const c10::Error& e) {
      C10_THROW_ERROR(ValueError, c10::str("[load_state_dict_file] ", e.what_without_backtrace()));
    }
    return state;
  }
  SafetensorsFile file(path);
  state.values = values_of(file);
  // Owned copies: the caller may update them in place.
  state.tensors = file.read_tensors();
  return state;
}

// Declared in accelerate/utils/modeling.h: a `.bin` file is read as torch.save's archive.
TensorMap load_state_dict(const std::string& checkpoint_file) {
  if (std::filesystem::path(checkpoint_file).extension() == ".bin") {
    try {
      return detail::checkpoint::python_layout::read_pickled_model({checkpoint_file});
    } catch (const c10::ValueError& e) {
      C10_THROW_ERROR(ValueError, c10::str("[load_state_dict] ", e.what_without_backtrace()));
    }
  }
  return load_file(checkpoint_file);
}

namespace detail::checkpoint {

StateDict state_dict_views(const SafetensorsFile& file) {
  StateDict state;
  state.values = values_of(file);
  for (const auto& key : file.keys()) state.tensors.emplace(key, file.get_tensor(key));
  return state;
}

}  // namespace detail::checkpoint

// ---- random generators ---------------------------------------------------------------------

namespace {

// The generators of an out-of-tree accelerator's devices, each with its key in a checkpoint
// ("torch_<backend>_manual_seed.<index>", beside CUDA's), where LibTorch gives access to them
// (Note [Accelerators other than CUDA]).
template <typename F>
void for_each_backend_generator(F&& f) {
  if (detail::accelerator_type() != c10::DeviceType::PrivateUse1) return;
  const std::string prefix = "torch_" + c10::DeviceTypeName(c10::DeviceType::PrivateUse1, /*lower_case=*/true);
  for (int i = 0; i < detail::accelerator_count(); ++i) {
    auto generator =
        detail::compat::backend_generator(c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(i)));
    if (generator) f(prefix + "_manual_seed." + std::to_string(i), *generator);
  }
}

}  // namespace

StateDict rng_state_dict() {
  StateDict out;
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    out.tensors.emplace("torch_manual_seed", generator.get_state());
  }
  if (at::globalContext().hasCUDA()) {
    const auto devices = at::detail::getCUDAHooks().getNumGPUs();
    for (int i = 0; i < devices; ++i) {
      auto generator = at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i)));
      std::lock_guard<std::mutex> lock(generator.mutex());
      out.tensors.emplace("torch_cuda_manual_seed." + std::to_string(i), generator.get_state());
    }
  }
  for_each_backend_generator([&](const std::string& key, at::Generator& generator) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    out.tensors.emplace(key, generator.get_state());
  });
  return out;
}

namespace {

// One generator and the state a checkpoint holds for it.
struct GeneratorState {
  at::Generator generator;
  const at::Tensor* state;
};

// Every generator `state` holds a state for, each state checked by its generator, so that a state
// of the wrong size, dtype or device is refused before any generator is left changed.
std::vector<GeneratorState> checked_generator_states(const StateDict& state) {
  std::vector<GeneratorState> out;
  const auto take = [&](const std::string& key, at::Generator generator) {
    const auto& tensor = state.tensors.at(key);
    TORCH_CHECK_VALUE(tensor.device().is_cpu() && tensor.scalar_type() == at::kByte && tensor.dim() == 1,
                      "[load_rng_state_dict] ", key, " should be a 1-D uint8 tensor on the CPU, got ",
                      tensor.scalar_type(), " ", tensor.sizes(), " on ", tensor.device());
    // The generator's own checks: the state is set and the generator's own put back at once, under
    // its lock. (A copy of the generator would do without the round trip, but LibTorch 1.13's
    // CPU generator leaks its copies.)
    std::lock_guard<std::mutex> lock(generator.mutex());
    at::Tensor own;
    try {
      own = generator.get_state();
    } catch (const c10::NotImplementedError&) {
      out.push_back({generator, &tensor});  // a generator that does not say its state
      return;
    }
    try {
      generator.set_state(tensor.clone());
    } catch (const c10::Error& e) {
      generator.set_state(own);
      C10_THROW_ERROR(ValueError, c10::str("[load_rng_state_dict] ", key, " is not a state of its generator (",
                                           generator.device(), "): ", e.what_without_backtrace()));
    }
    generator.set_state(own);
    out.push_back({generator, &tensor});
  };
  TORCH_CHECK_VALUE(state.tensors.count("torch_manual_seed"), "[load_rng_state_dict] missing tensor torch_manual_seed");
  take("torch_manual_seed", at::detail::getDefaultCPUGenerator());
  if (at::globalContext().hasCUDA()) {
    const auto devices = at::detail::getCUDAHooks().getNumGPUs();
    for (int i = 0; i < devices; ++i) {
      const auto key = "torch_cuda_manual_seed." + std::to_string(i);
      if (state.tensors.count(key) == 0) continue;
      take(key, at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(i))));
    }
  }
  for_each_backend_generator([&](const std::string& key, at::Generator& generator) {
    if (state.tensors.count(key)) take(key, generator);
  });
  return out;
}

}  // namespace

void load_rng_state_dict(const StateDict& state) {
  for (auto& [generator, tensor] : checked_generator_states(state)) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(tensor->clone());
  }
}

namespace checkpoint_detail {

void check_rng_state_dict(const StateDict& state) { (void)checked_generator_states(state); }

}  // namespace checkpoint_detail

// ---- modules as registered objects -----------------------------------------------------------

namespace checkpoint_detail {

StateDict module_state(const torch::nn::Module& module) {
  StateDict out;
  for (const auto& item : get_state_dict(module)) out.tensors.emplace(item.key(), item.value());
  return out;
}

void load_module_state(torch::nn::Module& module, const StateDict& state) {
  load_state_dict_into_module(module, state.tensors, {.strict = true});
}

}  // namespace checkpoint_detail

}  // namespace accelerate
