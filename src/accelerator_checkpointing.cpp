// Checkpoints of an Accelerator: save/save_model/save_state/load_state; see
// include/accelerate/accelerator.h and docs/design.md ("Checkpoints").
#include "accelerate/accelerator.h"

#include "detail/accelerator_impl.h"
#include "detail/checkpoint_commit.h"
#include "detail/collectives.h"
#include "detail/files.h"
#include "detail/fsdp.h"
#include "detail/load_checks.h"
#include "detail/offload_dtypes.h"
#include "detail/optimizer_state.h"
#include "detail/warn.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <limits>
#include <regex>
#include <set>
#include <thread>

namespace fs = std::filesystem;

namespace accelerate {

namespace {

// "<stem><ext>" for the first object, "<stem>_<i><ext>" for the others (upstream's naming).
std::string numbered(const std::string& stem, size_t i, const std::string& ext) {
  return i == 0 ? stem + ext : stem + "_" + std::to_string(i) + ext;
}

// A data loader's state as `save_state` stores it: without `use_stateful_dataloader` only the
// order (epoch and generator) is kept and a resumed pass starts at its first batch, as upstream.
DataLoaderState sampler_state(const DataLoader& loader) {
  auto state = loader.state_dict();
  if (!loader.use_stateful_dataloader()) state.batches_yielded = 0;
  return state;
}

// The fully sharded engine that holds the parameters of `optimizer`, if any.
detail::FsdpEngine* sharding_engine(const std::vector<DistributedDataParallel>& models,
                                    const torch::optim::Optimizer& optimizer) {
  for (const auto& model : models) {
    auto* engine = detail::fsdp_engine(model);
    if (!engine) continue;
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        if (engine->manages(p)) return engine;
      }
    }
  }
  return nullptr;
}

bool sharded_state(detail::FsdpEngine* engine) {
  return engine->settings().state_dict_type != FsdpStateDictType::kFullStateDict;
}
bool local_state(detail::FsdpEngine* engine) {
  return engine->settings().state_dict_type == FsdpStateDictType::kLocalStateDict;
}

// The parameters of an optimizer in the numbering of `optimizer_state_dict`.
std::vector<at::Tensor> optimizer_params(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> params;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) params.push_back(p);
  }
  return params;
}

// The parameter number in an optimizer state tensor's name, "state.<index>.<name>".
size_t state_param_index(const std::string& key) {
  const auto dot = key.find('.', 6);
  const bool numbered = key.rfind("state.", 0) == 0 && dot != std::string::npos && dot > 6 &&
                        std::all_of(key.begin() + 6, key.begin() + static_cast<std::ptrdiff_t>(dot),
                                    [](unsigned char c) { return std::isdigit(c); });
  TORCH_CHECK_VALUE(numbered, "expected optimizer state tensors named 'state.<index>.<name>', got '", key, "'");
  return static_cast<size_t>(std::stoull(key.substr(6, dot - 6)));
}

std::string loader_file(const DataLoader& loader, size_t i) {
  return numbered(loader.use_stateful_dataloader() ? "dl_state_dict" : "sampler", i, ".json");
}

// The custom checkpoint files of a folder, by index.
std::map<size_t, fs::path> custom_checkpoint_files(const fs::path& folder) {
  static const std::regex name(R"(custom_checkpoint_(\d{1,9})\.(json|safetensors))");
  std::map<size_t, fs::path> files;
  for (const auto& entry : fs::directory_iterator(folder)) {
    std::smatch match;
    const auto file = entry.path().filename().string();
    if (std::regex_match(file, match, name)) files[std::stoul(match[1])] = entry.path();
  }
  return files;
}

// What save_state and load_state work on, copied under the lock.
struct Snapshot {
  std::vector<DistributedDataParallel> models;
  std::vector<AcceleratedOptimizer> optimizers;
  std::vector<AcceleratedScheduler> schedulers;
  std::vector<DataLoader> loaders;
  std::vector<CheckpointObject> custom;
  std::vector<SaveStatePreHook> save_hooks;
  std::vector<LoadStatePreHook> load_hooks;
  int64_t step = 0;
};

Snapshot snapshot(detail::AcceleratorImpl& impl) {
  std::lock_guard<std::mutex> lock(impl.mutex);
  Snapshot out{impl.models, impl.optimizers, impl.schedulers, impl.data_loaders, impl.custom_objects, {}, {}, impl.step};
  for (const auto& [id, hook] : impl.save_hooks) out.save_hooks.push_back(hook);
  for (const auto& [id, hook] : impl.load_hooks) out.load_hooks.push_back(hook);
  return out;
}

}  // namespace

