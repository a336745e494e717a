// The file names of checkpoints and saved models (upstream: accelerate/utils/constants.py), kept
// in upstream's spelling so that code ported from Python reads the same. They name the files of
// upstream's checkpoint layout (`CheckpointLayout::kPython`), which `save_state` writes and
// `load_state` detects by these names; the project's own layout uses the same stems with its own
// extensions (`optimizer.safetensors`, `scheduler.json`, `random_states_<p>.safetensors`).
//
// Left out: upstream's SageMaker, DeepSpeed, TorchDynamo and PyTorch-version constants, which
// name Python packages and releases that a LibTorch program does not meet.
//
// Example:
//   const auto weights = std::filesystem::path(folder) / accelerate::SAFE_WEIGHTS_NAME;
#pragma once

#include <array>
#include <string_view>

namespace accelerate {

inline constexpr std::string_view SCALER_NAME = "scaler.pt";
inline constexpr std::string_view MODEL_NAME = "pytorch_model";
inline constexpr std::string_view SAFE_MODEL_NAME = "model";
inline constexpr std::string_view RNG_STATE_NAME = "random_states";
inline constexpr std::string_view OPTIMIZER_NAME = "optimizer";
inline constexpr std::string_view SCHEDULER_NAME = "scheduler";
inline constexpr std::string_view SAMPLER_NAME = "sampler";
/// `{suffix}` stands for the process index (the profiler's trace files).
inline constexpr std::string_view PROFILE_PATTERN_NAME = "profile_{suffix}.json";
inline constexpr std::string_view WEIGHTS_NAME = "pytorch_model.bin";
/// `{suffix}` stands for a shard's "-00001-of-00003".
inline constexpr std::string_view WEIGHTS_PATTERN_NAME = "pytorch_model{suffix}.bin";
inline constexpr std::string_view WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json";
inline constexpr std::string_view SAFE_WEIGHTS_NAME = "model.safetensors";
/// `{suffix}` stands for a shard's "-00001-of-00003".
inline constexpr std::string_view SAFE_WEIGHTS_PATTERN_NAME = "model{suffix}.safetensors";
inline constexpr std::string_view SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json";
/// The folder stem of a fully sharded model's sharded state (`pytorch_model_fsdp_<i>`).
inline constexpr std::string_view FSDP_MODEL_NAME = "pytorch_model_fsdp";
/// The names of the FSDP options as upstream lists them for its configuration questions (the
/// parsers of `FsdpShardingStrategy`, `FsdpAutoWrapPolicy`, `FsdpBackwardPrefetch` and
/// `FsdpStateDictType` take each; PyTorch spells the last strategy "_HYBRID_SHARD_ZERO2").
inline constexpr std::array<std::string_view, 5> FSDP_SHARDING_STRATEGY = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD",
                                                                           "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"};
inline constexpr std::array<std::string_view, 3> FSDP_AUTO_WRAP_POLICY = {"TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP",
                                                                          "NO_WRAP"};
inline constexpr std::array<std::string_view, 3> FSDP_BACKWARD_PREFETCH = {"BACKWARD_PRE", "BACKWARD_POST",
                                                                           "NO_PREFETCH"};
inline constexpr std::array<std::string_view, 3> FSDP_STATE_DICT_TYPE = {"FULL_STATE_DICT", "LOCAL_STATE_DICT",
                                                                         "SHARDED_STATE_DICT"};

}  // namespace accelerate
