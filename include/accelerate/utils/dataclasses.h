// Option structs and enums of accelerate-cpp, one per upstream dataclass or kwargs handler
// (upstream: accelerate/utils/dataclasses.py). Enums are scoped and speak upstream's strings at
// the edge ("MULTI_CPU", "bf16") because those strings appear in config files and the
// environment. Options for integrations we do not support (DeepSpeed, FSDP, Megatron, TPU) are
// deliberately absent.
#pragma once

#include <chrono>
#include <cstdint>
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
  /// "gloo", "nccl", "mpi" (CPU processes started by `mpirun`, or by `accelerate launch`, which
  /// uses it by default for CPU jobs on one machine when the build has MPI), or empty for
  /// ACCELERATE_BACKEND, else the natural one: NCCL on CUDA, MPI under mpirun, else Gloo.
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

namespace accelerate {

/// How gradient buckets are compressed for communication (upstream: `DDPCommunicationHookType`).
enum class DDPCommunicationHookType {
  kNo,    ///< allreduce in the gradients' own dtype
  kFp16,  ///< cast each bucket to float16, allreduce, cast back
  kBf16,  ///< cast each bucket to bfloat16, allreduce, cast back
};

/// Upstream's spelling of a communication hook: "no", "fp16", "bf16".
std::string to_string(DDPCommunicationHookType hook);
/// Parses "no", "fp16" or "bf16"; PowerSGD variants are refused as unsupported.
DDPCommunicationHookType parse_comm_hook_type(std::string_view text);

/// How prepared models synchronise gradients (upstream: `DistributedDataParallelKwargs`, the
/// arguments of PyTorch's `DistributedDataParallel`).
///
/// Example:
///   accelerate::Accelerator accelerator({.ddp_kwargs = {.bucket_cap_mb = 8,
///                                                      .comm_hook = accelerate::DDPCommunicationHookType::kBf16}});
struct DistributedDataParallelKwargs {
  /// Copy the module's buffers (e.g. running statistics) from process 0 before each forward pass
  /// that synchronises.
  bool broadcast_buffers = true;
  /// Largest bucket of gradients reduced in one allreduce, in MiB.
  int bucket_cap_mb = 25;
  /// Find the parameters that the forward pass did not use, so that their gradients do not block
  /// the reduction (costs a traversal of the autograd graph per step).
  bool find_unused_parameters = false;
  /// Let gradients be views into the communication buckets (saves one copy and its memory).
  bool gradient_as_bucket_view = false;
  /// The set of used parameters and the graph are the same every step (enables optimisations).
  bool static_graph = false;
  /// Compression of gradient buckets during communication.
  DDPCommunicationHookType comm_hook = DDPCommunicationHookType::kNo;
};

/// Settings of the dynamic loss scaler of fp16 training (upstream: `GradScalerKwargs`).
struct GradScalerKwargs {
  /// Initial loss scale.
  double init_scale = 65536.0;
  /// Factor applied to the scale after `growth_interval` steps without overflow.
  double growth_factor = 2.0;
  /// Factor applied to the scale on a step whose gradients overflowed.
  double backoff_factor = 0.5;
  /// Steps without overflow before the scale grows.
  int64_t growth_interval = 2000;
  /// With false, scaling is a no-op and every step runs.
  bool enabled = true;
};

/// Settings of the autocast region of mixed-precision forward passes (upstream: `AutocastKwargs`).
struct AutocastKwargs {
  /// Whether autocast is on at all.
  bool enabled = true;
  /// Whether casts of weights are cached inside one autocast region (default: LibTorch's setting).
  std::optional<bool> cache_enabled{};
};

/// Where a project keeps its outputs (upstream: `ProjectConfiguration`).
struct ProjectConfiguration {
  /// Root folder of the project's outputs.
  std::string project_dir{};
  /// Folder of tracker logs (default: `project_dir`).
  std::string logging_dir{};
  /// Name checkpoints `checkpoints/checkpoint_<iteration>` under `project_dir`.
  bool automatic_checkpoint_naming = false;
  /// Keep at most this many checkpoints (0: all).
  int total_limit = 0;
  /// Number of the next automatically named checkpoint.
  int iteration = 0;
  /// Save on the main process of every machine instead of only the global main process.
  bool save_on_each_node = false;
};

}  // namespace accelerate
