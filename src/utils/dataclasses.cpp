// Enum spellings and small parsers for the option structs of utils/dataclasses.h.
#include "accelerate/utils/dataclasses.h"

#include "detail/check.h"
#include "detail/text.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <utility>
#include <vector>

namespace accelerate {
namespace {

// An enum's members with upstream's spellings, in upstream's order.
template <typename E, size_t N>
using Spellings = std::array<std::pair<E, const char*>, N>;

constexpr Spellings<RNGType, 11> kRngTypes{{{RNGType::kTorch, "torch"},
                                             {RNGType::kCuda, "cuda"},
                                             {RNGType::kMlu, "mlu"},
                                             {RNGType::kSdaa, "sdaa"},
                                             {RNGType::kMusa, "musa"},
                                             {RNGType::kNpu, "npu"},
                                             {RNGType::kXla, "xla"},
                                             {RNGType::kXpu, "xpu"},
                                             {RNGType::kHpu, "hpu"},
                                             {RNGType::kNeuron, "neuron"},
                                             {RNGType::kGenerator, "generator"}}};
constexpr Spellings<LoggerType, 10> kLoggerTypes{{{LoggerType::kAll, "all"},
                                                   {LoggerType::kAim, "aim"},
                                                   {LoggerType::kTensorboard, "tensorboard"},
                                                   {LoggerType::kWandb, "wandb"},
                                                   {LoggerType::kTrackio, "trackio"},
                                                   {LoggerType::kCometMl, "comet_ml"},
                                                   {LoggerType::kMlflow, "mlflow"},
                                                   {LoggerType::kClearml, "clearml"},
                                                   {LoggerType::kDvclive, "dvclive"},
                                                   {LoggerType::kSwanlab, "swanlab"}}};
constexpr Spellings<ComputeEnvironment, 2> kComputeEnvironments{
    {{ComputeEnvironment::kLocalMachine, "LOCAL_MACHINE"}, {ComputeEnvironment::kAmazonSagemaker, "AMAZON_SAGEMAKER"}}};

constexpr Spellings<CheckpointLayout, 3> kCheckpointLayouts{{{CheckpointLayout::kDetect, "detect"},
                                                              {CheckpointLayout::kCpp, "cpp"},
                                                              {CheckpointLayout::kPython, "python"}}};

template <typename E, size_t N>
std::string spelling_of(const Spellings<E, N>& spellings, E value, const char* type) {
  for (const auto& [member, text] : spellings) {
    if (member == value) return text;
  }
  detail::raise_error(detail::concat("unknown ", type, " ", static_cast<int>(value)));
}

template <typename E, size_t N>
E member_of(const Spellings<E, N>& spellings, std::string_view text, const char* type) {
  for (const auto& [member, spelling] : spellings) {
    if (text == spelling) return member;
  }
  std::string valid;
  for (const auto& item : spellings) valid += (valid.empty() ? "" : ", ") + std::string(item.second);
  detail::raise_value_error(detail::concat("'", text, "' is not a valid ", type, " (expected one of ", valid, ")"));
}

}  // namespace

std::string to_string(CheckpointLayout layout) { return spelling_of(kCheckpointLayouts, layout, "CheckpointLayout"); }
std::string to_string(RNGType type) { return spelling_of(kRngTypes, type, "RNGType"); }
RNGType parse_rng_type(std::string_view text) { return member_of(kRngTypes, text, "RNGType"); }
std::string to_string(LoggerType type) { return spelling_of(kLoggerTypes, type, "LoggerType"); }
LoggerType parse_logger_type(std::string_view text) { return member_of(kLoggerTypes, text, "LoggerType"); }
std::string to_string(ComputeEnvironment environment) {
  return spelling_of(kComputeEnvironments, environment, "ComputeEnvironment");
}
ComputeEnvironment parse_compute_environment(std::string_view text) {
  return member_of(kComputeEnvironments, text, "ComputeEnvironment");
}

namespace detail {
nlohmann::ordered_json changed_fields(const nlohmann::ordered_json& fields, const nlohmann::ordered_json& defaults) {
  auto changed = nlohmann::ordered_json::object();
  for (const auto& [name, value] : fields.items()) {
    if (!defaults.contains(name) || defaults.at(name) != value) changed[name] = value;
  }
  return changed;
}
}  // namespace detail

nlohmann::ordered_json InitProcessGroupKwargs::to_dict() const {
  return {{"backend", backend},
          {"init_method", init_method.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(init_method)},
          {"timeout", timeout ? nlohmann::ordered_json(std::chrono::duration<double>(*timeout).count())
                              : nlohmann::ordered_json(nullptr)}};
}
nlohmann::ordered_json InitProcessGroupKwargs::to_kwargs() const {
  return detail::changed_fields(to_dict(), InitProcessGroupKwargs{}.to_dict());
}

nlohmann::ordered_json GradientAccumulationPlugin::to_dict() const {
  return {{"num_steps", num_steps},
          {"adjust_scheduler", adjust_scheduler},
          {"sync_with_dataloader", sync_with_dataloader},
          {"sync_each_batch", sync_each_batch}};
}
nlohmann::ordered_json GradientAccumulationPlugin::to_kwargs() const {
  return detail::changed_fields(to_dict(), GradientAccumulationPlugin{}.to_dict());
}

nlohmann::ordered_json DistributedDataParallelKwargs::to_dict() const {
  return {{"dim", dim},
          {"broadcast_buffers", broadcast_buffers},
          {"bucket_cap_mb", bucket_cap_mb},
          {"find_unused_parameters", find_unused_parameters},
          {"check_reduction", check_reduction},
          {"gradient_as_bucket_view", gradient_as_bucket_view},
          {"static_graph", static_graph}};
}
nlohmann::ordered_json DistributedDataParallelKwargs::to_kwargs() const {
  return detail::changed_fields(to_dict(), DistributedDataParallelKwargs{}.to_dict());
}

nlohmann::ordered_json GradScalerKwargs::to_dict() const {
  return {{"init_scale", init_scale},
          {"growth_factor", growth_factor},
          {"backoff_factor", backoff_factor},
          {"growth_interval", growth_interval},
          {"enabled", enabled}};
}
nlohmann::ordered_json GradScalerKwargs::to_kwargs() const {
  return detail::changed_fields(to_dict(), GradScalerKwargs{}.to_dict());
}

nlohmann::ordered_json AutocastKwargs::to_dict() const {
  return {{"enabled", enabled},
          {"cache_enabled", cache_enabled ? nlohmann::ordered_json(*cache_enabled) : nlohmann::ordered_json(nullptr)}};
}
nlohmann::ordered_json AutocastKwargs::to_kwargs() const {
  return detail::changed_fields(to_dict(), AutocastKwargs{}.to_dict());
}

static_assert(KwargsHandler<InitProcessGroupKwargs> && KwargsHandler<GradientAccumulationPlugin> &&
              KwargsHandler<DistributedDataParallelKwargs> && KwargsHandler<GradScalerKwargs> &&
              KwargsHandler<AutocastKwargs>);

std::string to_string(DistributedType type) {
  switch (type) {
    case DistributedType::kNo: return "NO";
    case DistributedType::kMultiCpu: return "MULTI_CPU";
    case DistributedType::kMultiGpu: return "MULTI_GPU";
    case DistributedType::kFsdp: return "FSDP";
  }
  detail::raise_error(detail::concat("unknown DistributedType"));
}

DistributedType parse_distributed_type(std::string_view text) {
  if (text == "NO") return DistributedType::kNo;
  if (text == "MULTI_CPU") return DistributedType::kMultiCpu;
  if (text == "MULTI_GPU") return DistributedType::kMultiGpu;
  if (text == "FSDP") return DistributedType::kFsdp;
  detail::raise_value_error(
      detail::concat("[parse_distributed_type] expected one of NO, MULTI_CPU, MULTI_GPU, FSDP, got '", text,
                     "' (DeepSpeed, Megatron-LM, XLA and the other Python-only back-ends are not supported)"));
}

std::string to_string(PrecisionType precision) {
  switch (precision) {
    case PrecisionType::kNo: return "no";
    case PrecisionType::kFp16: return "fp16";
    case PrecisionType::kBf16: return "bf16";
  }
  detail::raise_error(detail::concat("unknown PrecisionType"));
}

PrecisionType parse_precision_type(std::string_view text) {
  const std::string value = detail::ascii_lower(text);
  if (value == "no" || value.empty()) return PrecisionType::kNo;
  if (value == "fp16") return PrecisionType::kFp16;
  if (value == "bf16") return PrecisionType::kBf16;
  ACCELERATE_CHECK_VALUE(value != "fp8",
                         "[parse_precision_type] fp8 mixed precision is not supported by accelerate-cpp; "
                         "use 'no', 'fp16' or 'bf16'");
  detail::raise_value_error(
      detail::concat("[parse_precision_type] expected one of 'no', 'fp16', 'bf16', got '", text, "'"));
}

std::string to_string(DDPCommunicationHookType hook) {
  switch (hook) {
    case DDPCommunicationHookType::kNo: return "no";
    case DDPCommunicationHookType::kFp16: return "fp16";
    case DDPCommunicationHookType::kBf16: return "bf16";
  }
  detail::raise_error(detail::concat("unknown DDPCommunicationHookType"));
}

void ProjectConfiguration::set_directories(const std::string& dir) {
  project_dir = dir;
  if (logging_dir.empty()) logging_dir = dir;
}

DDPCommunicationHookType parse_comm_hook_type(std::string_view text) {
  const std::string value = detail::ascii_lower(text);
  if (value == "no" || value.empty()) return DDPCommunicationHookType::kNo;
  if (value == "fp16") return DDPCommunicationHookType::kFp16;
  if (value == "bf16") return DDPCommunicationHookType::kBf16;
  ACCELERATE_CHECK_VALUE(value != "power_sgd" && value != "batched_power_sgd", "[parse_comm_hook_type] '", text,
                         "' (PowerSGD) is not supported by accelerate-cpp; use 'no', 'fp16' or 'bf16'");
  detail::raise_value_error(
      detail::concat("[parse_comm_hook_type] expected one of 'no', 'fp16', 'bf16', got '", text, "'"));
}

bool str_to_bool(std::string_view text) {
  const std::string value = detail::ascii_lower(text);
  if (value == "1" || value == "true" || value == "yes" || value == "y" || value == "on" || value == "t") return true;
  if (value == "0" || value == "false" || value == "no" || value == "n" || value == "off" || value == "f") return false;
  detail::raise_value_error(
      detail::concat("[str_to_bool] expected a boolean such as 1/0, true/false, yes/no, on/off, got '", text, "'"));
}

namespace {

constexpr Spellings<FsdpShardingStrategy, 5> kShardingStrategies{
    {{FsdpShardingStrategy::kFullShard, "FULL_SHARD"},
     {FsdpShardingStrategy::kShardGradOp, "SHARD_GRAD_OP"},
     {FsdpShardingStrategy::kNoShard, "NO_SHARD"},
     {FsdpShardingStrategy::kHybridShard, "HYBRID_SHARD"},
     {FsdpShardingStrategy::kHybridShardZero2, "_HYBRID_SHARD_ZERO2"}}};
constexpr Spellings<FsdpBackwardPrefetch, 3> kBackwardPrefetches{{{FsdpBackwardPrefetch::kBackwardPre, "BACKWARD_PRE"},
                                                                  {FsdpBackwardPrefetch::kBackwardPost, "BACKWARD_POST"},
                                                                  {FsdpBackwardPrefetch::kNoPrefetch, "NO_PREFETCH"}}};
constexpr Spellings<FsdpStateDictType, 3> kStateDictTypes{{{FsdpStateDictType::kFullStateDict, "FULL_STATE_DICT"},
                                                           {FsdpStateDictType::kLocalStateDict, "LOCAL_STATE_DICT"},
                                                           {FsdpStateDictType::kShardedStateDict, "SHARDED_STATE_DICT"}}};
constexpr Spellings<FsdpAutoWrapPolicy, 3> kAutoWrapPolicies{
    {{FsdpAutoWrapPolicy::kTransformerBasedWrap, "TRANSFORMER_BASED_WRAP"},
     {FsdpAutoWrapPolicy::kSizeBasedWrap, "SIZE_BASED_WRAP"},
     {FsdpAutoWrapPolicy::kNoWrap, "NO_WRAP"}}};

// Upstream's FSDP enums take their names in any case, and some their 1-based numbers.
template <typename E, size_t N>
E fsdp_member(const Spellings<E, N>& spellings, std::string_view text, const char* api, bool numbered) {
  const std::string value = detail::ascii_upper(text);
  if (numbered && value.size() == 1 && value[0] >= '1' && value[0] < static_cast<char>('1' + N)) {
    return spellings[static_cast<size_t>(value[0] - '1')].first;
  }
  for (const auto& [member, spelling] : spellings) {
    if (value == spelling) return member;
  }
  std::string expected;
  for (const auto& [member, spelling] : spellings) expected += detail::concat(expected.empty() ? "" : ", ", spelling);
  detail::raise_value_error(detail::concat("[", api, "] expected one of ", expected, numbered ? " (or its number)" : "",
                                           ", got '", text, "'"));
}

}  // namespace

std::string to_string(FsdpShardingStrategy strategy) {
  return spelling_of(kShardingStrategies, strategy, "FsdpShardingStrategy");
}
FsdpShardingStrategy parse_fsdp_sharding_strategy(std::string_view text) {
  return fsdp_member(kShardingStrategies, text, "parse_fsdp_sharding_strategy", /*numbered=*/true);
}
std::string to_string(FsdpBackwardPrefetch prefetch) {
  return spelling_of(kBackwardPrefetches, prefetch, "FsdpBackwardPrefetch");
}
FsdpBackwardPrefetch parse_fsdp_backward_prefetch(std::string_view text) {
  return fsdp_member(kBackwardPrefetches, text, "parse_fsdp_backward_prefetch", /*numbered=*/false);
}
std::string to_string(FsdpStateDictType type) { return spelling_of(kStateDictTypes, type, "FsdpStateDictType"); }
FsdpStateDictType parse_fsdp_state_dict_type(std::string_view text) {
  return fsdp_member(kStateDictTypes, text, "parse_fsdp_state_dict_type", /*numbered=*/true);
}
std::string to_string(FsdpAutoWrapPolicy policy) {
  return spelling_of(kAutoWrapPolicies, policy, "FsdpAutoWrapPolicy");
}
FsdpAutoWrapPolicy parse_fsdp_auto_wrap_policy(std::string_view text) {
  return fsdp_member(kAutoWrapPolicies, text, "parse_fsdp_auto_wrap_policy", /*numbered=*/false);
}

}  // namespace accelerate
