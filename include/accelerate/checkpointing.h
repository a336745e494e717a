// The states that `Accelerator::save_state` writes besides model weights (upstream:
// accelerate/checkpointing.py), as safetensors and JSON instead of pickles: optimizer state,
// random generator states, and the state of any object registered for checkpointing. Nothing
// read from a checkpoint is ever executed.
//
// Every state is a `StateDict`: JSON values plus named tensors. On disk it is a safetensors file
// whose "__metadata__" holds the JSON under the key "json" (Python: `json.loads(
// safe_open(path, "pt").metadata()["json"])`), or a plain JSON file when there are no tensors.
//
// Example:
//   auto state = accelerate::optimizer_state_dict(*adam);
//   accelerate::save_state_dict_file(state, "optimizer.safetensors");
//   accelerate::load_optimizer_state_dict(*adam, accelerate::load_state_dict_file("optimizer.safetensors"));
#pragma once

#include "accelerate/data_loader.h"
#include "accelerate/utils/modeling.h"
#include "accelerate/utils/safetensors.h"
#include "accelerate/utils/type_traits.h"

#include <c10/core/Device.h>
#include <nlohmann/json.hpp>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>

namespace accelerate {

/// A checkpointable state: JSON values and named tensors.
struct StateDict {
  nlohmann::json values = nlohmann::json::object();
  TensorMap tensors{};
};

/// Writes `state` to `path`: a safetensors file (JSON in the metadata under "json") when `path`
/// ends in ".safetensors", a JSON file when it ends in ".json" (then `state` must hold no
/// tensors). The file is flushed to the disk and renamed into place.
void save_state_dict_file(const StateDict& state, const std::string& path);
/// Reads a file written by `save_state_dict_file`. Raises a ValueError naming the path when the
/// file is not valid.
StateDict load_state_dict_file(const std::string& path);

/// The state of a LibTorch optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, LBFGS) in PyTorch's
/// layout: values {"optimizer": kind, "param_groups": [{options…, "params": [indices]}],
/// "state": {"<index>": {scalars}}} and tensors "state.<index>.<name>", parameters numbered in
/// group order. Raises a ValueError for other optimizers, naming their type.
StateDict optimizer_state_dict(const torch::optim::Optimizer& optimizer);
/// Options of `load_optimizer_state_dict`.
struct LoadOptimizerStateOptions {
  /// Convert a state tensor whose dtype differs from its parameter's (otherwise refused).
  bool convert_dtypes = false;
};
/// Restores `optimizer_state_dict`'s output into an optimizer of the same kind over parameters
/// of the same shapes, in the same groups; state tensors go to the device of their parameter.
/// Everything is checked before anything changes; a mismatch (a shape, or a state tensor's dtype
/// that is not its parameter's, unless `options.convert_dtypes`) raises a ValueError saying what
/// differs.
void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const StateDict& state,
                               const LoadOptimizerStateOptions& options = {});

/// The states of LibTorch's default generators: tensor "torch_manual_seed" (the CPU generator)
/// and, with CUDA, "torch_cuda_manual_seed.<device>".
StateDict rng_state_dict();
/// Restores `rng_state_dict`'s output (CUDA states only where the devices exist). Every state is
/// checked (dtype, device, size, and by its generator) before any generator changes; a state that
/// does not fit raises a ValueError naming its key.
void load_rng_state_dict(const StateDict& state);

/// An object saved with `save_state` and restored by `load_state`, type-erased.
struct CheckpointObject {
  std::function<StateDict()> state_dict;
  std::function<void(const StateDict&)> load_state_dict;
};