bool Accelerator::writes_shared_files() const {
  return project_configuration().save_on_each_node ? is_local_main_process() : is_main_process();
}

void Accelerator::save(const StateDictMap& tensors, const std::string& path) const {
  TensorMap map;
  for (const auto& item : tensors) map.emplace(item.key(), item.value());
  save(map, path);
}

void Accelerator::save(const TensorMap& tensors, const std::string& path) const {
  if (writes_shared_files()) save_file(tensors, path);
}

void Accelerator::save(const nlohmann::json& values, const std::string& path) const {
  if (writes_shared_files()) detail::write_file_atomically(path, values.dump(2) + "\n");
}

StateDictMap Accelerator::model_state_dict(const std::shared_ptr<torch::nn::Module>& module) const {
  std::optional<DistributedDataParallel> sharded;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    for (const auto& prepared : impl_->models) {
      if (prepared.module() == module && prepared.is_fully_sharded()) sharded = prepared;
    }
  }
  if (!sharded) return accelerate::get_state_dict(*module);
  StateDictMap out;
  for (auto& [name, tensor] : detail::fsdp_engine(*sharded)->full_state_dict()) out.insert(name, tensor);
  return out;
}

void Accelerator::save_module(const std::shared_ptr<torch::nn::Module>& module, const std::string& save_directory,
                              const std::string& max_shard_size) const {
  TORCH_CHECK_VALUE(!fs::is_regular_file(save_directory), "[Accelerator::save_model] provided path (", save_directory,
                    ") should be a directory, not a file");
  auto weights = model_state_dict(module);
  if (writes_shared_files()) save_state_dict_sharded(weights, save_directory, max_shard_size);
}

void Accelerator::register_checkpoint_objects(std::vector<CheckpointObject> objects) const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (auto& object : objects) impl_->custom_objects.push_back(std::move(object));
}

namespace {

// Registers `hook` in one of the accelerator's hook maps; the handle removes it again (a no-op
// once the accelerator is gone).
template <typename Hook>
RemovableHandle add_hook(const std::shared_ptr<detail::AcceleratorImpl>& impl,
                         std::map<int64_t, Hook> detail::AcceleratorImpl::*hooks, Hook hook, const char* api) {
  TORCH_CHECK_VALUE(hook != nullptr, "[Accelerator::", api, "] expected a hook, got none");
  std::lock_guard<std::mutex> lock(impl->mutex);
  const auto id = impl->next_hook_id++;
  ((*impl).*hooks).emplace(id, std::move(hook));
  std::weak_ptr<detail::AcceleratorImpl> weak = impl;
  return RemovableHandle([weak, hooks, id] {
    if (auto alive = weak.lock()) {
      std::lock_guard<std::mutex> lock(alive->mutex);
      ((*alive).*hooks).erase(id);
    }
  });
}

}  // namespace

RemovableHandle Accelerator::register_save_state_pre_hook(SaveStatePreHook hook) const {
  return add_hook(impl_, &detail::AcceleratorImpl::save_hooks, std::move(hook), "register_save_state_pre_hook");
}

RemovableHandle Accelerator::register_load_state_pre_hook(LoadStatePreHook hook) const {
  return add_hook(impl_, &detail::AcceleratorImpl::load_hooks, std::move(hook), "register_load_state_pre_hook");
}

int Accelerator::save_iteration() const { return project_configuration().iteration; }

void Accelerator::set_save_iteration(int iteration) const {
  TORCH_CHECK_VALUE(iteration >= 0, "[Accelerator::set_save_iteration] expected a non-negative iteration, got ",
                    iteration);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->project.iteration = iteration;
  impl_->iteration_chosen = true;
}

