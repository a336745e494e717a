// Writing an Accelerator's checkpoints: save/save_model/save_state, with one writer per kind of
// object; see include/accelerate/accelerator.h and docs/design.md ("Checkpoints"). The commit
// protocol is in commit.cpp, the sharded format in sharded_format.cpp.
#include "accelerate/accelerator.h"

#include "accelerator_impl.h"
#include "checkpoint/commit.h"
#include "checkpoint/dcp_state.h"
#include "checkpoint/layout.h"
#include "checkpoint/python_layout.h"
#include "checkpoint/sharded_format.h"
#include "checkpoint/state_objects.h"
#include "checkpoint/torch_save.h"
#include "detail/collective_watch.h"
#include "detail/collectives.h"
#include "detail/files.h"
#include "detail/warn.h"
#include "distributed_impl.h"
#include "tensor_parallel/engine.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <filesystem>
#include <limits>
#include <set>

namespace fs = std::filesystem;

namespace accelerate {

bool Accelerator::writes_shared_files() const {
  return project_configuration().save_on_each_node ? is_local_main_process() : is_main_process();
}

// Upstream's Accelerator.save is accelerate.utils.save with the project's save_on_each_node.
void Accelerator::save(const StateDictMap& tensors, const std::string& path, bool safe_serialization) const {
  utils::save(tensors, path,
              {.save_on_each_node = project_configuration().save_on_each_node, .safe_serialization = safe_serialization});
}

void Accelerator::save(const TensorMap& tensors, const std::string& path, bool safe_serialization) const {
  utils::save(tensors, path,
              {.save_on_each_node = project_configuration().save_on_each_node, .safe_serialization = safe_serialization});
}

void Accelerator::save(const nlohmann::json& values, const std::string& path, bool safe_serialization) const {
  utils::save(values, path,
              {.save_on_each_node = project_configuration().save_on_each_node, .safe_serialization = safe_serialization});
}

StateDictMap Accelerator::model_state_dict(const std::shared_ptr<torch::nn::Module>& module, bool for_saving) const {
  detail::CallingApi calling("get_state_dict");
  std::optional<DistributedDataParallel> prepared;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    for (const auto& model : impl_->models) {
      if (model.module() == module && (model.is_fully_sharded() || model.is_tensor_parallel())) prepared = model;
    }
  }
  if (!prepared) return accelerate::get_state_dict(*module);
  std::vector<std::pair<std::string, at::Tensor>> values;
  bool drop = false;
  if (prepared->is_fully_sharded()) {
    auto* engine = detail::fsdp_engine(*prepared);
    // save_model follows the plugin's state_dict_config (Note [rank0_only]); get_state_dict
    // gives every process the whole tensors.
    const auto config = for_saving ? engine->settings().state_dict_config : FsdpStateDictConfig{};
    drop = config.rank0_only && !writes_shared_files();
    values = engine->full_state_dict(/*keep=*/!drop || prepared->is_tensor_parallel(), config.offload_to_cpu);
  } else {
    for (const auto& item : accelerate::get_state_dict(*module)) values.emplace_back(item.key(), item.value());
  }
  // Under tensor parallelism, the split layers' pieces joined (a collective of the tp group).
  if (auto* split = detail::tensor_parallel_engine(*prepared)) split->gather_whole(values);
  if (drop) values.clear();
  StateDictMap out;
  for (auto& [name, tensor] : values) out.insert(name, tensor);
  return out;
}

