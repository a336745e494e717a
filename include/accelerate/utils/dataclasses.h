// Option structs and enums of accelerate-cpp, one per upstream dataclass or kwargs handler
// (upstream: accelerate/utils/dataclasses.py). Enums are scoped and speak upstream's strings at
// the edge ("MULTI_CPU", "bf16") because those strings appear in config files and the
// environment. Options for integrations we do not support (DeepSpeed, Megatron, TPU) are
// deliberately absent; fully sharded data parallelism has its plugin here and its engine in
// src/detail/fsdp.cpp.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <optional>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace accelerate {

/// How the processes of a run are connected.
enum class DistributedType {
  kNo,        ///< a single process
  kMultiCpu,  ///< several CPU processes over Gloo (or MPI)
  kMultiGpu,  ///< several CUDA processes over NCCL
  kFsdp,      ///< several processes whose models are fully sharded (an Accelerator with an fsdp_plugin)
};

/// Upstream's spelling of a distributed type: "NO", "MULTI_CPU", "MULTI_GPU", "FSDP".
std::string to_string(DistributedType type);
/// Parses upstream's spelling of a distributed type; throws `c10::ValueError` on anything else.
DistributedType parse_distributed_type(std::string_view text);

/// The arithmetic precision of forward passes.
enum class PrecisionType { kNo, kFp16, kBf16 };

/// Upstream's spelling of a precision: "no", "fp16", "bf16".
std::string to_string(PrecisionType precision);
/// Parses "no", "fp16" or "bf16"; "fp8" is refused as unsupported; throws `c10::ValueError`.
PrecisionType parse_precision_type(std::string_view text);

/// Generators that `synchronize_rng_state` can copy from process 0 (upstream: `RNGType`), with
/// upstream's spellings ("torch", "cuda", "mlu", "sdaa", "musa", "npu", "xla", "xpu", "hpu",
/// "neuron", "generator"). accelerate-cpp synchronises kTorch, kCuda and kGenerator; the others
/// name Python-only devices and are refused when synchronised.
enum class RNGType { kTorch, kCuda, kMlu, kSdaa, kMusa, kNpu, kXla, kXpu, kHpu, kNeuron, kGenerator };
/// Upstream's spelling of a generator type, e.g. "torch".
std::string to_string(RNGType type);
/// Parses upstream's spelling (lower case, exactly, as upstream's `RNGType(value)`); throws
/// `c10::ValueError` "'X' is not a valid RNGType" otherwise.
RNGType parse_rng_type(std::string_view text);

/// Experiment trackers by upstream's names (upstream: `LoggerType`): "all", "aim", "tensorboard",
/// "wandb", "trackio", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab". accelerate-cpp writes
/// "tensorboard", "dvclive" and "wandb" (offline runs), speaks to "mlflow" servers (and has its
/// own "jsonl" and "csv", which are not upstream's names); `log_with` refuses the others, naming
/// them.
enum class LoggerType { kAll, kAim, kTensorboard, kWandb, kTrackio, kCometMl, kMlflow, kClearml, kDvclive, kSwanlab };
/// Upstream's spelling of a tracker, e.g. "comet_ml".
std::string to_string(LoggerType type);
/// Parses upstream's spelling (lower case, exactly); throws `c10::ValueError` otherwise.
LoggerType parse_logger_type(std::string_view text);

/// Where a job runs (upstream: `ComputeEnvironment`, the `compute_environment` of a config file):
/// "LOCAL_MACHINE" or "AMAZON_SAGEMAKER". accelerate-cpp runs on local machines only; config files
/// naming SageMaker are refused.
enum class ComputeEnvironment { kLocalMachine, kAmazonSagemaker };
/// Upstream's spelling: "LOCAL_MACHINE" or "AMAZON_SAGEMAKER".
std::string to_string(ComputeEnvironment environment);
/// Parses upstream's spelling (exactly); throws `c10::ValueError` otherwise.
ComputeEnvironment parse_compute_environment(std::string_view text);

