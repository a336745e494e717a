// What a `FullyShardedDataParallelPlugin` decides, resolved once: the user's fields, else the
// environment's `FSDP_*` variables (as upstream's `__post_init__` reads them), else the defaults.
// The `Accelerator` resolves its plugin when it is built and keeps the result; the engine only
// ever reads these settings.
#pragma once

#include "accelerate/utils/dataclasses.h"

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace accelerate::detail::fsdp {


/// The plugin with every field decided (from the user's struct, the environment, the defaults).
struct FsdpSettings {
  int fsdp_version = 1;
  FsdpShardingStrategy sharding_strategy = FsdpShardingStrategy::kFullShard;
  bool reshard_after_forward = true;
  FsdpBackwardPrefetch backward_prefetch = FsdpBackwardPrefetch::kNoPrefetch;
  c10::optional<at::ScalarType> param_dtype;
  c10::optional<at::ScalarType> reduce_dtype;
  c10::optional<at::ScalarType> buffer_dtype;
  FsdpAutoWrapPolicy auto_wrap_policy = FsdpAutoWrapPolicy::kNoWrap;
  FsdpWrapCallable auto_wrap_callable;
  std::vector<std::string> transformer_cls_names_to_wrap;
  int64_t min_num_params = 100000000;
  /// How many parameters a tensor counts for in the size-based policy: unset, its numel; under
  /// tensor parallelism the whole size of a split parameter (as upstream counts a DTensor's).
  std::function<int64_t(const at::Tensor&)> param_numel;
  bool cpu_offload = false;
  std::vector<std::string> ignored_modules;
  FsdpStateDictType state_dict_type = FsdpStateDictType::kFullStateDict;
  bool sync_module_states = true;
  std::function<void(torch::nn::Module&)> param_init_fn;
  bool cpu_ram_efficient_loading = false;
  bool activation_checkpointing = false;
  bool forward_prefetch = false;
  bool limit_all_gathers = true;
  bool use_orig_params = true;
  FsdpStateDictConfig state_dict_config;
  FsdpStateDictConfig optim_state_dict_config;
};

/// A mixed-precision policy's dtype by upstream's names ("bf16", "float32", …); none for an empty
/// one; refuses any other name, naming `field`.
c10::optional<at::ScalarType> policy_dtype(const char* field, const std::string& name);

/// The plugin's version, else FSDP_VERSION's, else 1.
int fsdp_version_of(const FullyShardedDataParallelPlugin& plugin);
/// The plugin's named auto-wrap policy, else FSDP_AUTO_WRAP_POLICY's, else none.
std::optional<FsdpAutoWrapPolicy> auto_wrap_policy_of(const FullyShardedDataParallelPlugin& plugin);
/// The plugin's classes to wrap, else FSDP_TRANSFORMER_CLS_TO_WRAP's (comma-separated).
std::vector<std::string> transformer_cls_names_of(const FullyShardedDataParallelPlugin& plugin);
/// The plugin's size-based threshold, else FSDP_MIN_NUM_PARAMS's, else 10^8.
int64_t min_num_params_of(const FullyShardedDataParallelPlugin& plugin);

/// The plugin's state-dict type, else FSDP_STATE_DICT_TYPE's, else FULL_STATE_DICT.
FsdpStateDictType state_dict_type_of(const FullyShardedDataParallelPlugin& plugin);

/// Upstream's state-dict config for `type`: offload_to_cpu, and rank0_only for FULL_STATE_DICT.
FsdpStateDictConfig default_state_dict_config(FsdpStateDictType type);

/// Resolves `plugin` against the environment (`FSDP_*`, as upstream's `__post_init__`) and the
/// defaults, and refuses what cannot apply, naming the field.
FsdpSettings resolve_fsdp_plugin(const FullyShardedDataParallelPlugin& plugin, c10::Device device);

}  // namespace accelerate::detail::fsdp