namespace checkpoint_detail {

/// Raises what `load_rng_state_dict(state)` would raise, and changes nothing.
void check_rng_state_dict(const StateDict& state);

using traits::is_shared_ptr;

template <typename T>
constexpr bool is_module_v = std::is_base_of_v<torch::nn::Module, T> ||
                             std::is_base_of_v<torch::detail::ModuleHolderIndicator, T>;

template <typename S>
StateDict to_state(const S& state) {
  if constexpr (std::is_same_v<S, StateDict>) {
    return state;
  } else if constexpr (std::is_same_v<S, nlohmann::json>) {
    return StateDict{state, {}};
  } else if constexpr (std::is_same_v<S, DataLoaderState>) {
    return StateDict{nlohmann::json::parse(state.to_json()), {}};
  } else if constexpr (std::is_same_v<S, TensorMap>) {
    return StateDict{nlohmann::json::object(), state};
  } else if constexpr (std::is_same_v<S, StateDictMap>) {
    StateDict out;
    for (const auto& item : state) out.tensors.emplace(item.key(), item.value());
    return out;
  } else {
    static_assert(std::is_same_v<S, StateDict>,
                  "accelerate: state_dict() must return nlohmann::json, accelerate::TensorMap, "
                  "accelerate::StateDictMap, accelerate::StateDict or accelerate::DataLoaderState");
  }
}

template <typename S>
S from_state(const StateDict& state) {
  if constexpr (std::is_same_v<S, StateDict>) {
    return state;
  } else if constexpr (std::is_same_v<S, nlohmann::json>) {
    return state.values;
  } else if constexpr (std::is_same_v<S, DataLoaderState>) {
    return DataLoaderState::from_json(state.values.dump());
  } else if constexpr (std::is_same_v<S, TensorMap>) {
    return state.tensors;
  } else {
    StateDictMap out;
    for (const auto& [name, tensor] : state.tensors) out.insert(name, tensor);
    return out;
  }
}

template <typename T, typename = void> struct has_state_methods : std::false_type {};
template <typename T>
struct has_state_methods<T, std::void_t<decltype(std::declval<T&>().load_state_dict(std::declval<T&>().state_dict()))>>
    : std::true_type {};

// The object behind a shared pointer, or the type itself.
template <typename T> using pointee = traits::pointee<T, T>;

template <typename T>
constexpr bool checkpointable_v = is_module_v<typename pointee<T>::type> || has_state_methods<typename pointee<T>::type>::value;

// Fails to compile, naming the argument's position, when argument `Index` of
// `register_for_checkpointing` cannot be checkpointed.
template <size_t Index, bool Checkpointable>
struct checkpointable_argument {
  static_assert(Checkpointable,
                "accelerate: register_for_checkpointing needs objects with state_dict() and load_state_dict() (or "
                "modules); the argument at the position Index of checkpointable_argument<Index, false> has neither");
  static constexpr bool value = Checkpointable;
};

StateDict module_state(const torch::nn::Module& module);
void load_module_state(torch::nn::Module& module, const StateDict& state);

/// Wraps object `object` (argument `index`) for checkpointing. Lvalues that are not shared
/// pointers are referenced, not copied: they must outlive the accelerator's use of them.
template <size_t Index, typename T>
CheckpointObject make_checkpoint_object(T& object) {
  static_assert(checkpointable_argument<Index, checkpointable_v<T>>::value);
  using U = typename pointee<T>::type;
  std::shared_ptr<U> target;
  if constexpr (is_shared_ptr<T>::value) {
    TORCH_CHECK_VALUE(object != nullptr, "[Accelerator::register_for_checkpointing] item ", Index,
                      " is a null pointer; every item needs state_dict() and load_state_dict()");
    target = object;
  } else {
    target = std::shared_ptr<U>(std::shared_ptr<U>{}, &object);
  }
  if constexpr (is_module_v<U>) {
    const auto module = [target]() -> torch::nn::Module& {
      if constexpr (std::is_base_of_v<torch::detail::ModuleHolderIndicator, U>) {
        TORCH_CHECK_VALUE(!target->is_empty(), "[Accelerator::register_for_checkpointing] the module holder is empty");
        return *target->ptr();
      } else {
        return *target;
      }
    };
    return {[module] { return module_state(module()); }, [module](const StateDict& s) { load_module_state(module(), s); }};
  } else {
    using S = std::decay_t<decltype(std::declval<U&>().state_dict())>;
    return {[target] { return to_state<S>(target->state_dict()); },
            [target](const StateDict& s) { target->load_state_dict(from_state<S>(s)); }};
  }
}

}  // namespace checkpoint_detail


// Upstream's `accelerate.utils.save` and `accelerate.utils.load` (accelerate/utils/other.py):
// writing a state dict or plain values to a path on the main process, in torch.save's format by
// default (as upstream) or as safetensors / JSON, and reading back any of those files. They live
// in `accelerate::utils` because `accelerate::save` / `accelerate::load` are safetensors' own
// in-memory functions (upstream: `safetensors.torch.save` / `load`). Example:
//   accelerate::utils::save(accelerate::get_state_dict(*net), "weights.bin");  // torch.load reads it
//   auto state = accelerate::utils::load("weights.bin");                        // state.tensors
namespace utils {

/// Options of `save` (upstream: its keyword arguments).
struct SaveOptions {
  /// Write on every machine's local main process rather than on the main process only.
  bool save_on_each_node = false;
  /// Write safetensors (tensors, with metadata {"format": "pt"}) or JSON (values) instead of
  /// torch.save's format (upstream's default, and here too).
  bool safe_serialization = false;
};

/// Writes `tensors` to `path` on the main process (each machine's local main process with
/// `save_on_each_node`; the others write nothing), flushed and renamed into place (upstream:
/// `accelerate.utils.save`): torch.save's format, an OrderedDict of the tensors that Python's
/// `torch.load(weights_only=True)` reads, or with `safe_serialization` a safetensors file.
void save(const StateDictMap& tensors, const std::string& path, const SaveOptions& options = {});
/// `save` for a name -> tensor map (in name order).
void save(const TensorMap& tensors, const std::string& path, const SaveOptions& options = {});
/// `save` for plain values: torch.save's format (objects become dicts, arrays lists), or with
/// `safe_serialization` a JSON file.
void save(const nlohmann::json& values, const std::string& path, const SaveOptions& options = {});

/// The values and tensors of a file `save` (or Python's `torch.save` of plain values and tensors)
/// wrote (upstream: `accelerate.utils.load`, which is `torch.load` with `weights_only=True`):
/// torch.save's format read as data (anything but tensors, plain values and OrderedDicts is
/// refused by name), a safetensors file (tensors) or a JSON file (values, when `path` ends in
/// ".json"). Tensors are moved to `map_location` when given (upstream's argument).
StateDict load(const std::string& path, std::optional<c10::Device> map_location = std::nullopt);

}  // namespace utils

}  // namespace accelerate