/// A kwargs handler (upstream: the `KwargsHandler` base class): an option struct that lists its
/// fields with `to_dict()` (name to value, in declaration order) and reports with `to_kwargs()`
/// the fields whose values differ from a default-constructed one's. (A concept rather than a
/// base class: a base would keep users from writing `{.field = value}` without warnings.)
template <typename T>
concept KwargsHandler = requires(const T& handler) {
  { handler.to_dict() } -> std::same_as<nlohmann::ordered_json>;
  { handler.to_kwargs() } -> std::same_as<nlohmann::ordered_json>;
};

namespace detail {
/// The entries of `fields` whose values differ from those of `defaults` (`to_kwargs`).
nlohmann::ordered_json changed_fields(const nlohmann::ordered_json& fields, const nlohmann::ordered_json& defaults);
}  // namespace detail

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
  /// Where the processes meet (upstream: `init_method`, PyTorch's URL): empty or "env://" (the
  /// store at MASTER_ADDR:MASTER_PORT, or the options' address and port), "tcp://host:port" (the
  /// store there, served by process 0), "file:///path" (a file every process of the job can
  /// reach, which must not exist before the job, as PyTorch's); the rank and the number of
  /// processes come from the environment or the options, so a URL's query is refused.
  std::string init_method{};
  /// How long a collective may wait for its peers before it fails (default: 30 minutes).
  std::optional<std::chrono::milliseconds> timeout;
  /// The fields by name: "backend" (text), "init_method" (text, empty for PyTorch's None),
  /// "timeout" (seconds, or null for the default).
  nlohmann::ordered_json to_dict() const;
  /// The fields that differ from the defaults (see `KwargsHandler`).
  nlohmann::ordered_json to_kwargs() const;
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

  /// The fields by name, in declaration order.
  nlohmann::ordered_json to_dict() const;
  /// The fields that differ from the defaults (see `KwargsHandler`).
  nlohmann::ordered_json to_kwargs() const;
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
  /// The dimension along which PyTorch's DDP scatters inputs over the devices of one process;
  /// with one device per process (the only way here, and PyTorch's own advice) nothing is
  /// scattered, so only 0 is taken.
  int dim = 0;
  /// Copy the module's buffers (e.g. running statistics) from process 0 before each forward pass
  /// that synchronises.
  bool broadcast_buffers = true;
  /// Largest bucket of gradients reduced in one allreduce, in MiB.
  int bucket_cap_mb = 25;
  /// Find the parameters that the forward pass did not use, so that their gradients do not block
  /// the reduction (costs a traversal of the autograd graph per step).
  bool find_unused_parameters = false;
  /// Deprecated in PyTorch, where it does nothing but warn; here too (a warning, once).
  bool check_reduction = false;
  /// Let gradients be views into the communication buckets (saves one copy and its memory).
  bool gradient_as_bucket_view = false;
  /// The set of used parameters and the graph are the same every step (enables optimisations).
  bool static_graph = false;
  /// Compression of gradient buckets during communication.
  DDPCommunicationHookType comm_hook = DDPCommunicationHookType::kNo;
  /// A second compression wrapped around `comm_hook` (upstream: `comm_wrapper`, meant for PowerSGD):
  /// each bucket is cast to this dtype before the hook's own cast. Needs a `comm_hook`; with
  /// "no" there is nothing to wrap and anything else is refused.
  DDPCommunicationHookType comm_wrapper = DDPCommunicationHookType::kNo;

  /// The fields by name, in declaration order, without `comm_hook` and `comm_wrapper` (as
  /// upstream, which keeps them out of the arguments it passes to DDP). Upstream's
  /// `comm_state_option` configures PowerSGD's state; PowerSGD is not available, nor is the field.
  nlohmann::ordered_json to_dict() const;
  /// The fields that differ from the defaults (see `KwargsHandler`).
  nlohmann::ordered_json to_kwargs() const;
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

  /// The fields by name, in declaration order.
  nlohmann::ordered_json to_dict() const;
  /// The fields that differ from the defaults (see `KwargsHandler`).
  nlohmann::ordered_json to_kwargs() const;
};

/// Settings of the autocast region of mixed-precision forward passes (upstream: `AutocastKwargs`).
struct AutocastKwargs {
  /// Whether autocast is on at all.
  bool enabled = true;
  /// Whether casts of weights are cached inside one autocast region (default: LibTorch's setting).
  std::optional<bool> cache_enabled{};