// Note [A new run beside an earlier run's checkpoints]
// Upstream numbers a run's checkpoints from 0 whatever the folder holds and prunes the lowest
// numbers, so a new run started in the folder of an earlier one removes its own checkpoints as
// soon as it writes them, and a later resume takes the earlier run's. Here a run that did not
// choose its numbers (ProjectConfiguration::iteration, set_save_iteration, load_state) numbers its
// first checkpoint after every `checkpoint_<n>` folder there, saying so once: its checkpoints are
// then the newest, and pruning removes the earlier run's first.
void Accelerator::number_after_earlier_run(ProjectConfiguration& project) const {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (impl_->iteration_chosen) return;
    impl_->iteration_chosen = true;
  }
  const auto root = fs::path(project.project_dir) / "checkpoints";
  int64_t highest = -1;
  if (is_main_process()) {
    std::vector<std::pair<int64_t, fs::path>> incomplete;
    for (const auto& [number, path] : detail::list_checkpoints(root, &incomplete)) highest = std::max(highest, number);
    for (const auto& [number, path] : incomplete) highest = std::max(highest, number);
  }
  if (num_processes() > 1) {
    const auto text = std::to_string(highest);
    const auto bytes = detail::broadcast_bytes(partial(), std::vector<char>(text.begin(), text.end()), 0,
                                               "[Accelerator::save_state]");
    highest = std::stoll(std::string(bytes.begin(), bytes.end()));
  }
  if (highest < project.iteration) return;
  TORCH_CHECK_VALUE(highest < std::numeric_limits<int>::max(), "[Accelerator::save_state] ", root.string(),
                    " holds checkpoint_", highest, ", past the last number a checkpoint can have");
  detail::warn("accelerate.accelerator",
               c10::str("[Accelerator::save_state] ", root.string(), " already holds checkpoints up to checkpoint_",
                        highest, " of an earlier run; this run's checkpoints are numbered from checkpoint_",
                        highest + 1, " so that total_limit removes the earlier run's first (load_state() continues "
                        "that run instead; set_save_iteration chooses the number)"),
               {.state = partial()});
  project.iteration = static_cast<int>(highest + 1);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->project.iteration = project.iteration;
}

