// Upstream's save_state folder (see python_layout.h).
#include "checkpoint/python_layout.h"

#include "formats/checkpoint_index.h"
#include "checkpoint/state_objects.h"
#include "checkpoint/torch_save.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <cmath>
#include <random>
#include <sstream>

namespace fs = std::filesystem;

namespace accelerate::detail::checkpoint::python_layout {

// Note [Checkpoints from and for Python]
// Upstream's save_state writes each object with torch.save under fixed names (model weights as
// safetensors by default), and its load_state calls each object's load_state_dict on what
// torch.load returns. So the two sides meet in PyTorch's state dicts, which this file converts
// to and from the project's, kind by kind:
// - optimizers: the same layout (state by parameter index, param groups with "params"), but
//   PyTorch keeps "step" as a float tensor and None for absent buffers, and its groups carry
//   options LibTorch lacks ("maximize" is refused when true; "foreach", "fused", "capturable",
//   "differentiable" choose kernels and are ignored; Python fills them in when absent);
// - LambdaLR: PyTorch's "_step_count" and "_last_lr" are the project's "step_count" and
//   "last_lr"; its lambdas are saved as None, or as a callable object's attributes ({} for
//   functools.partial, which transformers' schedules use), which a C++ lambda cannot take;
// - random states: the torch generators' states are the same bytes on both sides; Python's
//   `random` and numpy states have no counterpart in C++, are skipped when read and, when
//   written, hold the Mersenne Twister seeded as numpy's seed(s) does from the CPU generator's seed;
// - the scaler's state has the same keys; registered objects are dicts of values and tensors.
// Reading goes through read_torch_save, which builds nothing but values and tensors.

std::string model_file(size_t i, bool safetensors) {
  return safetensors ? numbered(std::string(SAFE_MODEL_NAME), i, ".safetensors")
                     : numbered(std::string(MODEL_NAME), i, ".bin");
}
std::string fsdp_model_file(size_t i) { return numbered("pytorch_model_fsdp", i, ".bin"); }
std::string optimizer_file(size_t i) { return numbered(std::string(OPTIMIZER_NAME), i, ".bin"); }
std::string scheduler_file(size_t i) { return numbered(std::string(SCHEDULER_NAME), i, ".bin"); }
std::string sampler_file(size_t i) { return numbered(std::string(SAMPLER_NAME), i, ".bin"); }
std::string loader_state_file(size_t i) { return numbered("dl_state_dict", i, ".bin"); }
std::string random_file(int process_index) {
  return std::string(RNG_STATE_NAME) + "_" + std::to_string(process_index) + ".pkl";
}
std::string custom_file(size_t i) { return "custom_checkpoint_" + std::to_string(i) + ".pkl"; }

bool is_python_folder(const fs::path& folder) {
  if (fs::is_regular_file(folder / "random_states_0.safetensors")) return false;
  for (const auto* name : {"random_states_0.pkl", "optimizer.bin", "scheduler.bin", "scaler.pt", "pytorch_model.bin",
                           "custom_checkpoint_0.pkl", "pytorch_model_fsdp.bin"}) {
    if (fs::is_regular_file(folder / name)) return true;
  }
  // Upstream's FSDP's SHARDED_STATE_DICT: a torch.distributed.checkpoint folder.
  return fs::is_regular_file(folder / "pytorch_model_fsdp_0" / ".metadata");
}

std::vector<fs::path> model_files(const fs::path& folder, size_t i) {
  for (const bool safetensors : {true, false}) {
    const auto file = folder / model_file(i, safetensors);
    if (fs::is_regular_file(file)) return {file};
    const auto index = folder / (model_file(i, safetensors) + ".index.json");
    if (fs::is_regular_file(index)) {
      if (safetensors) return {index};  // the safetensors loaders read the index themselves
      return checkpoint_index::read_checkpoint_index(index, "Accelerator::load_state").files;
    }
  }
  if (fs::is_regular_file(folder / fsdp_model_file(i))) return {folder / fsdp_model_file(i)};
  return {};
}

TensorMap read_pickled_model(const std::vector<fs::path>& files) {
  TensorMap out;
  for (const auto& file : files) {
    auto state = read_torch_save(file.string());
    TORCH_CHECK_VALUE(state.values.is_object() && state.values.empty(), file.string(),
                      " holds values besides tensors; a model's state dict holds only tensors");
    for (auto& [name, tensor] : state.tensors) {
      TORCH_CHECK_VALUE(!out.count(name), file.string(), ": tensor ", name, " is in more than one file");
      out.emplace(name, std::move(tensor));
    }
  }
  return out;
}

// ---- optimizers ----------------------------------------------------------------------------------

const char* const kLbfgsReason =
    "PyTorch keeps LBFGS's history (d, t, old_dirs, old_stps, ro, H_diag, prev_flat_grad, ...) as lists of tensors "
    "under its first parameter, which LibTorch's LBFGS lays out otherwise, and the conversion is not written";

StateDict optimizer_from_pytorch(StateDict py, const torch::optim::Optimizer& optimizer,
                                 const std::vector<std::string>& names, const std::string& path) {
  auto kind = optimizer_state_dict(optimizer).values.at("optimizer").get<std::string>();
  TORCH_CHECK_VALUE(kind != "LBFGS", path, ": LBFGS's state is not read from Python's files: ", kLbfgsReason);
  const auto where = path + ":";
  TORCH_CHECK_VALUE(py.values.is_object() && py.values.contains("state") && py.values.contains("param_groups") &&
                        py.values.at("param_groups").is_array(),
                    where, " not an optimizer's state dict (no \"state\" and \"param_groups\")");
  StateDict out;
  out.values["optimizer"] = kind;
  out.values["param_groups"] = py.values.at("param_groups");
  // Parameters named by their module paths (FSDP's optim_state_dict, upstream's FSDP files) or
  // numbered (optimizer.state_dict()); names become the numbers of this optimizer's parameters.
  bool by_name = false;
  for (const auto& group : out.values["param_groups"]) {
    TORCH_CHECK_VALUE(group.is_object(), where, " a param group is not a dict");
    TORCH_CHECK_VALUE(!group.contains("maximize") || !group.at("maximize").is_boolean() || !group.at("maximize").get<bool>(),
                      where, " the optimizer maximizes (maximize=True), which LibTorch's ", kind, " cannot");
    if (group.contains("params") && group.at("params").is_array() && !group.at("params").empty() &&
        group.at("params")[0].is_string()) {
      by_name = true;
    }
  }
  std::map<std::string, std::string> number_of;
  if (by_name) {
    for (size_t i = 0; i < names.size(); ++i) {
      if (!names[i].empty()) number_of.emplace(names[i], std::to_string(i));
    }
  }
  const auto number = [&](const std::string& name) -> std::string {
    if (!by_name) return name;
    auto it = number_of.find(name);
    TORCH_CHECK_VALUE(it != number_of.end(), where, " the optimizer's state names parameter \"", name,
                      "\", which none of the prepared models has");
    return it->second;
  };
  if (by_name) {
    for (auto& group : out.values["param_groups"]) {
      TORCH_CHECK_VALUE(group.contains("params") && group.at("params").is_array(), where, " a param group has no params");
      auto numbered = nlohmann::json::array();
      for (const auto& name : group.at("params")) {
        TORCH_CHECK_VALUE(name.is_string(), where, " a param group names some parameters and numbers others");
        numbered.push_back(std::stoll(number(name.get<std::string>())));
      }
      group["params"] = numbered;
    }
  }
  auto& states = out.values["state"] = nlohmann::json::object();
  TORCH_CHECK_VALUE(py.values.at("state").is_object(), where, " \"state\" is not a dict");
  for (const auto& [index, entries] : py.values.at("state").items()) {
    auto& s = states[number(index)] = nlohmann::json::object();
    TORCH_CHECK_VALUE(entries.is_object(), where, " the state of parameter ", index, " is not a dict");
    for (const auto& [name, value] : entries.items()) {
      if (!value.is_null()) s[name] = value;
    }
  }
  for (auto& [key, tensor] : py.tensors) {
    const auto dot = key.rfind('.');
    if (key.rfind("state.", 0) != 0 || dot == std::string::npos || dot < 6) {
      TORCH_CHECK_VALUE(false, where, " tensor ", key, " is outside the per-parameter state");
    }
    const auto index = number(key.substr(6, dot - 6));
    const auto name = key.substr(dot + 1);
    if (!states.contains(index)) states[index] = nlohmann::json::object();
    if (name == "step") {
      TORCH_CHECK_VALUE(tensor.numel() == 1, where, " ", key, " should hold one number");
      const double step = tensor.to(at::kDouble).item<double>();
      TORCH_CHECK_VALUE(step >= 0 && step == std::floor(step) && step < 9.0e15, where, " ", key,
                        " should be a whole number of steps, got ", step);
      states[index]["step"] = static_cast<int64_t>(step);
      continue;
    }
    out.tensors.emplace("state." + index + "." + name, tensor);
  }
  return out;
}

StateDict read_optimizer(const std::string& path, const torch::optim::Optimizer& optimizer,
                         const std::vector<std::string>& names) {
  return optimizer_from_pytorch(read_torch_save(path), optimizer, names, path);
}

void add_pytorch_group_options(const std::string& kind, nlohmann::json& group) {
  const auto fill = [&](const char* key, nlohmann::json value) {
    if (!group.contains(key)) group[key] = std::move(value);
  };
  fill("maximize", false);
  fill("foreach", nullptr);
  fill("differentiable", false);
  if (kind == "Adam" || kind == "AdamW") {
    fill("capturable", false);
    fill("fused", nullptr);
    fill("decoupled_weight_decay", kind == "AdamW");
  } else if (kind == "SGD" || kind == "Adagrad") {
    fill("fused", nullptr);
  } else if (kind == "RMSprop") {
    fill("capturable", false);
  }
}

void write_optimizer(const StateDict& ours, const std::string& path, const std::vector<std::string>& names) {
  const auto kind = ours.values.at("optimizer").get<std::string>();
  TORCH_CHECK_VALUE(kind != "LBFGS", "[Accelerator::save_state] LBFGS's state is not written in Python's layout: ",
                    kLbfgsReason);
  // FSDP's files name the parameters (optim_state_dict); optimizer.state_dict() numbers them.
  const auto key_of = [&](const std::string& index) -> std::string {
    if (names.empty()) return index;
    const auto i = static_cast<size_t>(std::stoull(index));
    TORCH_CHECK_VALUE(i < names.size() && !names[i].empty(), "[Accelerator::save_state] parameter ", index,
                      " of the optimizer is in no prepared model, so it has no name for upstream's FSDP files");
    return names[i];
  };
  TorchSaveWriter w;
  auto& tr = w.tree();
  std::vector<std::pair<const pickle::Value*, const pickle::Value*>> groups_state;
  for (const auto& [index, scalars] : ours.values.at("state").items()) {
    std::vector<std::pair<const pickle::Value*, const pickle::Value*>> entries;
    for (const auto& [name, value] : scalars.items()) {
      // PyTorch keeps the step as a float tensor (its kernels update it in place).
      const auto* v = name == "step" ? w.tensor(at::scalar_tensor(value.get<double>(), at::kFloat)) : w.from_json(value);
      entries.emplace_back(tr.string(name), v);
    }
    const auto prefix = "state." + index + ".";
    for (const auto& [key, tensor] : ours.tensors) {
      if (key.rfind(prefix, 0) == 0) entries.emplace_back(tr.string(key.substr(prefix.size())), w.tensor(tensor));
    }
    groups_state.emplace_back(names.empty() ? tr.integer(std::stoll(index)) : tr.string(key_of(index)),
                              tr.dict(std::move(entries)));
  }
  std::vector<const pickle::Value*> groups;
  for (auto group : ours.values.at("param_groups")) {
    add_pytorch_group_options(kind, group);
    std::vector<std::pair<const pickle::Value*, const pickle::Value*>> entries;
    for (const auto& [name, value] : group.items()) {
      const pickle::Value* v = nullptr;
      if (name == "betas") {
        v = tr.tuple({tr.number(value[0].get<double>()), tr.number(value[1].get<double>())});
      } else if (name == "params" && !names.empty()) {
        std::vector<const pickle::Value*> params;
        for (const auto& p : value) params.push_back(tr.string(key_of(std::to_string(p.get<int64_t>()))));
        v = tr.list(std::move(params));
      } else {
        v = w.from_json(value);
      }
      entries.emplace_back(tr.string(name), v);
    }
    groups.push_back(tr.dict(std::move(entries)));
  }
  const auto* root = tr.dict({{tr.string("state"), tr.dict(std::move(groups_state))},
                              {tr.string("param_groups"), tr.list(std::move(groups))}});
  w.write(root, path);
}

void write_pickled_model(const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& path) {
  TorchSaveWriter w;
  std::vector<std::pair<const pickle::Value*, const pickle::Value*>> entries;
  for (const auto& [name, tensor] : tensors) entries.emplace_back(w.tree().string(name), w.tensor(tensor));
  w.write(w.ordered_dict(std::move(entries)), path);
}

// ---- schedulers ----------------------------------------------------------------------------------

namespace {

void require_lambda_lr(const LRScheduler& scheduler, const std::string& what) {
  TORCH_CHECK_VALUE(dynamic_cast<const LambdaLR*>(&scheduler) != nullptr, what,
                    ": only LambdaLR schedulers (and transformers' schedules, which are LambdaLRs) cross between "
                    "Python and C++; PyTorch keeps a OneCycleLR's rate and momentum bounds (initial_lr, max_lr, "
                    "min_lr, max_momentum, base_momentum) in the optimizer's param groups, as keys LibTorch's param "
                    "groups cannot hold");
}

}  // namespace

nlohmann::json read_scheduler(const std::string& path, const LRScheduler& scheduler) {
  require_lambda_lr(scheduler, path);
  auto py = read_torch_save(path);
  const auto& v = py.values;
  TORCH_CHECK_VALUE(py.tensors.empty() && v.is_object(), path, ": not a scheduler's state dict");
  for (const auto* key : {"base_lrs", "last_epoch", "_step_count", "_last_lr", "lr_lambdas"}) {
    TORCH_CHECK_VALUE(v.contains(key), path, ": the scheduler's state has no \"", key, "\" (not a LambdaLR's?)");
  }
  auto lambdas = nlohmann::json::array();
  const auto& saved = v.at("lr_lambdas");
  TORCH_CHECK_VALUE(saved.is_array(), path, ": \"lr_lambdas\" is not a list");
  for (size_t i = 0; i < saved.size(); ++i) {
    TORCH_CHECK_VALUE(saved[i].is_null() || (saved[i].is_object() && saved[i].empty()), path, ": lr_lambdas[", i,
                      "] holds a callable object's attributes ", saved[i].dump(),
                      ", which a C++ lambda cannot take; build the scheduler with a lambda that needs no state");
    lambdas.push_back(nullptr);
  }
  return {{"base_lrs", v.at("base_lrs")}, {"last_epoch", v.at("last_epoch")}, {"step_count", v.at("_step_count")},
          {"last_lr", v.at("_last_lr")}, {"lr_lambdas", lambdas}};
}

void write_scheduler(const LRScheduler& scheduler, const std::string& path) {
  require_lambda_lr(scheduler, "[Accelerator::save_state] " + path);
  const auto ours = scheduler.state_dict();
  TorchSaveWriter w;
  auto& tr = w.tree();
  std::vector<const pickle::Value*> lambdas;
  for (size_t i = 0; i < ours.at("lr_lambdas").size(); ++i) lambdas.push_back(tr.none());
  const auto* root = tr.dict({{tr.string("base_lrs"), w.from_json(ours.at("base_lrs"))},
                              {tr.string("last_epoch"), w.from_json(ours.at("last_epoch"))},
                              {tr.string("verbose"), tr.boolean(false)},
                              {tr.string("_step_count"), w.from_json(ours.at("step_count"))},
                              {tr.string("_get_lr_called_within_step"), tr.boolean(false)},
                              {tr.string("_last_lr"), w.from_json(ours.at("last_lr"))},
                              {tr.string("lr_lambdas"), tr.list(std::move(lambdas))}});
  w.write(root, path);
}

// ---- the scaler ----------------------------------------------------------------------------------

nlohmann::json read_scaler(const std::string& path) {
  auto py = read_torch_save(path);
  TORCH_CHECK_VALUE(py.tensors.empty() && py.values.is_object(), path, ": not a GradScaler's state dict");
  return py.values;
}

void write_scaler(const nlohmann::json& state, const std::string& path) {
  TorchSaveWriter w;
  w.write(w.from_json(state), path);
}

// ---- random states -------------------------------------------------------------------------------

StateDict read_random(const std::string& path, std::vector<std::string>& skipped) {
  auto py = read_torch_save(path, {.skippable_modules = {"numpy", "_codecs"}, .skipped = nullptr});
  TORCH_CHECK_VALUE(py.values.is_object(), path, ": not a dict of random states");
  StateDict out;
  if (py.values.contains("step")) {
    TORCH_CHECK_VALUE(py.values.at("step").is_number_integer(), path, ": \"step\" is not an integer");
    out.values["step"] = py.values.at("step");
  } else {
    out.values["step"] = 0;
  }
  // What is neither the step nor a torch generator (the CPU's, CUDA's) has no C++ counterpart.
  for (const auto& [key, value] : py.values.items()) {
    if (key != "step" && key != "torch_cuda_manual_seed") skipped.push_back(key);
  }
  for (auto& [key, tensor] : py.tensors) {
    if (key == "torch_manual_seed" || key.rfind("torch_cuda_manual_seed.", 0) == 0) out.tensors.emplace(key, tensor);
  }
  TORCH_CHECK_VALUE(out.tensors.count("torch_manual_seed"), path, ": no \"torch_manual_seed\"");
  return out;
}

void write_random(const StateDict& generators, int64_t step, const std::string& path) {
  TorchSaveWriter w;
  auto& tr = w.tree();
  // The Mersenne Twister that numpy's seed(s) makes (std::mt19937 seeds the same way), as
  // Python's random.getstate() and numpy's get_state() lay it out.
  const auto seed = static_cast<uint32_t>(at::detail::getDefaultCPUGenerator().current_seed());
  std::mt19937 twister(seed);
  std::stringstream text;
  text << twister;  // the 624 words of its state, then its position
  std::vector<const pickle::Value*> words, key;
  for (int i = 0; i < 624; ++i) {
    uint64_t word = 0;
    text >> word;
    words.push_back(tr.integer(static_cast<int64_t>(word)));
    key.push_back(tr.integer(static_cast<int64_t>(word)));
  }
  words.push_back(tr.integer(624));
  const auto* python_random = tr.tuple({tr.integer(3), tr.tuple(std::move(words)), tr.none()});
  const auto* numpy_random =
      tr.tuple({tr.string("MT19937"), tr.list(std::move(key)), tr.integer(624), tr.integer(0), tr.number(0.0)});
  std::vector<const pickle::Value*> cuda;
  for (size_t d = 0;; ++d) {
    auto it = generators.tensors.find("torch_cuda_manual_seed." + std::to_string(d));
    if (it == generators.tensors.end()) break;
    cuda.push_back(w.tensor(it->second));
  }
  const auto* root = tr.dict({{tr.string("step"), tr.integer(step)},
                              {tr.string("random_state"), python_random},
                              {tr.string("numpy_random_seed"), numpy_random},
                              {tr.string("torch_manual_seed"), w.tensor(generators.tensors.at("torch_manual_seed"))},
                              {tr.string("torch_cuda_manual_seed"), tr.list(std::move(cuda))}});
  w.write(root, path);
}

// ---- registered objects --------------------------------------------------------------------------

StateDict read_custom(const std::string& path) { return read_torch_save(path); }

void write_custom(const StateDict& state, const std::string& path) {
  TorchSaveWriter w;
  auto& tr = w.tree();
  TORCH_CHECK_VALUE(state.tensors.empty() || state.values.is_object(),
                    "[Accelerator::save_state] a registered object whose state holds tensors and a non-object JSON "
                    "value cannot be written as one Python dict");
  if (!state.values.is_object()) {
    w.write(w.from_json(state.values), path);
    return;
  }
  std::vector<std::pair<const pickle::Value*, const pickle::Value*>> entries;
  for (const auto& [key, value] : state.values.items()) entries.emplace_back(tr.string(key), w.from_json(value));
  for (const auto& [name, tensor] : state.tensors) {
    TORCH_CHECK_VALUE(!state.values.contains(name), "[Accelerator::save_state] a registered object's state has \"",
                      name, "\" both as a value and as a tensor");
    entries.emplace_back(tr.string(name), w.tensor(tensor));
  }
  w.write(state.values.empty() ? w.ordered_dict(std::move(entries)) : tr.dict(std::move(entries)), path);
}

}  // namespace accelerate::detail::checkpoint::python_layout