  /// The fields by name, in declaration order ("cache_enabled": null for LibTorch's setting).
  nlohmann::ordered_json to_dict() const;
  /// The fields that differ from the defaults (see `KwargsHandler`).
  nlohmann::ordered_json to_kwargs() const;
};

/// Where a project keeps its outputs (upstream: `ProjectConfiguration`).
/// The files `save_state` writes and `load_state` reads.
enum class CheckpointLayout {
  kDetect,  ///< loading only: upstream's when the folder holds its pickled files, else the project's
  kCpp,     ///< the project's: safetensors and JSON only, nothing pickled
  kPython,  ///< upstream's (Python Accelerate's `save_state`): optimizer.bin, scheduler.bin, scaler.pt,
            ///< random_states_<p>.pkl, custom_checkpoint_<i>.pkl in torch.save's format, model.safetensors
};
/// "detect", "cpp", "python".
std::string to_string(CheckpointLayout layout);

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
  /// The files `save_state` writes: the project's own (the default: nothing pickled, every file
  /// readable without running code) or upstream's, for Python Accelerate's `load_state` to resume.
  CheckpointLayout checkpoint_layout = CheckpointLayout::kCpp;

  /// Sets `project_dir`, and `logging_dir` to it when `logging_dir` is empty (upstream:
  /// `set_directories`; the `Accelerator` calls it with its own `project_dir` option).
  void set_directories(const std::string& dir);
};

}  // namespace accelerate