std::string Accelerator::save_state(const std::string& output_dir) const {
  auto project = project_configuration();
  fs::path target;
  if (project.automatic_checkpoint_naming) {
    TORCH_CHECK_VALUE(output_dir.empty(), "[Accelerator::save_state] automatic_checkpoint_naming chooses the folder; "
                                          "got output_dir ", output_dir);
    TORCH_CHECK_VALUE(!project.project_dir.empty(), "[Accelerator::save_state] automatic_checkpoint_naming needs "
                                                    "ProjectConfiguration::project_dir");
    number_after_earlier_run(project);
    target = fs::path(project.project_dir) / "checkpoints" / ("checkpoint_" + std::to_string(project.iteration));
  } else {
    TORCH_CHECK_VALUE(!output_dir.empty(), "[Accelerator::save_state] expected an output_dir (or "
                                           "ProjectConfiguration::automatic_checkpoint_naming)");
    target = output_dir;
  }
  // Every process decides alike: process 0's view of the folder is what counts.
  detail::run_agreed(partial(), "[Accelerator::save_state]", [&] {
    TORCH_CHECK_VALUE(!project.automatic_checkpoint_naming || !is_main_process() || !fs::exists(target),
                      "checkpoint directory ", target.string(), " (", project.iteration,
                      ") already exists; call set_save_iteration with the iteration to start with");
  });

  const auto [models, optimizers, schedulers, loaders, custom, save_hooks, load_hooks, step] = snapshot(*impl_);
  // Fully sharded models, and the optimizers over their parameters (Note [Sharded checkpoint layout]).
  std::vector<detail::FsdpEngine*> model_engines, optimizer_engines;
  for (const auto& model : models) model_engines.push_back(detail::fsdp_engine(model));
  for (const auto& optimizer : optimizers) optimizer_engines.push_back(sharding_engine(models, *optimizer.optimizer()));
  detail::CheckpointCommit commit(partial(), target, project.save_on_each_node, project.automatic_checkpoint_naming);
  const fs::path folder = commit.staging();
  const auto written = [&] { detail::checkpoint_file_written(partial()); };
  const auto path = commit.commit([&] {
    std::vector<StateDictMap> weights;
    for (size_t i = 0; i < models.size(); ++i) {
      auto* engine = model_engines[i];
      if (!engine) {
        weights.push_back(accelerate::get_state_dict(*models[i].module()));
        continue;
      }
      StateDictMap state;
      for (auto& [name, tensor] : sharded_state(engine) ? engine->local_state_dict() : engine->full_state_dict()) {
        state.insert(name, tensor);
      }
      weights.push_back(std::move(state));
    }
    for (const auto& hook : save_hooks) hook(models, weights, folder.string());
    // Sharded states: every process writes its own part.
    for (size_t i = 0; i < weights.size() && i < models.size(); ++i) {
      auto* engine = model_engines[i];
      if (!engine || !sharded_state(engine)) continue;
      std::map<std::string, at::Tensor> tensors;
      std::map<std::string, std::vector<int64_t>> whole;
      std::map<std::string, at::Tensor> params;
      for (const auto& item : models[i].module()->named_parameters()) params.emplace(item.key(), item.value());
      for (const auto& item : weights[i]) {
        tensors.emplace(item.key(), item.value());
        auto it = params.find(item.key());
        if (it != params.end() && engine->is_sharded(it->second)) whole[item.key()] = engine->whole_shape(it->second);
      }
      if (engine->replica_index() != 0) continue;  // hybrid sharding: the first replica writes the shards
      detail::save_sharded_state(engine->shard_group(), (folder / ("pytorch_model_fsdp_" + std::to_string(i))).string(),
                                 {{"model", i}}, tensors, whole);
      written();
    }
    std::vector<std::optional<StateDict>> optimizer_states(optimizers.size());
    for (size_t i = 0; i < optimizers.size(); ++i) {
      auto* engine = optimizer_engines[i];
      if (!engine) continue;
      StateDict state = optimizer_state_dict(*optimizers[i].optimizer());
      const auto params = optimizer_params(*optimizers[i].optimizer());
      std::map<std::string, std::vector<int64_t>> whole;
      for (auto& [key, tensor] : state.tensors) {
        const auto& param = params.at(state_param_index(key));
        if (!engine->is_sharded(param) || tensor.sizes() != param.sizes()) continue;
        if (sharded_state(engine)) {
          whole[key] = engine->whole_shape(param);
        } else {
          tensor = engine->whole_rows(param, tensor);  // a collective, in the same order everywhere
        }
      }
      if (sharded_state(engine)) {
        if (engine->replica_index() != 0) continue;
        detail::save_sharded_state(engine->shard_group(), (folder / ("optimizer_" + std::to_string(i))).string(),
                                   state.values, state.tensors, whole);
        written();
      } else {
        optimizer_states[i] = std::move(state);
      }
    }
    if (commit.writes_shared_files()) {
      for (size_t i = 0; i < weights.size(); ++i) {
        if (i < models.size() && model_engines[i] && sharded_state(model_engines[i])) continue;
        TensorMap tensors;
        for (const auto& item : clean_state_dict_for_safetensors(weights[i])) tensors.emplace(item.key(), item.value());
        save_file(tensors, (folder / numbered("model", i, ".safetensors")).string(), {{"format", "pt"}});
        written();
      }
      for (size_t i = 0; i < optimizers.size(); ++i) {
        if (optimizer_engines[i] && !optimizer_states[i]) continue;  // sharded, written above
        save_state_dict_file(optimizer_states[i] ? *optimizer_states[i] : optimizer_state_dict(*optimizers[i].optimizer()),
                             (folder / numbered("optimizer", i, ".safetensors")).string());
        written();
      }
      for (size_t i = 0; i < schedulers.size(); ++i) {
        save_state_dict_file({schedulers[i].scheduler()->state_dict(), {}},
                             (folder / numbered("scheduler", i, ".json")).string());
        written();
      }
      for (size_t i = 0; i < loaders.size(); ++i) {
        save_state_dict_file({nlohmann::json::parse(sampler_state(loaders[i]).to_json()), {}},
                             (folder / loader_file(loaders[i], i)).string());
        written();
      }
      if (impl_->scaler) {
        save_state_dict_file({impl_->scaler->state_dict(), {}}, (folder / "scaler.json").string());
        written();
      }
      for (size_t i = 0; i < custom.size(); ++i) {
        const auto state = custom[i].state_dict();
        const auto ext = state.tensors.empty() ? ".json" : ".safetensors";
        save_state_dict_file(state, (folder / ("custom_checkpoint_" + std::to_string(i) + ext)).string());
        written();
      }
    }
    auto random = rng_state_dict();
    random.values["step"] = step;
    save_state_dict_file(random,
                         (folder / ("random_states_" + std::to_string(process_index()) + ".safetensors")).string());
    written();
  });

  std::set<int64_t> written_here;
  if (project.automatic_checkpoint_naming) {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->checkpoints_written.insert(project.iteration);
    written_here = impl_->checkpoints_written;
  }
  detail::run_agreed(partial(), "[Accelerator::save_state] removing old checkpoints", [&] {
    if (project.automatic_checkpoint_naming && project.total_limit > 0 && commit.writes_shared_files()) {
      detail::prune_checkpoints(target.parent_path(), project.total_limit, written_here, project.iteration);
    }
  });
  if (project.automatic_checkpoint_naming) {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->project.iteration = project.iteration + 1;
  }
  return path.string();
}

