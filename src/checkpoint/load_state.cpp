// Reading an Accelerator's checkpoints back: load_state, with one reader and one loader per kind
// of object; see include/accelerate/accelerator.h and docs/design.md ("Checkpoints").
#include "accelerate/accelerator.h"

#include "accelerator_impl.h"
#include "checkpoint/checkpointing.h"
#include "checkpoint/commit.h"
#include "checkpoint/dcp_state.h"
#include "checkpoint/layout.h"
#include "formats/checkpoint_index.h"
#include "detail/dtype_names.h"
#include "checkpoint/optimizer_state.h"
#include "checkpoint/python_layout.h"
#include "checkpoint/sharded_format.h"
#include "checkpoint/state_objects.h"
#include "detail/collective_watch.h"
#include "detail/warn.h"
#include "tensor_parallel/engine.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <thread>

namespace fs = std::filesystem;

namespace accelerate {

namespace {

// Runs `fn`, naming `file` in front of any error it raises that does not start with it (the kind
// is kept: a ValueError stays one, and so do the JSON library's type errors, which say only what
// the value should have been).
template <typename Fn>
auto naming_file(const fs::path& file, Fn&& fn) {
  const auto named = [&](const std::string& what) {
    return what.rfind(file.string(), 0) == 0 ? what : c10::str(file.string(), ": ", what);
  };
  try {
    return fn();
  } catch (const c10::ValueError& e) {
    C10_THROW_ERROR(ValueError, named(e.what_without_backtrace()));
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(Error, named(e.what_without_backtrace()));
  } catch (const nlohmann::json::exception& e) {
    C10_THROW_ERROR(ValueError, named(e.what()));
  } catch (const std::invalid_argument& e) {
    C10_THROW_ERROR(ValueError, named(e.what()));
  } catch (const std::exception& e) {
    C10_THROW_ERROR(Error, named(e.what()));
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


namespace python = detail::checkpoint::python_layout;

// Where the readers find a checkpoint's files, and the layout they are in.
struct Source {
  fs::path folder;
  const detail::checkpoint::Layout& layout;
  // The path of `name`, which the checkpoint must have.
  fs::path require(const std::string& name) const {
    const auto path = folder / name;
    TORCH_CHECK_VALUE(fs::is_regular_file(path), "the checkpoint has no ", name);
    return path;
  }
};

// Each kind of object is read (and checked) by its reader before anything changes, then applied
// by its loader (Note [Loading changes nothing or all]).

// ---- Models

struct ModelStates {
  std::vector<std::string> files;                 // the whole states' files ("" for sharded ones)
  std::vector<std::optional<StateDict>> sharded;  // sharded states, read already
  std::vector<std::optional<TensorMap>> whole;    // read already: Python's pickled or sharded files, split models
};

// A model's whole tensors read already (after tensor parallelism kept this process's pieces):
// their dtypes, names and, where the module holds them whole, shapes, as load_checkpoint_in_model
// checks a file's.
void check_whole_model(torch::nn::Module& module, const TensorMap& tensors, const std::string& file, bool shapes,
                       bool convert) {
  std::map<std::string, c10::ScalarType> stored;
  for (const auto& [name, tensor] : tensors) stored.emplace(name, tensor.scalar_type());
  check_model_dtypes(module, stored, file, convert);
  std::map<std::string, at::Tensor> targets;
  for (const auto& item : module.named_parameters()) targets.emplace(item.key(), item.value());
  for (const auto& item : module.named_buffers()) targets.emplace(item.key(), item.value());
  std::vector<std::string> missing, unexpected;
  for (const auto& [name, tensor] : tensors) {
    auto it = targets.find(name);
    if (it == targets.end()) {
      unexpected.push_back(name);
      continue;
    }
    TORCH_CHECK_VALUE(it->second.is_meta() || !shapes || it->second.sizes() == tensor.sizes(),
                      "[load_checkpoint_in_model] size mismatch for ", name, " in ", file,
                      ": the checkpoint has shape ", tensor.sizes(), ", the module has ", it->second.sizes());
  }
  for (const auto& [name, tensor] : targets) {
    if (!tensors.count(name)) missing.push_back(name);
  }
  TORCH_CHECK_VALUE(missing.empty() && unexpected.empty(), "[load_checkpoint_in_model] error(s) in loading ", file,
                    ": missing keys [", c10::Join(", ", missing), "], unexpected keys [", c10::Join(", ", unexpected),
                    "]");
}

// The whole state of model `i` in files its layout names (upstream's): its one safetensors file
// (read as the project's is), or the tensors of its pickled file or of its shards, read now.
void read_named_model(const detail::checkpoint::CheckpointObjects& objects, const std::vector<fs::path>& files, size_t i,
                      ModelStates& read, bool convert) {
  auto& module = *objects.models[i].module();
  auto* split = objects.model_splits[i];
  if (files.size() == 1 && files[0].extension() == ".safetensors" && !split) {
    read.files.push_back(files[0].string());
    SafetensorsFile file(read.files.back());
    std::map<std::string, c10::ScalarType> stored;
    for (const auto& name : file.keys()) stored.emplace(name, safetensors_dtype(file.entry(name).dtype));
    check_model_dtypes(module, stored, file.path(), convert);
    return;
  }
  TensorMap tensors;
  if (files.size() == 1 && files[0].extension() == ".safetensors") {  // whole, to be split
    tensors = SafetensorsFile(files[0].string()).read_tensors();
  } else if (files.size() == 1 && files[0].extension() == ".json") {  // a safetensors index
    for (const auto& shard : detail::checkpoint_index::read_checkpoint_index(files[0], "Accelerator::load_state").files) {
      for (auto& [name, tensor] : SafetensorsFile(shard.string()).read_tensors()) tensors.emplace(name, tensor);
    }
  } else {
    tensors = python::read_pickled_model(files);
  }
  if (split) naming_file(files[0], [&] { split->split_whole(tensors); });
  check_whole_model(module, tensors, files[0].string(), /*shapes=*/objects.model_engines[i] == nullptr, convert);
  read.files.emplace_back();
  read.whole[i] = std::move(tensors);
}

// The part of model `i`'s tensors this process holds, from upstream's torch.distributed.checkpoint
// folder (Note [DCP states]): the rows and pieces of the tensors its engines shard or split.
StateDict read_dcp_model(const detail::checkpoint::CheckpointObjects& objects, size_t i, const fs::path& folder) {
  auto* engine = objects.model_engines[i];
  auto* split = objects.model_splits[i];
  const auto place = detail::checkpoint::shard_place(engine, split);
  std::map<std::string, at::Tensor> params;
  for (const auto& item : objects.models[i].module()->named_parameters()) params.emplace(item.key(), item.value());
  const detail::checkpoint::DcpReader reader(folder);
  return detail::checkpoint::read_dcp_state(
      reader, "model", [&](const std::string& name, const std::vector<int64_t>& whole) -> std::optional<detail::checkpoint::ShardBox> {
        auto it = params.find(name);
        if (it == params.end()) return std::nullopt;  // named by the model's own checks
        const bool rows = engine && engine->is_sharded(it->second);
        const int64_t dim = split && split->is_sharded(it->second) ? split->split_dim(it->second) : -1;
        const auto expected = detail::checkpoint::whole_tensor_shape(engine, split, it->second);
        TORCH_CHECK_VALUE(whole == expected, "[load_checkpoint_in_model] size mismatch for ", name,
                          ": the checkpoint has shape ", c10::IntArrayRef(whole), ", the module has ",
                          c10::IntArrayRef(expected));
        if (!rows && dim < 0) return std::nullopt;
        return detail::checkpoint::shard_box(whole, rows, dim, place);
      });
}

// The part of optimizer `i`'s state this process holds, from upstream's torch.distributed.checkpoint
// folder (Note [DCP states]), in the project's layout.
StateDict read_dcp_optimizer(const detail::checkpoint::CheckpointObjects& objects, size_t i, const fs::path& folder) {
  auto* engine = objects.optimizer_engines[i];
  auto* split = objects.optimizer_splits[i];
  const auto& optimizer = *objects.optimizers[i].optimizer();
  const auto place = detail::checkpoint::shard_place(engine, split);
  const auto names = detail::checkpoint::optimizer_param_names(objects, i);
  const auto params = detail::checkpoint::optimizer_params(optimizer);
  std::map<std::string, at::Tensor> by_name;
  for (size_t k = 0; k < names.size(); ++k) by_name.emplace(names[k], params[k]);
  const detail::checkpoint::DcpReader reader(folder);
  auto py = detail::checkpoint::read_dcp_state(
      reader, "optimizer", [&](const std::string& name, const std::vector<int64_t>& whole) -> std::optional<detail::checkpoint::ShardBox> {
        // "state.<parameter's name>.<state's name>": the parameter's part of a state shaped like it.
        const auto dot = name.rfind('.');
        if (name.rfind("state.", 0) != 0 || dot == std::string::npos || dot < 6) return std::nullopt;
        auto it = by_name.find(name.substr(6, dot - 6));
        if (it == by_name.end() || whole != detail::checkpoint::whole_tensor_shape(engine, split, it->second)) {
          return std::nullopt;
        }
        const bool rows = engine && engine->is_sharded(it->second);
        const int64_t dim = split && split->is_sharded(it->second) ? split->split_dim(it->second) : -1;
        if (!rows && dim < 0) return std::nullopt;
        return detail::checkpoint::shard_box(whole, rows, dim, place);
      });
  if (!py.values.contains("state")) py.values["state"] = nlohmann::json::object();
  return detail::checkpoint::python_layout::optimizer_from_pytorch(std::move(py), optimizer, names, folder.string());
}

ModelStates read_models(const detail::checkpoint::CheckpointObjects& objects, const Source& from, bool convert) {
  ModelStates read;
  read.sharded.resize(objects.models.size());
  read.whole.resize(objects.models.size());
  for (size_t i = 0; i < objects.models.size(); ++i) {
    auto* engine = objects.model_engines[i];
    if (const auto files = from.layout.model_files(from.folder, i)) {
      read_named_model(objects, *files, i, read, convert);
      continue;
    }
    const auto sharded_folder = from.folder / ("pytorch_model_fsdp_" + std::to_string(i));
    auto* split = objects.model_splits[i];
    if (fs::is_directory(sharded_folder)) {
      // This process's part, whatever the mesh that saved it (Note [Sharded checkpoint layout]),
      // of the project's sharded format or of upstream's torch.distributed.checkpoint folders.
      auto state = detail::checkpoint::is_dcp_folder(sharded_folder)
                       ? naming_file(sharded_folder, [&] { return read_dcp_model(objects, i, sharded_folder); })
                       : naming_file(sharded_folder, [&] {
        return detail::checkpoint::load_sharded_state(
            detail::checkpoint::shard_place(engine, split), sharded_folder.string(), engine && detail::checkpoint::local_state(engine),
            [split](const std::string& name, const std::vector<int64_t>&) { return split ? split->split_dim_of(name) : -1; });
      });
      read.files.emplace_back();
      if (engine) {
        std::map<std::string, c10::ScalarType> stored;
        for (const auto& [name, tensor] : state.tensors) stored.emplace(name, tensor.scalar_type());
        check_model_dtypes(*objects.models[i].module(), stored, sharded_folder.string(), convert);
        read.sharded[i] = std::move(state);
      } else {  // whole tensors, or this process's pieces
        check_whole_model(*objects.models[i].module(), state.tensors, sharded_folder.string(), /*shapes=*/true,
                          convert);
        read.whole[i] = std::move(state.tensors);
      }
      continue;
    }
    if (split) {  // Note [Checkpoints of split layers]
      const auto path = from.require(detail::checkpoint::numbered("model", i, ".safetensors"));
      auto tensors = naming_file(path, [&] {
        auto whole = SafetensorsFile(path.string()).read_tensors();
        split->split_whole(whole);
        return whole;
      });
      check_whole_model(*objects.models[i].module(), tensors, path.string(), /*shapes=*/engine == nullptr, convert);
      read.files.emplace_back();
      read.whole[i] = std::move(tensors);
      continue;
    }
    std::map<std::string, c10::ScalarType> stored;
    read.files.push_back(from.require(detail::checkpoint::numbered("model", i, ".safetensors")).string());
    SafetensorsFile file(read.files.back());
    for (const auto& name : file.keys()) stored.emplace(name, safetensors_dtype(file.entry(name).dtype));
    check_model_dtypes(*objects.models[i].module(), stored, file.path(), convert);
  }
  return read;
}

// The models' own checks, before any of them changes: they load side by side with the
// optimizers, and one must not fail after another was loaded.
void check_models(const detail::checkpoint::CheckpointObjects& objects, const ModelStates& read, bool convert) {
  for (size_t i = 0; i < objects.models.size(); ++i) {
    if (!objects.model_engines[i] && !read.whole[i]) {
      modeling_detail::check_checkpoint_in_model(*objects.models[i].module(), read.files[i],
                                        {.strict = true, .convert_dtypes = convert});
    }
  }
}

void load_models(const detail::checkpoint::CheckpointObjects& objects, const ModelStates& read, bool convert) {
  for (size_t i = 0; i < objects.models.size(); ++i) {
    auto* engine = objects.model_engines[i];
    if (read.sharded[i]) {
      engine->load_local_state_dict({read.sharded[i]->tensors.begin(), read.sharded[i]->tensors.end()});
    } else if (read.whole[i] && engine) {
      engine->load_full_state_dict({read.whole[i]->begin(), read.whole[i]->end()}, /*strict=*/true);
    } else if (read.whole[i]) {
      load_state_dict_into_module(*objects.models[i].module(), *read.whole[i],
                                  {.strict = true, .convert_dtypes = convert});
    } else if (engine) {
      SafetensorsFile file(read.files[i]);
      std::vector<std::pair<std::string, at::Tensor>> values;
      for (const auto& name : file.keys()) values.emplace_back(name, file.get_tensor(name));
      engine->load_full_state_dict(values, /*strict=*/true);
    } else {
      load_checkpoint_in_model(*objects.models[i].module(), read.files[i],
                               LoadCheckpointOptions{.strict = true, .convert_dtypes = convert});
    }
  }
}

// ---- Optimizers

struct OptimizerStates {
  std::vector<StateDict> states;
  // Read into the optimizers once everything is checked (null: the state is in memory, for
  // optimizers over sharded parameters).
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::vector<fs::path> paths;
};

OptimizerStates read_optimizers(const detail::checkpoint::CheckpointObjects& objects, const Source& from) {
  OptimizerStates read;
  for (size_t i = 0; i < objects.optimizers.size(); ++i) {
    auto* engine = objects.optimizer_engines[i];
    auto* split = objects.optimizer_splits[i];
    const auto sharded_folder = from.folder / ("optimizer_" + std::to_string(i));
    if (detail::checkpoint::is_dcp_folder(sharded_folder)) {  // upstream's sharded optimizer state
      read.paths.push_back(sharded_folder);
      read.states.push_back(naming_file(sharded_folder, [&] { return read_dcp_optimizer(objects, i, sharded_folder); }));
      read.files.emplace_back();
      continue;
    }
    if (fs::is_directory(sharded_folder) && from.layout.reads_sharded_optimizer(/*has_engine=*/engine != nullptr)) {
      // This process's part, whatever the mesh that saved it (Note [Sharded checkpoint layout]):
      // rows of its piece of each state tensor shaped like its split parameter.
      const auto params = detail::checkpoint::optimizer_params(*objects.optimizers[i].optimizer());
      const auto split_dim = [&](const std::string& key, const std::vector<int64_t>& whole) -> int64_t {
        const size_t index = detail::checkpoint::state_param_index(key);
        if (!split || index >= params.size() || !split->is_sharded(params[index])) return -1;
        const auto& param = params[index];
        return detail::checkpoint::whole_tensor_shape(engine, split, param) == whole ? split->split_dim(param) : -1;
      };
      read.paths.push_back(sharded_folder);
      read.states.push_back(naming_file(sharded_folder, [&] {
        return detail::checkpoint::load_sharded_state(detail::checkpoint::shard_place(engine, split), sharded_folder.string(),
                                          engine && detail::checkpoint::local_state(engine), split_dim);
      }));
      read.files.emplace_back();
      continue;
    }
    std::unique_ptr<SafetensorsFile> file;
    read.paths.push_back(from.require(from.layout.optimizer_file(i)));
    read.states.push_back(
        from.layout.read_optimizer(read.paths.back().string(), *objects.optimizers[i].optimizer(),
                                   detail::checkpoint::optimizer_param_names(objects, i), file));
    if (engine || split) {
      // A whole state: this process's piece of each split parameter's tensors (Note [Checkpoints
      // of split layers]), then its rows of each sharded parameter's.
      naming_file(read.paths.back(), [&] {
        const auto params = detail::checkpoint::optimizer_params(*objects.optimizers[i].optimizer());
        for (auto& [key, tensor] : read.states.back().tensors) {
          const size_t index = detail::checkpoint::state_param_index(key);
          TORCH_CHECK_VALUE(index < params.size(), "the optimizer state names parameter ", index, " of ",
                            params.size());
          const auto& param = params[index];
          const bool rows = engine && engine->is_sharded(param);
          if (split && split->is_sharded(param) &&
              tensor.sizes().vec() == detail::checkpoint::whole_tensor_shape(engine, split, param)) {
            tensor = split->piece_of(param, tensor, "\"" + key + "\"").clone();
          }
          if (rows && tensor.sizes().vec() == engine->whole_shape(param)) {
            tensor = engine->local_rows(param, tensor).clone();
          }
        }
      });
      file.reset();
    }
    read.files.push_back(std::move(file));
  }
  return read;
}

void check_optimizers(const detail::checkpoint::CheckpointObjects& objects, const OptimizerStates& read, bool convert) {
  for (size_t i = 0; i < objects.optimizers.size(); ++i) {
    const auto check = [&] {
      detail::checkpoint::check_optimizer_state(*objects.optimizers[i].optimizer(), read.states[i], read.files[i].get(),
                                    {.convert_dtypes = convert});
    };
    if (read.files[i]) {
      check();
    } else {
      naming_file(read.paths[i], check);
    }
  }
}

void load_optimizers(const detail::checkpoint::CheckpointObjects& objects, OptimizerStates& read, bool convert) {
  for (size_t i = 0; i < objects.optimizers.size(); ++i) {
    if (read.files[i]) {  // its errors name the file
      detail::checkpoint::load_optimizer_state_from_file(*objects.optimizers[i].optimizer(), read.states[i], *read.files[i],
                                             {.convert_dtypes = convert});
      continue;
    }
    naming_file(read.paths[i], [&] {
      load_optimizer_state_dict(*objects.optimizers[i].optimizer(), read.states[i], {.convert_dtypes = convert});
    });
  }
}

// Note [Loading models and optimizers side by side]
// The models' weights and the optimizers' states are copied at once, the models on a helper
// thread: each copy alone leaves part of the memory bus idle while it starts its threads and
// finishes its last pieces (W6's load_state: ~20% faster). Both finish before anything else
// is applied; when both fail, the models' error is raised. Side by side only where the two
// cannot meet: no sharded engine (its loads may run collectives, which must keep one order
// on every process), and no model tensor on the meta device (loading materialises it,
// changing the parameter the optimizer's load reads).
void load_models_and_optimizers(const detail::checkpoint::CheckpointObjects& objects, const ModelStates& models,
                                OptimizerStates& optimizers, bool convert) {
  const auto engine = [](const detail::fsdp::FsdpEngine* e) { return e != nullptr; };
  const auto on_meta = [&] {
    for (const auto& model : objects.models) {
      for (const auto& t : model.module()->parameters()) {
        if (t.is_meta()) return true;
      }
      for (const auto& t : model.module()->buffers()) {
        if (t.is_meta()) return true;
      }
    }
    return false;
  };
  if (objects.models.empty() || objects.optimizers.empty() ||
      std::any_of(objects.model_engines.begin(), objects.model_engines.end(), engine) ||
      std::any_of(objects.optimizer_engines.begin(), objects.optimizer_engines.end(), engine) || on_meta()) {
    load_models(objects, models, convert);
    load_optimizers(objects, optimizers, convert);
    return;
  }
  std::exception_ptr model_error;
  std::thread helper([&] {
    try {
      load_models(objects, models, convert);
    } catch (...) {
      model_error = std::current_exception();
    }
  });
  std::exception_ptr optimizer_error;
  try {
    load_optimizers(objects, optimizers, convert);
  } catch (...) {
    optimizer_error = std::current_exception();
  }
  helper.join();
  if (model_error) std::rethrow_exception(model_error);
  if (optimizer_error) std::rethrow_exception(optimizer_error);
}

// ---- Schedulers, data loaders, the scaler: small states whose current one is kept for `Undo`

struct SmallStates {
  std::vector<fs::path> paths;
  std::vector<StateDict> states;
};

SmallStates read_schedulers(const detail::checkpoint::CheckpointObjects& objects, const Source& from) {
  SmallStates read;
  for (size_t i = 0; i < objects.schedulers.size(); ++i) {
    read.paths.push_back(from.require(from.layout.scheduler_file(i)));
    read.states.push_back(from.layout.read_scheduler(read.paths.back().string(), *objects.schedulers[i].scheduler()));
  }
  return read;
}

void load_schedulers(const detail::checkpoint::CheckpointObjects& objects, const SmallStates& read, Undo& undo) {
  for (size_t i = 0; i < objects.schedulers.size(); ++i) {
    auto scheduler = objects.schedulers[i].scheduler();
    undo.steps.push_back([scheduler, before = scheduler->state_dict()] { scheduler->load_state_dict(before); });
    naming_file(read.paths[i], [&] { scheduler->load_state_dict(read.states[i].values); });
  }
}

struct LoaderStates {
  std::vector<fs::path> paths;
  std::vector<DataLoaderState> positions;
};

LoaderStates read_data_loaders(const detail::checkpoint::CheckpointObjects& objects, const Source& from) {
  LoaderStates read;
  if (!from.layout.keeps_data_loaders()) return read;  // skipped, and named (Layout::warn_skipped)
  for (size_t i = 0; i < objects.loaders.size(); ++i) {
    read.paths.push_back(from.require(detail::checkpoint::loader_file(objects.loaders[i], i)));
    read.positions.push_back(naming_file(read.paths.back(), [&] {
      return DataLoaderState::from_json(load_state_dict_file(read.paths.back().string()).values.dump());
    }));
  }
  return read;
}

void load_data_loaders(const detail::checkpoint::CheckpointObjects& objects, const LoaderStates& read, Undo& undo) {
  for (size_t i = 0; i < read.positions.size(); ++i) {
    const auto& loader = objects.loaders[i];
    undo.steps.push_back([loader, before = loader.state_dict()] { loader.load_state_dict(before); });
    naming_file(read.paths[i], [&] { loader.load_state_dict(read.positions[i]); });
  }
}

std::optional<StateDict> read_scaler(const std::optional<GradScaler>& scaler, const Source& from) {
  if (!scaler) return std::nullopt;
  return from.layout.read_scaler(from.require(from.layout.scaler_file()).string());
}

void load_scaler(const GradScaler& scaler, const StateDict& state, const Source& from, Undo& undo) {
  undo.steps.push_back([scaler, before = scaler.state_dict()] { scaler.load_state_dict(before); });
  naming_file(from.folder / from.layout.scaler_file(),
              [&] { scaler.load_state_dict(state.values); });
}

// ---- Registered objects

struct CustomStates {
  std::map<size_t, fs::path> files;
  std::vector<StateDict> states;
};

CustomStates read_custom_objects(const detail::checkpoint::CheckpointObjects& objects, const Source& from, bool convert) {
  CustomStates read;
  read.files = detail::checkpoint::custom_checkpoint_files(from.folder);
  TORCH_CHECK_VALUE(read.files.size() == objects.custom.size(), "the number of custom checkpoints in ",
                    from.folder.string(), " does not match the number of registered objects: found ",
                    read.files.size(), " checkpoints, ", objects.custom.size(),
                    " registered objects; load checkpoints only into folders created with the same set of "
                    "registered objects");
  for (size_t i = 0; i < objects.custom.size(); ++i) {
    auto it = read.files.find(i);
    TORCH_CHECK_VALUE(it != read.files.end(), "the checkpoint has no custom_checkpoint_", i);
    read.states.push_back(it->second.extension() == ".pkl" ? python::read_custom(it->second.string())
                                                           : load_state_dict_file(it->second.string()));
    naming_file(it->second, [&] { check_state_like(read.states.back(), objects.custom[i].state_dict(), convert); });
  }
  return read;
}

// Registered objects without tensors first (their current state kept for `undo`), and those with
// tensors (which may be modules, too large to keep) once everything else is loaded.
void load_custom_objects(const detail::checkpoint::CheckpointObjects& objects, const CustomStates& read, bool with_tensors,
                         Undo* undo) {
  for (size_t i = 0; i < objects.custom.size(); ++i) {
    if (read.states[i].tensors.empty() == with_tensors) continue;
    const auto& object = objects.custom[i];
    if (undo) undo->steps.push_back([object, before = object.state_dict()] { object.load_state_dict(before); });
    naming_file(read.files.at(i), [&] { object.load_state_dict(read.states[i]); });
  }
}

// ---- Random generators and the step

std::optional<StateDict> read_random_states(const Source& from, int process_index, const PartialState& state) {
  const auto random_file = from.folder / from.layout.random_file(process_index);
  if (!fs::is_regular_file(random_file)) {
    detail::warn("accelerate.checkpointing",
                 c10::str("[Accelerator::load_state] ", random_file.string(),
                          " is missing (was the checkpoint saved with fewer processes?); the random generators "
                          "keep their states"),
                 {.every_process = true, .state = state});
    return std::nullopt;
  }
  auto random = from.layout.read_random(random_file, state);
  naming_file(random_file, [&] { checkpoint_detail::check_rng_state_dict(random); });
  return random;
}

}  // namespace

void Accelerator::load_state(const std::string& input_dir, const LoadStateOptions& options) const {
  detail::CallingApi calling("load_state");
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
    const auto checkpoints = detail::checkpoint::list_checkpoints(root, &incomplete);
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

  auto objects = detail::checkpoint::checkpoint_objects(*impl_);  // not const: the hooks may change the models
  const bool convert = options.convert_dtypes;
  detail::checkpoint::run_agreed(partial(), "[Accelerator::load_state] loading " + folder.string(), [&] {
    for (const auto& hook : objects.load_hooks) hook(objects.models, folder.string());
    // Everything is read and checked first, then applied (Note [Loading changes nothing or all]).
    const Source from{folder, detail::checkpoint::layout_to_load(options.layout, folder)};
    from.layout.warn_skipped(objects, folder, partial());
    const auto models = read_models(objects, from, convert);
    auto optimizers = read_optimizers(objects, from);
    const auto schedulers = read_schedulers(objects, from);
    const auto loaders = read_data_loaders(objects, from);
    const auto scaler = read_scaler(impl_->scaler, from);
    const auto custom = read_custom_objects(objects, from, convert);
    const auto random = read_random_states(from, process_index(), state().partial_state());
    check_models(objects, models, convert);
    check_optimizers(objects, optimizers, convert);

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
      load_schedulers(objects, schedulers, undo);
      load_data_loaders(objects, loaders, undo);
      if (scaler) load_scaler(*impl_->scaler, *scaler, from, undo);
      load_custom_objects(objects, custom, /*with_tensors=*/false, &undo);
      load_models_and_optimizers(objects, models, optimizers, convert);
    } catch (...) {
      undo.run();
      throw;
    }
    load_custom_objects(objects, custom, /*with_tensors=*/true, nullptr);
    if (random) {
      load_rng_state_dict(*random);
      std::lock_guard<std::mutex> lock(impl_->mutex);
      impl_->step = random->values.at("step").get<int64_t>();
    }
  });

  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->checkpoint_boundary = impl_->boundaries_passed;  // Note [Preemption]
    impl_->checkpoint_folder = folder.string();
  }
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