namespace accelerate {

/// How a fully sharded model splits its state (upstream: `ShardingStrategy`, PyTorch's names).
enum class FsdpShardingStrategy {
  kFullShard,          ///< parameters, gradients and optimizer state sharded; parameters gathered per unit
  kShardGradOp,        ///< gradients and optimizer state sharded; parameters kept whole from forward to backward
  kNoShard,            ///< nothing sharded: gradients averaged per unit (DDP's result)
  kHybridShard,        ///< FULL_SHARD within a group of processes, replicated across groups
  kHybridShardZero2,   ///< SHARD_GRAD_OP within a group, replicated across groups
};
/// Upstream's spelling: "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2".
std::string to_string(FsdpShardingStrategy strategy);
/// Parses upstream's spelling (any case) or its number, 1 to 5 (as `FSDP_SHARDING_STRATEGY`).
FsdpShardingStrategy parse_fsdp_sharding_strategy(std::string_view text);

/// When the parameters of the next unit are gathered during the backward pass (upstream:
/// `BackwardPrefetch`).
enum class FsdpBackwardPrefetch { kBackwardPre, kBackwardPost, kNoPrefetch };
/// Upstream's spelling: "BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH".
std::string to_string(FsdpBackwardPrefetch prefetch);
/// Parses upstream's spelling (any case).
FsdpBackwardPrefetch parse_fsdp_backward_prefetch(std::string_view text);

/// What a fully sharded model's state dict holds (upstream: `StateDictType`).
enum class FsdpStateDictType {
  kFullStateDict,     ///< whole tensors, gathered on process 0
  kLocalStateDict,    ///< each process's own shards, as they are
  kShardedStateDict,  ///< each process's own shards, with the global shapes they belong to
};
/// Upstream's spelling: "FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT".
std::string to_string(FsdpStateDictType type);
/// Parses upstream's spelling (any case) or its number, 1 to 3.
FsdpStateDictType parse_fsdp_state_dict_type(std::string_view text);

/// Which submodules become units of their own (upstream: the `auto_wrap_policy` names).
enum class FsdpAutoWrapPolicy {
  kTransformerBasedWrap,  ///< modules whose class is in `transformer_cls_names_to_wrap`
  kSizeBasedWrap,         ///< the smallest subtrees holding at least `min_num_params` parameters
  kNoWrap,                ///< the whole model is one unit
};
/// Upstream's spelling: "TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP".
std::string to_string(FsdpAutoWrapPolicy policy);
/// Parses upstream's spelling (any case).
FsdpAutoWrapPolicy parse_fsdp_auto_wrap_policy(std::string_view text);

/// Decides whether the submodule `name` (its dotted path in the model) becomes a unit; it sees
/// the module and the number of parameters in its subtree not yet in a unit (upstream: a
/// callable `auto_wrap_policy`).
using FsdpWrapCallable = std::function<bool(const std::string& name, const torch::nn::Module& module,
                                            int64_t unwrapped_params)>;

/// The dtypes a fully sharded model computes, reduces and keeps buffers in (upstream:
/// `MixedPrecision` / `MixedPrecisionPolicy`): "fp32", "bf16", "fp16", "fp64" (or "float32",
/// "bfloat16", "float16", "float64"), or empty. Only floating-point tensors are cast. Left wholly
/// empty while the Accelerator has a `mixed_precision`, all three take that precision (upstream's
/// `set_mixed_precision`).
struct FsdpMixedPrecisionPolicy {
  /// The whole parameters, gathered in this dtype for the forward and backward passes, and the
  /// floating inputs of the model's call and of every unit (upstream's cast_forward_inputs). The
  /// shards, their gradients and the optimizer stay in the parameters' own dtype. Empty: their own.
  std::string param_dtype{};
  /// The gradients' reduction over the processes. Empty: param_dtype.
  std::string reduce_dtype{};
  /// Floating buffers, cast once when the model is prepared; state dicts and checkpoints hold them
  /// in their own dtype. Empty: not cast.
  std::string buffer_dtype{};
};

/// How the state dict of a fully sharded model (or of its optimizer) is made while a checkpoint
/// is saved (upstream: PyTorch's `FullStateDictConfig`, `ShardedStateDictConfig` and their
/// `*OptimStateDictConfig` twins).
struct FsdpStateDictConfig {
  /// Move each tensor to the CPU as soon as it is gathered (full) or taken (sharded), so that a
  /// GPU never holds the whole state at once. A no-op for CPU processes.
  bool offload_to_cpu = false;
  /// FULL_STATE_DICT only: the whole tensors are kept by the processes that write the files
  /// (process 0, or each machine's first with `save_on_each_node`); the others drop each one as
  /// soon as the gather that needs them is done, so their memory holds one tensor at a time.
  bool rank0_only = false;
};

/// Fully sharded data parallelism (upstream: `FullyShardedDataParallelPlugin`). A field left
/// empty takes the matching `FSDP_*` environment variable (what `accelerate launch --use_fsdp
/// --fsdp_*` and the `fsdp_config` of a config file set), else upstream's default. Given to an
/// `Accelerator` (or set by `ACCELERATE_USE_FSDP=true`), it makes `prepare` shard every model
/// over the processes instead of replicating it.
///
/// Example:
///   accelerate::Accelerator accelerator({.fsdp_plugin = accelerate::FullyShardedDataParallelPlugin{
///       .fsdp_version = 2, .auto_wrap_policy = accelerate::FsdpAutoWrapPolicy::kTransformerBasedWrap,
///       .transformer_cls_names_to_wrap = {"Block"}}});
struct FullyShardedDataParallelPlugin {
  /// 2: per-parameter sharding on dimension 0 (PyTorch's `fully_shard`); 1 is accepted and runs
  /// the same engine. Env: FSDP_VERSION; default 1.
  std::optional<int> fsdp_version{};
  /// How state is split (version 1's way of choosing). Env: FSDP_SHARDING_STRATEGY; default FULL_SHARD.
  std::optional<FsdpShardingStrategy> sharding_strategy{};
  /// Free a unit's gathered parameters after its forward, gathering them again for its backward
  /// (version 2's way of choosing: true is FULL_SHARD, false SHARD_GRAD_OP). Env:
  /// FSDP_RESHARD_AFTER_FORWARD.
  std::optional<bool> reshard_after_forward{};
  /// Gathering ahead during the backward pass. Env: FSDP_BACKWARD_PREFETCH; default NO_PREFETCH.
  std::optional<FsdpBackwardPrefetch> backward_prefetch{};
  /// Compute, reduction and buffer dtypes.
  FsdpMixedPrecisionPolicy mixed_precision_policy{};
  /// Which submodules are units. Env: FSDP_AUTO_WRAP_POLICY; default NO_WRAP (one unit).
  std::optional<FsdpAutoWrapPolicy> auto_wrap_policy{};
  /// A policy of the user's; not with `auto_wrap_policy`.
  FsdpWrapCallable auto_wrap_callable{};
  /// Class names (`torch::nn::Module::name()`, or without its namespaces and "Impl": "Block" for
  /// a TORCH_MODULE(Block)) whose modules
  /// are units under TRANSFORMER_BASED_WRAP. Env: FSDP_TRANSFORMER_CLS_TO_WRAP (comma-separated).
  std::vector<std::string> transformer_cls_names_to_wrap{};
  /// The threshold of SIZE_BASED_WRAP. Env: FSDP_MIN_NUM_PARAMS; default 100000000.
  std::optional<int64_t> min_num_params{};
  /// Keep shards, gradients and the optimizer step on the CPU. Env: FSDP_OFFLOAD_PARAMS.
  std::optional<bool> cpu_offload{};
  /// Dotted names of submodules left out of sharding: their parameters stay whole on every
  /// process and are not reduced.
  std::vector<std::string> ignored_modules{};
  /// What `save_state` writes and `get_state_dict` returns. Env: FSDP_STATE_DICT_TYPE; default
  /// FULL_STATE_DICT.
  std::optional<FsdpStateDictType> state_dict_type{};
  /// Copy process 0's parameters and buffers to every process before sharding. Env:
  /// FSDP_SYNC_MODULE_STATES; default true.
  std::optional<bool> sync_module_states{};
  /// Called on every submodule that holds meta-device tensors, to materialise them before
  /// sharding.
  std::function<void(torch::nn::Module&)> param_init_fn{};
  /// Only process 0 holds real weights; the others build the model on the meta device and get
  /// process 0's values (needs `sync_module_states`). Env: FSDP_CPU_RAM_EFFICIENT_LOADING.
  std::optional<bool> cpu_ram_efficient_loading{};
  /// Recompute activations in the backward pass. Env: FSDP_ACTIVATION_CHECKPOINTING.
  std::optional<bool> activation_checkpointing{};
  /// Gather the next unit's parameters during the current unit's forward. Env: FSDP_FORWARD_PREFETCH.
  std::optional<bool> forward_prefetch{};
  /// Keep at most one gather ahead of the unit that runs. Env: FSDP_LIMIT_ALL_GATHERS; default
  /// true; false (no limit) is refused.
  std::optional<bool> limit_all_gathers{};
  /// The optimizer sees the module's own parameters. Env: FSDP_USE_ORIG_PARAMS; default true.
  std::optional<bool> use_orig_params{};
  /// How `save_state` and `save_model` make the model's state dict. Default (upstream's): for
  /// FULL_STATE_DICT offload_to_cpu and rank0_only, otherwise offload_to_cpu.
  std::optional<FsdpStateDictConfig> state_dict_config{};
  /// The same for the optimizer's state dict in `save_state`.
  std::optional<FsdpStateDictConfig> optim_state_dict_config{};