namespace {

// Runs `fn`, naming `file` in front of any error it raises (the kind is kept: a ValueError stays
// one, and so do the JSON library's type errors, which say only what the value should have been).
template <typename Fn>
auto naming_file(const fs::path& file, Fn&& fn) {
  try {
    return fn();
  } catch (const c10::ValueError& e) {
    C10_THROW_ERROR(ValueError, c10::str(file.string(), ": ", e.what_without_backtrace()));
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(Error, c10::str(file.string(), ": ", e.what_without_backtrace()));
  } catch (const nlohmann::json::exception& e) {
    C10_THROW_ERROR(ValueError, c10::str(file.string(), ": ", e.what()));
  } catch (const std::invalid_argument& e) {
    C10_THROW_ERROR(ValueError, c10::str(file.string(), ": ", e.what()));
  } catch (const std::exception& e) {
    C10_THROW_ERROR(Error, c10::str(file.string(), ": ", e.what()));
  }
}

const char* json_kind(const nlohmann::json& v) {
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "true or false";
  if (v.is_array()) return "a list";
  if (v.is_object()) return "an object";
  return "null";
}

// Note [Registered objects are checked against their own state]
// A registered object's load_state_dict is the user's code, which may fail on a value of the
// wrong type only once it runs, with the JSON library's bare message. Before anything changes,
// the saved state is compared with the object's current one: at every key both have, the JSON
// kinds must agree (null matches anything; numbers match numbers), and a tensor both have must
// have the same dtype, unless convert_dtypes, which converts it to the current one.
void check_like(const nlohmann::json& saved, const nlohmann::json& current, const std::string& key) {
  if (saved.is_null() || current.is_null()) return;
  TORCH_CHECK_VALUE(std::string(json_kind(saved)) == json_kind(current), "\"", key, "\" holds ", json_kind(saved),
                    " where the object's state holds ", json_kind(current));
  if (saved.is_object()) {
    for (const auto& [name, value] : saved.items()) {
      auto it = current.find(name);
      if (it != current.end()) check_like(value, *it, key.empty() ? name : key + "." + name);
    }
  } else if (saved.is_array()) {
    for (size_t i = 0; i < std::min(saved.size(), current.size()); ++i) {
      check_like(saved[i], current[i], key + "[" + std::to_string(i) + "]");
    }
  }
}

void check_state_like(StateDict& saved, const StateDict& current, bool convert_dtypes) {
  check_like(saved.values, current.values, "");
  for (auto& [name, tensor] : saved.tensors) {
    auto it = current.tensors.find(name);
    if (it == current.tensors.end() || !it->second.defined() || !tensor.defined()) continue;
    if (tensor.scalar_type() == it->second.scalar_type()) continue;
    TORCH_CHECK_VALUE(convert_dtypes, "tensor \"", name, "\" holds ", detail::dtype_name(tensor.scalar_type()),
                      " where the object's state holds ", detail::dtype_name(it->second.scalar_type()),
                      "; set LoadStateOptions::convert_dtypes to convert");
    tensor = tensor.to(it->second.scalar_type());
  }
}

// The tensors a model loads by name, checked against the module's before anything changes (the
// names and shapes are checked by each load itself, the dtypes here too for the sharded paths).
void check_model_dtypes(torch::nn::Module& module, const std::map<std::string, c10::ScalarType>& stored,
                        const std::string& file, bool convert_dtypes) {
  if (convert_dtypes) return;
  std::map<std::string, at::Tensor> targets;
  for (const auto& item : module.named_parameters()) targets.emplace(item.key(), item.value());
  for (const auto& item : module.named_buffers()) targets.emplace(item.key(), item.value());
  for (const auto& [name, dtype] : stored) {
    auto it = targets.find(name);
    if (it == targets.end() || !it->second.defined() || it->second.is_meta() || it->second.scalar_type() == dtype) {
      continue;
    }
    TORCH_CHECK_VALUE(false, "[load_checkpoint_in_model] dtype mismatch for ", name, " in ", file,
                      ": the checkpoint holds ", detail::dtype_name(dtype), ", the module holds ",
                      detail::dtype_name(it->second.scalar_type()), "; set LoadStateOptions::convert_dtypes to convert");
  }
}

// An object's state before a load changes it, and how to put it back should a later part fail.
struct Undo {
  std::vector<std::function<void()>> steps;
  void run() noexcept {
    for (auto it = steps.rbegin(); it != steps.rend(); ++it) {
      try {
        (*it)();
      } catch (...) {  // the first error is what the caller reports
      }
    }
  }
};

}  // namespace