void Accelerator::save_module(const std::shared_ptr<torch::nn::Module>& module, const std::string& save_directory,
                              const std::string& max_shard_size) const {
  detail::CallingApi calling("save_model");
  TORCH_CHECK_VALUE(!fs::is_regular_file(save_directory), "[Accelerator::save_model] provided path (", save_directory,
                    ") should be a directory, not a file");
  auto weights = model_state_dict(module, /*for_saving=*/true);
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
    for (const auto& [number, path] : detail::checkpoint::list_checkpoints(root, &incomplete)) highest = std::max(highest, number);
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

namespace {

// Where the writers put a checkpoint's files, and how they report each one written.
struct Destination {
  fs::path folder;
  PartialState state;
  std::string operator/(const std::string& name) const { return (folder / name).string(); }
  void written() const { detail::checkpoint::checkpoint_file_written(state); }
};

// Note [Checkpoints of split layers]
// Under tensor parallelism each process holds a piece of every split parameter, and of its
// optimizer state. save_state gathers the pieces over the tp group (after the FSDP engine has
// gathered its rows, under FULL_STATE_DICT) and writes whole tensors, in the files and layout of
// a job without tensor parallelism: the checkpoint does not depend on the mesh that saved it.
// load_state reads the whole tensors on every process and keeps each process's piece (then the
// FSDP engine its rows), so it resumes on any mesh whose tp_size divides the split dimensions,
// and on one process without a plan. Sharded FSDP states (SHARDED_STATE_DICT, LOCAL_STATE_DICT)
// are not gathered: each process writes the rows of its pieces, and the sharded format's index
// places them in the whole tensors (Note [Sharded checkpoint layout]), from which any mesh takes
// its own parts at load.

// Each model's state dict, as its checkpoint holds it: a sharded model's own shards (sharded
// states), or its whole tensors gathered from every process (a collective).
// Note [rank0_only]
// Under FULL_STATE_DICT every process takes part in each gather of a whole tensor (a collective),
// but with the plugin's state_dict_config.rank0_only (upstream's default) only the `writer`
// processes, which write the shared files, keep what was gathered: the others drop each tensor
// once its gather is done, so their peak memory grows by one tensor, not by the whole model.
// The optimizer's whole state follows optim_state_dict_config the same way. A model split by
// tensor parallelism keeps its tensors until its pieces are joined, a collective of its tp group.
std::vector<StateDictMap> model_states(const detail::checkpoint::CheckpointObjects& objects, bool writer) {
  std::vector<StateDictMap> weights;
  for (size_t i = 0; i < objects.models.size(); ++i) {
    auto* engine = objects.model_engines[i];
    auto* split = objects.model_splits[i];
    if (!engine && !split) {
      weights.push_back(accelerate::get_state_dict(*objects.models[i].module()));
      continue;
    }
    std::vector<std::pair<std::string, at::Tensor>> values;
    bool drop = false;
    if (engine && detail::checkpoint::sharded_state(engine)) {
      values = engine->local_state_dict();
      if (engine->settings().state_dict_config.offload_to_cpu) {
        for (auto& [name, tensor] : values) tensor = tensor.to(at::kCPU);
      }
    } else if (engine) {
      const auto& config = engine->settings().state_dict_config;
      // A split model's pieces are joined below by every process of its tp group first.
      drop = config.rank0_only && !writer;
      values = engine->full_state_dict(/*keep=*/!drop || split, config.offload_to_cpu);
    } else {
      for (const auto& item : accelerate::get_state_dict(*objects.models[i].module())) {
        values.emplace_back(item.key(), item.value());
      }
    }
    if (split && !(engine && detail::checkpoint::sharded_state(engine))) split->gather_whole(values);  // Note [Checkpoints of split layers]
    if (drop) values.clear();
    StateDictMap state;
    for (auto& [name, tensor] : values) state.insert(name, tensor);
    weights.push_back(std::move(state));
  }
  return weights;
}

// Where a process's part of a tensor of a sharded state lies in a torch.distributed.checkpoint
// folder (Note [DCP states]): `tensor` is its part of the tensor of shape `whole` that `param`
// (null: none) is, rows of its piece where its engines shard or split `param`. Whole tensors are
// written by the first process only; false when this process writes nothing of it.
bool add_dcp_part(detail::checkpoint::DcpShare& share, const std::string& key, std::vector<detail::dcp::PathStep> path,
                  const at::Tensor& tensor, const std::vector<int64_t>& whole, bool rows, int64_t dim,
                  const detail::checkpoint::ShardPlace& place) {
  const bool first = place.rank == 0 && place.tp_rank == 0;
  if (!rows && dim < 0 && !first) return false;
  auto box = detail::checkpoint::shard_box(whole, rows, dim, place);
  if (whole.empty()) box.offset.clear();  // a scalar's chunk has no dimensions
  TORCH_CHECK(whole.empty() || tensor.sizes().vec() == box.length, "[Accelerator::save_state] ", key, " holds ",
              tensor.sizes(), " here where its part of ", c10::IntArrayRef(whole), " is ", c10::IntArrayRef(box.length));
  share.tensors[key] = {tensor.detach(), whole, box.offset, std::move(path)};
  return true;
}

// A fully sharded model's SHARDED_STATE_DICT as upstream's FSDP writes it: a DCP folder of
// {"model": state_dict} (Note [DCP states]). Every process takes part (the metadata is gathered).
void write_dcp_model(const detail::checkpoint::CheckpointObjects& objects, size_t i, const StateDictMap& weights,
                     const Destination& to) {
  auto* engine = objects.model_engines[i];
  auto* split = objects.model_splits[i];
  const auto place = detail::checkpoint::shard_place(engine, split);
  std::map<std::string, at::Tensor> params;
  for (const auto& item : objects.models[i].module()->named_parameters()) params.emplace(item.key(), item.value());
  detail::checkpoint::DcpShare share;
  if (engine->replica_index() == 0) {  // hybrid sharding: the first replica writes the shards
    for (const auto& item : weights) {
      auto it = params.find(item.key());
      const bool is_param = it != params.end();
      const auto whole = is_param ? detail::checkpoint::whole_tensor_shape(engine, split, it->second) : item.value().sizes().vec();
      const bool rows = is_param && engine->is_sharded(it->second);
      const int64_t dim = is_param && split && split->is_sharded(it->second) ? split->split_dim(it->second) : -1;
      add_dcp_part(share, "model." + item.key(), {std::string("model"), item.key()}, item.value(), whole, rows, dim,
                   place);
    }
  }
  detail::checkpoint::write_dcp_folder(to.folder / ("pytorch_model_fsdp_" + std::to_string(i)), share, to.state);
  to.written();
}

// An optimizer's SHARDED_STATE_DICT as upstream's FSDP writes it: a DCP folder of {"optimizer":
// optim_state_dict}, its parameters named as in their model, the param groups with PyTorch's
// options, the steps as float tensors (Note [DCP states]). Every process takes part.
void write_dcp_optimizer(const detail::checkpoint::CheckpointObjects& objects, size_t i, const StateDict& state,
                         const Destination& to) {
  auto* engine = objects.optimizer_engines[i];
  auto* split = objects.optimizer_splits[i];
  const auto place = detail::checkpoint::shard_place(engine, split);
  const auto params = detail::checkpoint::optimizer_params(*objects.optimizers[i].optimizer());
  const auto names = detail::checkpoint::optimizer_param_names(objects, i);
  const auto name_of = [&](size_t index) {
    TORCH_CHECK_VALUE(index < names.size() && !names[index].empty(), "[Accelerator::save_state] parameter ", index,
                      " of optimizer ", i, " is in no prepared model, so it has no name for upstream's FSDP folders");
    return names[index];
  };
  using Path = std::vector<detail::dcp::PathStep>;
  detail::checkpoint::DcpShare share;
  const bool first = place.rank == 0 && place.tp_rank == 0;
  if (engine->replica_index() == 0) {
    for (const auto& [key, tensor] : state.tensors) {
      const auto index = detail::checkpoint::state_param_index(key);
      const auto& param = params.at(index);
      const auto name = key.substr(key.rfind('.') + 1);
      const bool like_param = tensor.sizes() == param.sizes();
      const bool rows = like_param && engine->is_sharded(param);
      const int64_t dim = like_param && split && split->is_sharded(param) ? split->split_dim(param) : -1;
      const auto whole = like_param ? detail::checkpoint::whole_tensor_shape(engine, split, param) : tensor.sizes().vec();
      add_dcp_part(share, "optimizer.state." + name_of(index) + "." + name,
                   Path{std::string("optimizer"), std::string("state"), name_of(index), name}, tensor, whole, rows, dim,
                   place);
    }
    if (first) {
      for (const auto& [index, scalars] : state.values.at("state").items()) {
        const auto param = name_of(static_cast<size_t>(std::stoull(index)));
        for (const auto& [name, value] : scalars.items()) {
          const auto key = "optimizer.state." + param + "." + name;
          const Path path{std::string("optimizer"), std::string("state"), param, name};
          if (name == "step") {  // PyTorch keeps it as a float tensor
            share.tensors[key] = {at::scalar_tensor(value.get<double>(), at::kFloat), {}, {}, path};
          } else {
            share.values[key] = {value, path};
          }
        }
      }
      const auto kind = state.values.at("optimizer").get<std::string>();
      TORCH_CHECK_VALUE(kind != "LBFGS", "[Accelerator::save_state] LBFGS's state is not written in Python's layout: ",
                        detail::checkpoint::python_layout::kLbfgsReason);
      int64_t g = 0;
      for (auto group : state.values.at("param_groups")) {
        detail::checkpoint::python_layout::add_pytorch_group_options(kind, group);
        for (auto& [option, value] : group.items()) {
          auto v = value;
          if (option == "params") {
            v = nlohmann::json::array();
            for (const auto& p : value) v.push_back(name_of(p.get<size_t>()));
          }
          share.values["optimizer.param_groups." + std::to_string(g) + "." + option] = {
              v, Path{std::string("optimizer"), std::string("param_groups"), g, option}};
        }
        ++g;
      }
    }
  }
  detail::checkpoint::write_dcp_folder(to.folder / ("optimizer_" + std::to_string(i)), share, to.state);
  to.written();
}

// The models with sharded states: every process writes its own part, in
// `pytorch_model_fsdp_<i>` (Note [Sharded checkpoint layout]), or with upstream's layout a
// torch.distributed.checkpoint folder of that name.
void write_sharded_models(const detail::checkpoint::CheckpointObjects& objects, const std::vector<StateDictMap>& weights,
                          const Destination& to, const detail::checkpoint::Layout& layout) {
  for (size_t i = 0; i < weights.size() && i < objects.models.size(); ++i) {
    auto* engine = objects.model_engines[i];
    if (!engine || !detail::checkpoint::sharded_state(engine)) continue;
    if (layout.writes_dcp()) {
      write_dcp_model(objects, i, weights[i], to);
      continue;
    }
    auto* split = objects.model_splits[i];
    std::map<std::string, at::Tensor> tensors;
    std::map<std::string, std::vector<int64_t>> whole;
    std::map<std::string, std::pair<int64_t, std::vector<int64_t>>> pieces;
    std::map<std::string, at::Tensor> params;
    for (const auto& item : objects.models[i].module()->named_parameters()) params.emplace(item.key(), item.value());
    for (const auto& item : weights[i]) {
      tensors.emplace(item.key(), item.value());
      auto it = params.find(item.key());
      if (it == params.end()) continue;
      const auto shape = detail::checkpoint::whole_tensor_shape(engine, split, it->second);
      if (split && split->is_sharded(it->second)) pieces[item.key()] = {split->split_dim(it->second), shape};
      if (engine->is_sharded(it->second)) whole[item.key()] = shape;
    }
    if (engine->replica_index() != 0) continue;  // hybrid sharding: the first replica writes the shards
    detail::checkpoint::save_sharded_state(detail::checkpoint::shard_place(engine, split), to / ("pytorch_model_fsdp_" + std::to_string(i)),
                               {{"model", i}}, tensors, whole, pieces);
    to.written();
  }
}

// The optimizers over sharded or split parameters: sharded states are written here by every
// process (`optimizer_<i>`); whole ones are gathered (a collective, in the same order everywhere)
// and returned for the shared files. Nothing for the other optimizers.
std::vector<std::optional<StateDict>> sharded_optimizer_states(const detail::checkpoint::CheckpointObjects& objects,
                                                               const Destination& to, bool writer,
                                                               const detail::checkpoint::Layout& layout) {
  std::vector<std::optional<StateDict>> states(objects.optimizers.size());
  for (size_t i = 0; i < objects.optimizers.size(); ++i) {
    auto* engine = objects.optimizer_engines[i];
    auto* split = objects.optimizer_splits[i];
    if (!engine && !split) continue;
    StateDict state = optimizer_state_dict(*objects.optimizers[i].optimizer());
    const auto params = detail::checkpoint::optimizer_params(*objects.optimizers[i].optimizer());
    const bool sharded = engine && detail::checkpoint::sharded_state(engine);
    std::map<std::string, std::vector<int64_t>> whole;
    std::map<std::string, std::pair<int64_t, std::vector<int64_t>>> pieces;
    for (auto& [key, tensor] : state.tensors) {
      const auto& param = params.at(detail::checkpoint::state_param_index(key));
      const bool rows = engine && engine->is_sharded(param);
      const bool like_param = tensor.sizes() == param.sizes();
      const bool piece = split && split->is_sharded(param) && like_param;
      if (sharded) {  // this process's part, placed in the whole tensor by the index
        if (!like_param) continue;
        const auto shape = detail::checkpoint::whole_tensor_shape(engine, split, param);
        if (piece) pieces[key] = {split->split_dim(param), shape};
        if (rows) whole[key] = shape;
        if (engine && engine->settings().optim_state_dict_config.offload_to_cpu) tensor = tensor.to(at::kCPU);
        continue;
      }
      if (rows && like_param) tensor = engine->whole_rows(param, tensor);
      // This process's piece of a split parameter's state, joined (Note [Checkpoints of split layers]).
      if (piece) tensor = split->whole_of(param, tensor);
      if (!engine) continue;
      const auto& config = engine->settings().optim_state_dict_config;
      if (config.rank0_only && !writer) {
        tensor = at::Tensor();  // gathered for the writers; not kept here (Note [rank0_only])
      } else if (config.offload_to_cpu) {
        tensor = tensor.to(at::kCPU);
      }
    }
    if (!engine) {
      states[i] = std::move(state);
      continue;
    }
    if (detail::checkpoint::sharded_state(engine) && layout.writes_dcp()) {
      write_dcp_optimizer(objects, i, state, to);
    } else if (detail::checkpoint::sharded_state(engine)) {
      if (engine->replica_index() != 0) continue;
      detail::checkpoint::save_sharded_state(detail::checkpoint::shard_place(engine, split), to / ("optimizer_" + std::to_string(i)),
                                 state.values, state.tensors, whole, pieces);
      to.written();
    } else {
      states[i] = std::move(state);
    }
  }
  return states;
}

// The shared files, written by one process (per machine with save_on_each_node).

void write_models(const detail::checkpoint::CheckpointObjects& objects, const std::vector<StateDictMap>& weights,
                  const Destination& to, const detail::checkpoint::Layout& layout) {
  for (size_t i = 0; i < weights.size(); ++i) {
    if (i < objects.models.size() && objects.model_engines[i] && detail::checkpoint::sharded_state(objects.model_engines[i])) {
      continue;
    }
    if (i < objects.models.size() && objects.model_engines[i] && layout.fsdp_model_file(i)) {
      // Upstream's FSDP keeps a FULL_STATE_DICT in a file of its own.
      std::vector<std::pair<std::string, at::Tensor>> tensors;
      for (const auto& item : weights[i]) tensors.emplace_back(item.key(), item.value());
      layout.write_fsdp_model(tensors, to / *layout.fsdp_model_file(i));
      to.written();
      continue;
    }
    TensorMap tensors;
    for (const auto& item : clean_state_dict_for_safetensors(weights[i])) tensors.emplace(item.key(), item.value());
    save_file(tensors, to / detail::checkpoint::numbered("model", i, ".safetensors"), {{"format", "pt"}});
    to.written();
  }
}

void write_optimizers(const detail::checkpoint::CheckpointObjects& objects, const std::vector<std::optional<StateDict>>& states,
                      const Destination& to, const detail::checkpoint::Layout& layout) {
  for (size_t i = 0; i < objects.optimizers.size(); ++i) {
    if ((objects.optimizer_engines[i] || objects.optimizer_splits[i]) && !states[i]) continue;  // sharded, written already
    const auto state = states[i] ? *states[i] : optimizer_state_dict(*objects.optimizers[i].optimizer());
    // Upstream's FSDP files name the parameters of an optimizer over sharded ones.
    const auto names = objects.optimizer_engines[i] ? detail::checkpoint::optimizer_param_names(objects, i)
                                                    : std::vector<std::string>{};
    layout.write_optimizer(state, to / layout.optimizer_file(i), names);
    to.written();
  }
}

void write_schedulers(const detail::checkpoint::CheckpointObjects& objects, const Destination& to,
                      const detail::checkpoint::Layout& layout) {
  for (size_t i = 0; i < objects.schedulers.size(); ++i) {
    layout.write_scheduler(*objects.schedulers[i].scheduler(), to / layout.scheduler_file(i));
    to.written();
  }
}

void write_data_loaders(const detail::checkpoint::CheckpointObjects& objects, const Destination& to) {
  for (size_t i = 0; i < objects.loaders.size(); ++i) {
    save_state_dict_file({nlohmann::json::parse(detail::checkpoint::sampler_state(objects.loaders[i]).to_json()), {}},
                         to / detail::checkpoint::loader_file(objects.loaders[i], i));
    to.written();
  }
}

void write_scaler(const std::optional<GradScaler>& scaler, const Destination& to,
                  const detail::checkpoint::Layout& layout) {
  if (!scaler) return;
  layout.write_scaler(scaler->state_dict(), to / layout.scaler_file());
  to.written();
}

void write_custom_objects(const detail::checkpoint::CheckpointObjects& objects, const Destination& to,
                          const detail::checkpoint::Layout& layout) {
  for (size_t i = 0; i < objects.custom.size(); ++i) {
    const auto state = objects.custom[i].state_dict();
    layout.write_custom(state, to / layout.custom_file(i, state));
    to.written();
  }
}

// Every process's random generators and the step: its last file, whose presence marks the
// checkpoint complete.
void write_random_states(int64_t step, int process_index, const Destination& to,
                         const detail::checkpoint::Layout& layout) {
  layout.write_random(rng_state_dict(), step, to / layout.random_file(process_index));
  to.written();
}

}  // namespace

std::string Accelerator::save_state(const std::string& output_dir, const SaveStateOptions& options) const {
  detail::CallingApi calling("save_state");
  auto project = project_configuration();
  const auto& layout = detail::checkpoint::layout_to_save(options.layout.value_or(project.checkpoint_layout));
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
  detail::checkpoint::run_agreed(partial(), "[Accelerator::save_state]", [&] {
    TORCH_CHECK_VALUE(!project.automatic_checkpoint_naming || !is_main_process() || !fs::exists(target),
                      "checkpoint directory ", target.string(), " (", project.iteration,
                      ") already exists; call set_save_iteration with the iteration to start with");
  });

  auto objects = detail::checkpoint::checkpoint_objects(*impl_);  // not const: the hooks may change the models
  layout.check_savable(objects);
  detail::checkpoint::CheckpointCommit commit(partial(), target, project.save_on_each_node, project.automatic_checkpoint_naming);
  const Destination to{commit.staging(), partial()};
  const auto path = commit.commit([&] {
    auto weights = model_states(objects, commit.writes_shared_files());
    for (const auto& hook : objects.save_hooks) hook(objects.models, weights, to.folder.string());
    write_sharded_models(objects, weights, to, layout);
    const auto optimizer_states = sharded_optimizer_states(objects, to, commit.writes_shared_files(), layout);
    if (commit.writes_shared_files()) {
      write_models(objects, weights, to, layout);
      write_optimizers(objects, optimizer_states, to, layout);
      write_schedulers(objects, to, layout);
      if (layout.keeps_data_loaders()) write_data_loaders(objects, to);
      write_scaler(impl_->scaler, to, layout);
      write_custom_objects(objects, to, layout);
    }
    write_random_states(objects.step, process_index(), to, layout);
  });

  std::set<int64_t> written_here;
  if (project.automatic_checkpoint_naming) {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->checkpoints_written.insert(project.iteration);
    written_here = impl_->checkpoints_written;
  }
  detail::checkpoint::run_agreed(partial(), "[Accelerator::save_state] removing old checkpoints", [&] {
    if (project.automatic_checkpoint_naming && project.total_limit > 0 && commit.writes_shared_files()) {
      detail::checkpoint::prune_checkpoints(target.parent_path(), project.total_limit, written_here, project.iteration);
    }
  });
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (project.automatic_checkpoint_naming) impl_->project.iteration = project.iteration + 1;
    impl_->checkpoint_boundary = impl_->boundaries_passed;  // Note [Preemption]
    impl_->checkpoint_folder = path.string();
  }
  return path.string();
}

}  // namespace accelerate
