// Resolving the FSDP plugin; see settings.h.
#include "fsdp/settings.h"

#include "accelerate/utils/environment.h"
#include "detail/topology.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace accelerate::detail::fsdp {

// A dtype of the mixed-precision policy by upstream's names, or none for an empty one.
c10::optional<at::ScalarType> policy_dtype(const char* field, const std::string& name) {
  if (name.empty()) return c10::nullopt;
  if (name == "fp32" || name == "float32" || name == "float") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "fp16" || name == "float16" || name == "half") return at::kHalf;
  if (name == "fp64" || name == "float64" || name == "double") return at::kDouble;
  TORCH_CHECK_VALUE(false, "[FullyShardedDataParallelPlugin] mixed_precision_policy.", field, " must be one of fp32, ",
                    "bf16, fp16 or fp64 (or empty for the parameters' own dtype), got \"", name, "\"");
  return c10::nullopt;
}

FsdpSettings resolve_fsdp_plugin(const FullyShardedDataParallelPlugin& plugin, c10::Device device) {
  const auto env = [](const char* name) { return get_env(name); };
  const auto flag = [&](const std::optional<bool>& given, const char* name, bool fallback) {
    if (given) return *given;
    auto value = env(name);
    return value ? str_to_bool(*value) : fallback;
  };
  FsdpSettings s;
  s.fsdp_version = fsdp_version_of(plugin);
  TORCH_CHECK_VALUE(s.fsdp_version == 1 || s.fsdp_version == 2,
                    "[FullyShardedDataParallelPlugin] fsdp_version must be 1 or 2, got ", s.fsdp_version);

  // What the user set wins over both variables of the environment.
  const bool user_chose = plugin.sharding_strategy || plugin.reshard_after_forward;
  std::optional<FsdpShardingStrategy> strategy = plugin.sharding_strategy;
  if (!user_chose) {
    if (auto v = env("FSDP_SHARDING_STRATEGY")) strategy = parse_fsdp_sharding_strategy(*v);
  }
  std::optional<bool> reshard = plugin.reshard_after_forward;
  if (!user_chose) {
    if (auto v = env("FSDP_RESHARD_AFTER_FORWARD")) {
      // Version 1 configurations write a sharding strategy here; version 2 a boolean.
      const std::string text = *v;
      bool is_bool = true;
      try {
        reshard = str_to_bool(text);
      } catch (const std::exception&) {
        is_bool = false;
      }
      if (!is_bool && !strategy) strategy = parse_fsdp_sharding_strategy(text);
    }
  }
  if (strategy && reshard) {
    const bool implied = *strategy == FsdpShardingStrategy::kFullShard || *strategy == FsdpShardingStrategy::kHybridShard;
    const bool conflicting = *strategy != FsdpShardingStrategy::kNoShard && implied != *reshard;
    TORCH_CHECK_VALUE(!conflicting, "[FullyShardedDataParallelPlugin] sharding_strategy ", to_string(*strategy),
                      " and reshard_after_forward=", *reshard ? "true" : "false",
                      " contradict each other; set one of them");
  }
  if (strategy) {
    s.sharding_strategy = *strategy;
  } else if (reshard) {
    s.sharding_strategy = *reshard ? FsdpShardingStrategy::kFullShard : FsdpShardingStrategy::kShardGradOp;
  }
  s.reshard_after_forward = s.sharding_strategy == FsdpShardingStrategy::kFullShard ||
                            s.sharding_strategy == FsdpShardingStrategy::kHybridShard;

  if (plugin.backward_prefetch) {
    s.backward_prefetch = *plugin.backward_prefetch;
  } else if (auto v = env("FSDP_BACKWARD_PREFETCH")) {
    s.backward_prefetch = parse_fsdp_backward_prefetch(*v);
  }
  s.forward_prefetch = flag(plugin.forward_prefetch, "FSDP_FORWARD_PREFETCH", false);
  // At most one gather is on its way ahead of its unit (Note [Prefetching]), within either setting.
  s.limit_all_gathers = flag(plugin.limit_all_gathers, "FSDP_LIMIT_ALL_GATHERS", true);
  TORCH_CHECK_VALUE(s.limit_all_gathers, "[FullyShardedDataParallelPlugin] limit_all_gathers=false (any number of "
                                         "gathers ahead of their units) is not supported: at most one gather runs "
                                         "ahead (Note [Prefetching]), which bounds memory at one extra unit");

  const auto& mp = plugin.mixed_precision_policy;
  s.param_dtype = policy_dtype("param_dtype", mp.param_dtype);
  s.reduce_dtype = policy_dtype("reduce_dtype", mp.reduce_dtype);
  s.buffer_dtype = policy_dtype("buffer_dtype", mp.buffer_dtype);

  s.auto_wrap_policy = auto_wrap_policy_of(plugin).value_or(FsdpAutoWrapPolicy::kNoWrap);
  TORCH_CHECK_VALUE(!(plugin.auto_wrap_policy && plugin.auto_wrap_callable),
                    "[FullyShardedDataParallelPlugin] give either auto_wrap_policy or auto_wrap_callable, not both");
  s.auto_wrap_callable = plugin.auto_wrap_callable;
  s.transformer_cls_names_to_wrap = transformer_cls_names_of(plugin);
  TORCH_CHECK_VALUE(s.auto_wrap_policy != FsdpAutoWrapPolicy::kTransformerBasedWrap ||
                        !s.transformer_cls_names_to_wrap.empty(),
                    "[FullyShardedDataParallelPlugin] TRANSFORMER_BASED_WRAP needs transformer_cls_names_to_wrap "
                    "(or FSDP_TRANSFORMER_CLS_TO_WRAP): the class names of the modules to wrap");
  s.min_num_params = min_num_params_of(plugin);
  TORCH_CHECK_VALUE(s.min_num_params > 0, "[FullyShardedDataParallelPlugin] min_num_params must be positive, got ",
                    s.min_num_params);

  s.cpu_offload = flag(plugin.cpu_offload, "FSDP_OFFLOAD_PARAMS", false);  // Note [Offloading to the CPU]
  s.ignored_modules = plugin.ignored_modules;
  s.state_dict_type = state_dict_type_of(plugin);
  s.sync_module_states = flag(plugin.sync_module_states, "FSDP_SYNC_MODULE_STATES", true);
  s.param_init_fn = plugin.param_init_fn;
  s.cpu_ram_efficient_loading = flag(plugin.cpu_ram_efficient_loading, "FSDP_CPU_RAM_EFFICIENT_LOADING", false);
  TORCH_CHECK_VALUE(!s.cpu_ram_efficient_loading || s.sync_module_states,
                    "[FullyShardedDataParallelPlugin] cpu_ram_efficient_loading needs sync_module_states: the "
                    "processes other than 0 get their weights from process 0");
  s.activation_checkpointing = flag(plugin.activation_checkpointing, "FSDP_ACTIVATION_CHECKPOINTING", false);
  s.use_orig_params = flag(plugin.use_orig_params, "FSDP_USE_ORIG_PARAMS", true);
  TORCH_CHECK_VALUE(s.use_orig_params, "[FullyShardedDataParallelPlugin] use_orig_params=false (one flat parameter "
                                       "per unit for the optimizer) is not supported: the optimizer always steps "
                                       "the module's own parameters, sharded");
  s.state_dict_config = plugin.state_dict_config.value_or(default_state_dict_config(s.state_dict_type));
  s.optim_state_dict_config = plugin.optim_state_dict_config.value_or(default_state_dict_config(s.state_dict_type));
  for (const auto& [field, config] : {std::pair{"state_dict_config", s.state_dict_config},
                                      std::pair{"optim_state_dict_config", s.optim_state_dict_config}}) {
    TORCH_CHECK_VALUE(!config.rank0_only || s.state_dict_type == FsdpStateDictType::kFullStateDict,
                      "[FullyShardedDataParallelPlugin] ", field, ".rank0_only applies to FULL_STATE_DICT only: ",
                      "with ", to_string(s.state_dict_type), " every process keeps its own shards");
  }
  return s;
}