void Accelerator::load_state(const std::string& input_dir, const LoadStateOptions& options) const {
  const auto project = project_configuration();
  fs::path folder;
  if (!input_dir.empty()) {
    folder = input_dir;
    TORCH_CHECK_VALUE(fs::is_directory(folder), "[Accelerator::load_state] tried to find ", input_dir,
                      " but folder does not exist");
  } else {
    TORCH_CHECK_VALUE(project.automatic_checkpoint_naming,
                      "[Accelerator::load_state] no input_dir provided and automatic checkpoint naming is disabled");
    const auto root = fs::path(project.project_dir) / "checkpoints";
    std::vector<std::pair<int64_t, fs::path>> incomplete;
    const auto checkpoints = detail::list_checkpoints(root, &incomplete);
    std::vector<std::string> skipped;  // incomplete folders numbered after the one taken
    for (const auto& [number, path] : incomplete) {
      if (checkpoints.empty() || number > checkpoints.back().first) skipped.push_back(path.filename().string());
    }
    TORCH_CHECK_VALUE(!checkpoints.empty(), "[Accelerator::load_state] no complete checkpoint in ", root.string(),
                      skipped.empty() ? "" : " (not complete: ", c10::Join(", ", skipped), skipped.empty() ? "" : ")");
    folder = checkpoints.back().second;
    if (!skipped.empty()) {
      detail::warn("accelerate.accelerator",
                   c10::str("[Accelerator::load_state] skipped ", c10::Join(", ", skipped), " in ", root.string(),
                            ": not complete checkpoints (no random_states_<process>.safetensors); loading ",
                            folder.filename().string()),
                   {.state = partial()});
    }
  }

  auto [models, optimizers, schedulers, loaders, custom, save_hooks, load_hooks, step] = snapshot(*impl_);
  std::vector<detail::FsdpEngine*> model_engines, optimizer_engines;
  for (const auto& model : models) model_engines.push_back(detail::fsdp_engine(model));
  for (const auto& optimizer : optimizers) optimizer_engines.push_back(sharding_engine(models, *optimizer.optimizer()));
  const bool convert = options.convert_dtypes;
  detail::run_agreed(partial(), "[Accelerator::load_state] loading " + folder.string(), [&] {
    for (const auto& hook : load_hooks) hook(models, folder.string());
    const auto require = [&](const std::string& name) {
      const auto path = folder / name;
      TORCH_CHECK_VALUE(fs::is_regular_file(path), "the checkpoint has no ", name);
      return path;
    };
    // Everything is read and checked first, then applied (Note [Loading changes nothing or all]).
    std::vector<std::string> model_files;
    std::vector<std::optional<StateDict>> sharded_models(models.size());
    for (size_t i = 0; i < models.size(); ++i) {
      const auto sharded_folder = folder / ("pytorch_model_fsdp_" + std::to_string(i));
      std::map<std::string, c10::ScalarType> stored;
      if (model_engines[i] && fs::is_directory(sharded_folder)) {
        sharded_models[i] = naming_file(sharded_folder, [&] {
          return detail::load_sharded_state(model_engines[i]->shard_group(), sharded_folder.string(),
                                            local_state(model_engines[i]));
        });
        for (const auto& [name, tensor] : sharded_models[i]->tensors) stored.emplace(name, tensor.scalar_type());
        check_model_dtypes(*models[i].module(), stored, sharded_folder.string(), convert);
        model_files.emplace_back();
        continue;
      }
      model_files.push_back(require(numbered("model", i, ".safetensors")).string());
      SafetensorsFile file(model_files.back());
      for (const auto& name : file.keys()) stored.emplace(name, safetensors_dtype(file.entry(name).dtype));
      check_model_dtypes(*models[i].module(), stored, file.path(), convert);
    }
    std::vector<StateDict> optimizer_states, scheduler_states, custom_states;
    // Read into the optimizers once everything is checked (null: the state is in memory, for
    // optimizers over sharded parameters).
    std::vector<std::unique_ptr<SafetensorsFile>> optimizer_files;
    std::vector<fs::path> optimizer_paths;
    for (size_t i = 0; i < optimizers.size(); ++i) {
      auto* engine = optimizer_engines[i];
      const auto sharded_folder = folder / ("optimizer_" + std::to_string(i));
      if (engine && fs::is_directory(sharded_folder)) {
        optimizer_paths.push_back(sharded_folder);
        optimizer_states.push_back(naming_file(sharded_folder, [&] {
          return detail::load_sharded_state(engine->shard_group(), sharded_folder.string(), local_state(engine));
        }));
        optimizer_files.emplace_back();
        continue;
      }
      optimizer_paths.push_back(require(numbered("optimizer", i, ".safetensors")));
      auto file = std::make_unique<SafetensorsFile>(optimizer_paths.back().string());
      optimizer_states.push_back(detail::state_dict_views(*file));
      if (engine) {
        // A whole state: this process's rows of each sharded parameter's tensors.
        naming_file(optimizer_paths.back(), [&] {
          const auto params = optimizer_params(*optimizers[i].optimizer());
          for (auto& [key, tensor] : optimizer_states.back().tensors) {
            const size_t index = state_param_index(key);
            TORCH_CHECK_VALUE(index < params.size(), "the optimizer state names parameter ", index, " of ",
                              params.size());
            const auto& param = params[index];
            if (engine->is_sharded(param) && tensor.sizes().vec() == engine->whole_shape(param)) {
              tensor = engine->local_rows(param, tensor).clone();
            }
          }
        });
        file.reset();
      }
      optimizer_files.push_back(std::move(file));
    }
    std::vector<fs::path> scheduler_paths;
    for (size_t i = 0; i < schedulers.size(); ++i) {
      scheduler_paths.push_back(require(numbered("scheduler", i, ".json")));
      scheduler_states.push_back(load_state_dict_file(scheduler_paths.back().string()));
    }
    std::vector<DataLoaderState> loader_positions;
    std::vector<fs::path> loader_paths;
    for (size_t i = 0; i < loaders.size(); ++i) {
      loader_paths.push_back(require(loader_file(loaders[i], i)));
      loader_positions.push_back(naming_file(loader_paths.back(), [&] {
        return DataLoaderState::from_json(load_state_dict_file(loader_paths.back().string()).values.dump());
      }));
    }
    std::optional<StateDict> scaler_state;
    const auto scaler_path = folder / "scaler.json";
    if (impl_->scaler) scaler_state = load_state_dict_file(require("scaler.json").string());
    const auto custom_files = custom_checkpoint_files(folder);
    TORCH_CHECK_VALUE(custom_files.size() == custom.size(), "the number of custom checkpoints in ", folder.string(),
                      " does not match the number of registered objects: found ", custom_files.size(),
                      " checkpoints, ", custom.size(), " registered objects; load checkpoints only into folders "
                      "created with the same set of registered objects");
    for (size_t i = 0; i < custom.size(); ++i) {
      auto it = custom_files.find(i);
      TORCH_CHECK_VALUE(it != custom_files.end(), "the checkpoint has no custom_checkpoint_", i);
      custom_states.push_back(load_state_dict_file(it->second.string()));
      naming_file(it->second, [&] { check_state_like(custom_states.back(), custom[i].state_dict(), convert); });
    }
    const auto random_file = folder / ("random_states_" + std::to_string(process_index()) + ".safetensors");
    std::optional<StateDict> random;
    if (fs::is_regular_file(random_file)) {
      random = load_state_dict_file(random_file.string());
      TORCH_CHECK_VALUE(random->values.contains("step") && random->values.at("step").is_number_integer(),
                        random_file.string(), " has no integer \"step\"");
    } else {
      detail::warn("accelerate.checkpointing",
                   c10::str("[Accelerator::load_state] ", random_file.string(),
                            " is missing (was the checkpoint saved with fewer processes?); the random generators "
                            "keep their states"),
                   {.every_process = true, .state = state().partial_state()});
    }

    // The models' and optimizers' own checks, before any of them changes: they load side by side,
    // and one must not fail after another was loaded.
    for (size_t i = 0; i < models.size(); ++i) {
      if (!model_engines[i]) {
        detail::check_checkpoint_in_model(*models[i].module(), model_files[i], {.strict = true, .convert_dtypes = convert});
      }
    }
    for (size_t i = 0; i < optimizers.size(); ++i) {
      const auto check = [&] {
        detail::check_optimizer_state(*optimizers[i].optimizer(), optimizer_states[i], optimizer_files[i].get(),
                                      {.convert_dtypes = convert});
      };
      if (optimizer_files[i]) {
        check();
      } else {
        naming_file(optimizer_paths[i], check);
      }
    }

    // Note [Loading changes nothing or all]
    // The states that are small and whose load runs code that checks them as it goes (schedulers,
    // data loaders, the scaler, registered objects without tensors) are applied first, each
    // after its current state was kept; should any of them, or the models and optimizers after
    // them, fail, those kept states are put back. The models and optimizers, too large to keep a
    // copy of, ran every check of their loads above (names, shapes, dtypes, the optimizer's
    // settings), so only a failure to read their files can still stop them; registered objects
    // with tensors (which may be modules) were compared with their current state above and are
    // applied last.
    Undo undo;
    try {
      for (size_t i = 0; i < schedulers.size(); ++i) {
        auto scheduler = schedulers[i].scheduler();
        undo.steps.push_back([scheduler, before = scheduler->state_dict()] { scheduler->load_state_dict(before); });
        naming_file(scheduler_paths[i], [&] { scheduler->load_state_dict(scheduler_states[i].values); });
      }
      for (size_t i = 0; i < loaders.size(); ++i) {
        undo.steps.push_back([loader = loaders[i], before = loaders[i].state_dict()] { loader.load_state_dict(before); });
        naming_file(loader_paths[i], [&] { loaders[i].load_state_dict(loader_positions[i]); });
      }
      if (scaler_state) {
        undo.steps.push_back([scaler = *impl_->scaler, before = impl_->scaler->state_dict()] {
          scaler.load_state_dict(before);
        });
        naming_file(scaler_path, [&] { impl_->scaler->load_state_dict(scaler_state->values); });
      }
      for (size_t i = 0; i < custom.size(); ++i) {
        if (!custom_states[i].tensors.empty()) continue;
        undo.steps.push_back([object = custom[i], before = custom[i].state_dict()] { object.load_state_dict(before); });
        naming_file(custom_files.at(i), [&] { custom[i].load_state_dict(custom_states[i]); });
      }

      const auto load_models = [&] {
        for (size_t i = 0; i < models.size(); ++i) {
          if (sharded_models[i]) {
            model_engines[i]->load_local_state_dict(
                {sharded_models[i]->tensors.begin(), sharded_models[i]->tensors.end()});
          } else if (model_engines[i]) {
            SafetensorsFile file(model_files[i]);
            std::vector<std::pair<std::string, at::Tensor>> values;
            for (const auto& name : file.keys()) values.emplace_back(name, file.get_tensor(name));
            model_engines[i]->load_full_state_dict(values, /*strict=*/true);
          } else {
            load_checkpoint_in_model(*models[i].module(), model_files[i],
                                     LoadCheckpointOptions{.strict = true, .convert_dtypes = convert});
          }
        }
      };
      const auto load_optimizers = [&] {
        for (size_t i = 0; i < optimizers.size(); ++i) {
          if (optimizer_files[i]) {  // its errors name the file
            detail::load_optimizer_state_from_file(*optimizers[i].optimizer(), optimizer_states[i],
                                                   *optimizer_files[i], {.convert_dtypes = convert});
            continue;
          }
          naming_file(optimizer_paths[i], [&] {
            load_optimizer_state_dict(*optimizers[i].optimizer(), optimizer_states[i], {.convert_dtypes = convert});
          });
        }
      };
      // Note [Loading models and optimizers side by side]
      // The models' weights and the optimizers' states are copied at once, the models on a helper
      // thread: each copy alone leaves part of the memory bus idle while it starts its threads and
      // finishes its last pieces (W6's load_state: ~20% faster). Both finish before anything else
      // is applied; when both fail, the models' error is raised. Side by side only where the two
      // cannot meet: no sharded engine (its loads may run collectives, which must keep one order
      // on every process), and no model tensor on the meta device (loading materialises it,
      // changing the parameter the optimizer's load reads).
      const auto engine = [](const detail::FsdpEngine* e) { return e != nullptr; };
      const auto on_meta = [&] {
        for (const auto& model : models) {
          for (const auto& t : model.module()->parameters()) {
            if (t.is_meta()) return true;
          }
          for (const auto& t : model.module()->buffers()) {
            if (t.is_meta()) return true;
          }
        }
        return false;
      };
      if (models.empty() || optimizers.empty() || std::any_of(model_engines.begin(), model_engines.end(), engine) ||
          std::any_of(optimizer_engines.begin(), optimizer_engines.end(), engine) || on_meta()) {
        load_models();
        load_optimizers();
      } else {
        std::exception_ptr model_error;
        std::thread helper([&] {
          try {
            load_models();
          } catch (...) {
            model_error = std::current_exception();
          }
        });
        std::exception_ptr optimizer_error;
        try {
          load_optimizers();
        } catch (...) {
          optimizer_error = std::current_exception();
        }
        helper.join();
        if (model_error) std::rethrow_exception(model_error);
        if (optimizer_error) std::rethrow_exception(optimizer_error);
      }
    } catch (...) {
      undo.run();
      throw;
    }
    for (size_t i = 0; i < custom.size(); ++i) {
      if (custom_states[i].tensors.empty()) continue;
      naming_file(custom_files.at(i), [&] { custom[i].load_state_dict(custom_states[i]); });
    }
    if (random) {
      load_rng_state_dict(*random);
      std::lock_guard<std::mutex> lock(impl_->mutex);
      impl_->step = random->values.at("step").get<int64_t>();
    }
  });

  // The next automatically named checkpoint follows the one loaded (upstream keeps counting from
  // where this process started, and the next save collides with an existing folder).
  static const std::regex name(R"(checkpoint_(\d{1,9}))");
  std::smatch match;
  auto normal = fs::absolute(folder).lexically_normal();
  if (normal.filename().empty()) normal = normal.parent_path();  // "…/checkpoint_3/"
  const auto base = normal.filename().string();
  if (project.automatic_checkpoint_naming && std::regex_match(base, match, name)) {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->project.iteration = std::stoi(match[1]) + 1;
    impl_->iteration_chosen = true;
  }
}

}  // namespace accelerate