  /// Sets `state_dict_type` to `type` when given; else, when it is unset, to FSDP_STATE_DICT_TYPE
  /// or FULL_STATE_DICT. Then fills the state-dict configs left unset with that type's defaults
  /// (see `state_dict_config`). Upstream: `set_state_dict_type`.
  void set_state_dict_type(std::optional<FsdpStateDictType> type = std::nullopt);
  /// Turns the named policy (the field, else FSDP_AUTO_WRAP_POLICY) into `auto_wrap_callable` for
  /// `model`, and clears `auto_wrap_policy`: TRANSFORMER_BASED_WRAP wraps the modules of the classes
  /// in `transformer_cls_names_to_wrap` (else FSDP_TRANSFORMER_CLS_TO_WRAP), each of which must
  /// occur in `model` (refused by name otherwise); SIZE_BASED_WRAP wraps subtrees of at least
  /// `min_num_params` (else FSDP_MIN_NUM_PARAMS, else 10^8) parameters, and 0 means no wrapping, as
  /// upstream; NO_WRAP, or a callable already set, changes nothing. `prepare` calls it on each model
  /// (upstream: `set_auto_wrap_policy`).
  void set_auto_wrap_policy(const torch::nn::Module& model);
  /// Sets the mixed-precision policy from an `Accelerator`'s `mixed_precision` ("fp16", "bf16" or
  /// "fp32"; anything else refused): parameters and reductions in that dtype, and with version 1
  /// the buffers too, or in fp32 with `buffer_autocast`. A policy already set is kept unless
  /// `override` (upstream: `set_mixed_precision`).
  void set_mixed_precision(const std::string& mixed_precision, bool buffer_autocast = false, bool override = false);
  /// Checks the mixed-precision policy's dtype names, refusing an unknown one by field and name
  /// (upstream: `validate_mixed_precision_policy`).
  void validate_mixed_precision_policy() const;
};

/// The exit status of a process that stopped because the job was asked to stop, after saving its
/// state (sysexits.h's EX_TEMPFAIL: try again later). `accelerate launch` reports a job whose
/// workers end with it as preempted, and does not restart it.
inline constexpr int kPreemptedExitCode = 75;

/// Stopping cleanly when the job is asked to (`AcceleratorOptions::preemption`; beyond upstream).
/// A cluster that preempts a job, or whose time limit comes, signals it first: Slurm sends SIGTERM,
/// or with `--signal=USR1@N` SIGUSR1 N seconds before the limit; `accelerate launch` passes both
/// on. With this set, those signals no longer end the process: they mark the job as asked to stop
/// (`Accelerator::preemption_requested`).
struct PreemptionKwargs {
  /// The signals that ask the job to stop: any of "SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT",
  /// "SIGHUP" (the "SIG" may be left out).
  std::vector<std::string> signals{"SIGTERM", "SIGUSR1"};
  /// At the first step boundary after the request, every process saves the state (`save_state()`,
  /// into the project's next automatic checkpoint: needs `ProjectConfiguration`'s
  /// `automatic_checkpoint_naming`) and ends with `kPreemptedExitCode`. A step boundary is a
  /// prepared data loader, iterated with gradients enabled, about to deliver a batch after one
  /// whose gradients were synchronised (an optimizer step), or about to start a pass. The run
  /// resumed from that checkpoint continues exactly where it stopped when the loaders keep their
  /// position in checkpoints (`DataLoaderConfiguration::use_stateful_dataloader`); otherwise they
  /// start the interrupted pass again, as upstream's do. Asking is a collective, so every process
  /// must see as many batches: refused with `DataLoaderConfiguration::even_batches` off, and not
  /// asked inside `join_uneven_inputs`. False: the loop asks `preemption_requested()` itself and
  /// decides.
  bool save_on_preemption = true;
};

/// How `prepare` applies tensor parallelism (upstream: `TorchTensorParallelConfig`, a
/// `ParallelismConfig`'s `tp_handler`). Upstream takes the plan from the model's transformers
/// class; here it is given (`AcceleratorOptions::tp_handler`), or the model's class carries it
/// (`accelerate::nn::TensorParallelPlanned`).
struct TorchTensorParallelConfig {
  /// Styles by module name, the first matching entry winning. A `*` stands for one component of
  /// the name ("blocks.*.fc1"). Styles (transformers' names): "colwise" (a Linear's or Embedding's
  /// output features split: the output is sharded on its last dimension), "colwise_rep" (the same,
  /// the output gathered whole), "rowwise" (a Linear's input features split, the partial outputs
  /// summed; on an Embedding, the vocabulary split), "sequence_parallel" (any module, a norm or a
  /// dropout say: parameters whole, the module run on this process's piece of dimension 1 of its
  /// input, the sequence, its output gathered whole, its parameters' gradients summed over the
  /// group), "replicate" (kept whole). Empty: the plan of the model's class; a model with neither
  /// is refused.
  std::vector<std::pair<std::string, std::string>> tp_plan{};
  /// Overlapping the collectives with the matrix products (upstream's `enable_async_tp`): needs
  /// CUDA's symmetric memory, which LibTorch does not offer; true is refused.
  bool enable_async_tp = false;
};

/// How context parallelism passes keys and values between the processes of a context-parallel
/// group (upstream: `TorchContextParallelConfig`, a `ParallelismConfig`'s `cp_handler`).
struct TorchContextParallelConfig {
  /// "allgather" (every process gathers the whole group's keys and values once per attention
  /// call; its backward sums their gradients over the group) or "alltoall" (the blocks travel
  /// around the group as a ring, one neighbour exchange per step, with their gradients on the way
  /// back). Empty: `PARALLELISM_CONFIG_CP_COMM_STRATEGY`, else "allgather".
  std::string cp_comm_strategy{};
};

}  // namespace accelerate