int fsdp_version_of(const FullyShardedDataParallelPlugin& plugin) {
  if (plugin.fsdp_version) return *plugin.fsdp_version;
  if (auto v = get_env("FSDP_VERSION")) return parse_env_int("FSDP_VERSION", *v);
  return 1;
}

std::optional<FsdpAutoWrapPolicy> auto_wrap_policy_of(const FullyShardedDataParallelPlugin& plugin) {
  if (plugin.auto_wrap_policy) return plugin.auto_wrap_policy;
  if (auto v = get_env("FSDP_AUTO_WRAP_POLICY")) return parse_fsdp_auto_wrap_policy(*v);
  return std::nullopt;
}

std::vector<std::string> transformer_cls_names_of(const FullyShardedDataParallelPlugin& plugin) {
  std::vector<std::string> names = plugin.transformer_cls_names_to_wrap;
  if (!names.empty()) return names;
  if (auto v = get_env("FSDP_TRANSFORMER_CLS_TO_WRAP")) {
    std::stringstream in(*v);
    for (std::string item; std::getline(in, item, ',');) {
      item.erase(0, item.find_first_not_of(' '));
      item.erase(item.find_last_not_of(' ') + 1);
      if (!item.empty()) names.push_back(item);
    }
  }
  return names;
}

int64_t min_num_params_of(const FullyShardedDataParallelPlugin& plugin) {
  if (plugin.min_num_params) return *plugin.min_num_params;
  if (auto v = get_env("FSDP_MIN_NUM_PARAMS")) return parse_env_int("FSDP_MIN_NUM_PARAMS", *v);
  return 100000000;
}

