// Option structs and enums of accelerate-cpp, one per upstream dataclass or kwargs handler
// (upstream: accelerate/utils/dataclasses.py). Enums are scoped and speak upstream's strings at
// the edge ("MULTI_CPU", "bf16") because those strings appear in config files and the
// environment. Options for integrations we do not support (DeepSpeed, FSDP, Megatron, TPU) are
// deliberately absent.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>

namespace accelerate {

/// How the processes of a run are connected.
enum class DistributedType {
  kNo,        ///< a single process
  kMultiCpu,  ///< several CPU processes over Gloo (or MPI)
  kMultiGpu,  ///< several CUDA processes over NCCL
};

/// Upstream's spelling of a distributed type: "NO", "MULTI_CPU", "MULTI_GPU".
std::string to_string(DistributedType type);
/// Parses upstream's spelling of a distributed type; throws `c10::ValueError` on anything else.
DistributedType parse_distributed_type(std::string_view text);

/// The arithmetic precision of forward passes.
enum class PrecisionType { kNo, kFp16, kBf16 };

/// Upstream's spelling of a precision: "no", "fp16", "bf16".
std::string to_string(PrecisionType precision);
/// Parses "no", "fp16" or "bf16"; "fp8" is refused as unsupported; throws `c10::ValueError`.
PrecisionType parse_precision_type(std::string_view text);

/// Options of the process group (upstream: `InitProcessGroupKwargs`).
///
/// Example:
///   accelerate::PartialState state({.init_kwargs = {.backend = "gloo",
///                                                  .timeout = std::chrono::seconds(60)}});
struct InitProcessGroupKwargs {
  /// "gloo", "nccl", or empty to pick the natural one for the device (NCCL on CUDA, else Gloo).
  std::string backend;
  /// How long a collective may wait for its peers before it fails (default: 30 minutes).
  std::optional<std::chrono::milliseconds> timeout;
};

/// Parses an environment-style boolean ("1", "true", "yes", "on" / "0", "false", "no", "off",
/// any case); throws `c10::ValueError` naming the text otherwise (upstream: `str_to_bool`).
bool str_to_bool(std::string_view text);

}  // namespace accelerate

namespace accelerate {

/// How gradient accumulation behaves (upstream: `GradientAccumulationPlugin`).
struct GradientAccumulationPlugin {
  /// Number of steps over which gradients are accumulated before an optimizer step.
  int num_steps = 1;
  /// Whether the learning-rate scheduler is stepped accordingly.
  bool adjust_scheduler = true;
  /// Whether the end of a data loader forces a synchronisation.
  bool sync_with_dataloader = true;
  /// Whether gradients are synchronised on every batch (costlier, less memory).
  bool sync_each_batch = false;
};

}  // namespace accelerate
