// The objects of a checkpoint and their files; see state_objects.h.
#include "checkpoint/state_objects.h"

#include "distributed_impl.h"
#include "tensor_parallel/engine.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <mutex>
#include <regex>

namespace accelerate::detail::checkpoint {
namespace {

namespace fs = std::filesystem;

// The fully sharded engine that holds the parameters of `optimizer`, if any.
fsdp::FsdpEngine* sharding_engine(const std::vector<DistributedDataParallel>& models,
                                    const torch::optim::Optimizer& optimizer) {
  for (const auto& model : models) {
    auto* engine = fsdp_engine(model);
    if (!engine) continue;
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        if (engine->manages(p)) return engine;
      }
    }
  }
  return nullptr;
}

// The tensor-parallel engine that split parameters of `optimizer`, if any.
tensor_parallel::TensorParallelEngine* splitting_engine(const std::vector<DistributedDataParallel>& models,
                                                        const torch::optim::Optimizer& optimizer) {
  for (const auto& model : models) {
    auto* engine = tensor_parallel_engine(model);
    if (!engine) continue;
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        if (engine->is_sharded(p)) return engine;
      }
    }
  }
  return nullptr;
}

}  // namespace

CheckpointObjects checkpoint_objects(AcceleratorImpl& impl) {
  CheckpointObjects out;
  {
    std::lock_guard<std::mutex> lock(impl.mutex);
    out.models = impl.models;
    out.optimizers = impl.optimizers;
    out.schedulers = impl.schedulers;
    out.loaders = impl.data_loaders;
    out.custom = impl.custom_objects;
    out.step = impl.step;
    for (const auto& [id, hook] : impl.save_hooks) out.save_hooks.push_back(hook);
    for (const auto& [id, hook] : impl.load_hooks) out.load_hooks.push_back(hook);
  }
  for (const auto& model : out.models) out.model_engines.push_back(fsdp_engine(model));
  for (const auto& optimizer : out.optimizers) {
    out.optimizer_engines.push_back(sharding_engine(out.models, *optimizer.optimizer()));
    out.optimizer_splits.push_back(splitting_engine(out.models, *optimizer.optimizer()));
  }
  for (const auto& model : out.models) out.model_splits.push_back(tensor_parallel_engine(model));
  return out;
}

std::string numbered(const std::string& stem, size_t i, const std::string& ext) {
  return i == 0 ? stem + ext : stem + "_" + std::to_string(i) + ext;
}

DataLoaderState sampler_state(const DataLoader& loader) {
  auto state = loader.state_dict();
  if (!loader.use_stateful_dataloader()) state.batches_yielded = 0;
  return state;
}

bool sharded_state(fsdp::FsdpEngine* engine) {
  return engine->settings().state_dict_type != FsdpStateDictType::kFullStateDict;
}
bool local_state(fsdp::FsdpEngine* engine) {
  return engine->settings().state_dict_type == FsdpStateDictType::kLocalStateDict;
}

std::vector<at::Tensor> optimizer_params(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> params;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) params.push_back(p);
  }
  return params;
}

std::vector<std::string> optimizer_param_names(const CheckpointObjects& objects, size_t i) {
  std::map<const void*, std::string> by_impl;
  for (const auto& model : objects.models) {
    for (const auto& item : model.module()->named_parameters()) {
      by_impl.emplace(item.value().unsafeGetTensorImpl(), item.key());
    }
  }
  std::vector<std::string> names;
  for (const auto& param : optimizer_params(*objects.optimizers[i].optimizer())) {
    auto it = by_impl.find(param.unsafeGetTensorImpl());
    names.push_back(it == by_impl.end() ? std::string() : it->second);
  }
  return names;
}

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

std::map<size_t, fs::path> custom_checkpoint_files(const fs::path& folder) {
  static const std::regex name(R"(custom_checkpoint_(\d{1,9})\.(json|safetensors|pkl))");
  std::map<size_t, fs::path> files;
  for (const auto& entry : fs::directory_iterator(folder)) {
    std::smatch match;
    const auto file = entry.path().filename().string();
    if (std::regex_match(file, match, name)) files[std::stoul(match[1])] = entry.path();
  }
  return files;
}

ShardPlace shard_place(fsdp::FsdpEngine* engine, tensor_parallel::TensorParallelEngine* split) {
  ShardPlace place;
  if (engine) place.world = engine->shard_group().num_processes(), place.rank = engine->shard_group().process_index();
  if (split) place.tp_size = split->group().num_processes(), place.tp_rank = split->group().process_index();
  return place;
}

std::vector<int64_t> whole_tensor_shape(fsdp::FsdpEngine* engine, tensor_parallel::TensorParallelEngine* split,
                                        const at::Tensor& param) {
  auto shape = engine && engine->is_sharded(param) ? engine->whole_shape(param) : param.sizes().vec();
  if (split && split->is_sharded(param)) shape[split->split_dim(param)] *= split->group().num_processes();
  return shape;
}

}  // namespace accelerate::detail::checkpoint