FsdpStateDictType state_dict_type_of(const FullyShardedDataParallelPlugin& plugin) {
  if (plugin.state_dict_type) return *plugin.state_dict_type;
  if (auto v = get_env("FSDP_STATE_DICT_TYPE")) return parse_fsdp_state_dict_type(*v);
  return FsdpStateDictType::kFullStateDict;
}

FsdpStateDictConfig default_state_dict_config(FsdpStateDictType type) {
  return {.offload_to_cpu = true, .rank0_only = type == FsdpStateDictType::kFullStateDict};
}

}  // namespace accelerate::detail::fsdp

namespace accelerate {

void FullyShardedDataParallelPlugin::set_state_dict_type(std::optional<FsdpStateDictType> type) {
  state_dict_type = type ? *type : detail::fsdp::state_dict_type_of(*this);
  if (!state_dict_config) state_dict_config = detail::fsdp::default_state_dict_config(*state_dict_type);
  if (!optim_state_dict_config) optim_state_dict_config = detail::fsdp::default_state_dict_config(*state_dict_type);
}

void FullyShardedDataParallelPlugin::set_mixed_precision(const std::string& mixed_precision, bool buffer_autocast,
                                                         bool override) {
  TORCH_CHECK_VALUE(mixed_precision != "fp8", "[FullyShardedDataParallelPlugin::set_mixed_precision] fp8 is not ",
                    "available (Transformer Engine, MS-AMP and torchao are Python); use bf16");
  TORCH_CHECK_VALUE(mixed_precision == "fp16" || mixed_precision == "bf16" || mixed_precision == "fp32",
                    "[FullyShardedDataParallelPlugin::set_mixed_precision] invalid mixed precision \"", mixed_precision,
                    "\"; must be one of fp16, bf16, fp32");
  auto& mp = mixed_precision_policy;
  const bool unset = mp.param_dtype.empty() && mp.reduce_dtype.empty() && mp.buffer_dtype.empty();
  if (!override && !unset) return;
  const int version = detail::fsdp::fsdp_version_of(*this);
  mp.param_dtype = mixed_precision;
  mp.reduce_dtype = mixed_precision;
  // Version 2's policy has no buffer dtype (upstream sets its output dtype instead).
  mp.buffer_dtype = version == 2 ? std::string() : buffer_autocast ? std::string("fp32") : mixed_precision;
}

void FullyShardedDataParallelPlugin::validate_mixed_precision_policy() const {
  (void)detail::fsdp::policy_dtype("param_dtype", mixed_precision_policy.param_dtype);
  (void)detail::fsdp::policy_dtype("reduce_dtype", mixed_precision_policy.reduce_dtype);
  (void)detail::fsdp::policy_dtype("buffer_dtype", mixed_precision_policy.buffer_dtype);
}

}  // namespace accelerate
