// Upstream's `default_config.yaml` and the `accelerate config` command (upstream:
// accelerate/commands/config/{config_args,cluster,default,update}.py): the same schema, the same
// default location (`$HF_HOME/accelerate/default_config.yaml`, else
// `$XDG_CACHE_HOME/huggingface/…`, else `~/.cache/huggingface/…`), older schema spellings
// converted, unknown keys refused with their names. The questionnaire asks upstream's questions
// in upstream's order for what accelerate-cpp supports, one answer per line, so it can be
// answered through a pipe. Python-only integrations (DeepSpeed, FSDP, Megatron-LM, TPU,
// SageMaker, dynamo) are never asked about and are refused when a file asks for them.
//
// Example:
//   printf '1\n\n\n4\nbf16\n' | accelerate config --config_file cpu.yaml   # 4 CPU processes, bf16
//   accelerate config default --mixed_precision bf16
#pragma once

#include "accelerate/utils/dataclasses.h"

#include <iosfwd>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace accelerate::commands {

/// A configuration for runs on local machines (upstream: `ClusterConfig`).
struct ClusterConfig {
  std::string compute_environment = "LOCAL_MACHINE";
  DistributedType distributed_type = DistributedType::kNo;
  std::string mixed_precision = "no";
  bool use_cpu = false;
  bool debug = false;
  int num_processes = 1;
  int machine_rank = 0;
  int num_machines = 1;
  std::optional<std::string> gpu_ids;
  std::optional<std::string> main_process_ip;
  std::optional<int> main_process_port;
  /// "static" or "c10d": the default of `accelerate launch --rdzv_backend` (upstream reads it and
  /// never uses it). The file has no `rdzv_conf`, as upstream's has none.
  std::string rdzv_backend = "static";
  bool same_network = true;
  std::string main_training_function = "main";
  bool enable_cpu_affinity = false;
  bool downcast_bf16 = false;
  /// `mpirun_config.mpirun_hostfile`, for the MPI back-end.
  std::optional<std::string> mpirun_hostfile;
  /// `distributed_type: FSDP` (read back as MULTI_GPU, or MULTI_CPU with `use_cpu`): models are
  /// fully sharded.
  bool use_fsdp = false;
  /// The `fsdp_config` section: upstream's keys (`fsdp_sharding_strategy`, …) and their values
  /// as written.
  std::map<std::string, std::string> fsdp_config;
  /// The `parallelism_config` section: upstream's keys (`parallelism_config_dp_shard_size`, …) and
  /// their values as written; empty when the file has none (or `{}`).
  std::map<std::string, std::string> parallelism_config;
  /// Keys present in the file (so callers can tell a default from a value that was written).
  std::vector<std::string> keys_present;
};

/// The keys of upstream's `fsdp_config` section (the `--fsdp_*` flags of `accelerate launch`), each
/// with the environment variable it sets for the workers (`fsdp_sharding_strategy` →
/// `FSDP_SHARDING_STRATEGY`).
const std::vector<std::pair<std::string, std::string>>& fsdp_config_keys();
/// Checks a value given for `key` of `fsdp_config_keys()` (an enum name, a boolean, a number);
/// throws `c10::ValueError` naming the key and `where` it was given otherwise.
void check_fsdp_value(const std::string& key, const std::string& value, const std::string& where);

/// The keys of upstream's `parallelism_config` section (the `--parallelism_config_*` flags of
/// `accelerate launch`) that accelerate-cpp takes, each with the environment variable it sets for
/// the workers (`parallelism_config_dp_shard_size` → `PARALLELISM_CONFIG_DP_SHARD_SIZE`).
const std::vector<std::pair<std::string, std::string>>& parallelism_config_keys();
/// Checks a value given for `key` of `parallelism_config_keys()`: a positive integer for the sizes,
/// "torch" for the context-parallel backend, "allgather" or "alltoall" for its strategy; throws
/// `c10::ValueError` naming the key and `where` it was given otherwise.
void check_parallelism_value(const std::string& key, const std::string& value, const std::string& where);
/// Whether `key` of `parallelism_config_keys()` is a size (a number in the file), not a name.
bool is_parallelism_size(const std::string& key);

/// The default configuration file path, following upstream's location rules.
std::string default_config_file();

/// Reads a YAML (or, for a `.json` name, JSON) configuration; throws `c10::ValueError` naming the
/// file for a missing file, unknown keys (all listed), a value of the wrong type, or an
/// unsupported integration.
ClusterConfig load_config_from_file(const std::string& path);

/// Writes `config` in upstream's schema: YAML (keys sorted, as `yaml.safe_dump` writes them), or
/// JSON for a `.json` name (as upstream's `to_json_file`). The file is replaced atomically and
/// missing folders are created.
void save_config_file(const ClusterConfig& config, const std::string& path);

/// How `get_user_input` talks to the user.
struct QuestionnaireOptions {
  /// Write each answer after its question (for input that is not a terminal, so that the
  /// transcript reads like a session).
  bool echo_answers = false;
};

/// Asks the questions of `accelerate config` on `out` and reads one answer per line from `in`
/// (upstream: `get_user_input`). An empty line takes the default shown in brackets; a choice is
/// answered with its number or its name. An invalid answer prints why and asks again; input that
/// ends before the last question raises a ValueError naming the question.
ClusterConfig get_user_input(std::istream& in, std::ostream& out, const QuestionnaireOptions& options = {});

/// Writes a configuration for this machine to `save_location` (upstream: `write_basic_config`):
/// one process per CUDA device when LibTorch has CUDA, else one CPU process. Returns the path, or
/// `std::nullopt` without touching anything when a file already exists there. `mixed_precision`
/// is "no", "fp16" or "bf16" (any case); anything else raises a ValueError.
std::optional<std::string> write_basic_config(const std::string& mixed_precision = "no",
                                              const std::string& save_location = default_config_file());

/// Rewrites a configuration file in the current schema, keeping its settings (upstream:
/// `update_config`); older spellings such as `fp16: true` are converted. Without `config_file`,
/// the default file is updated. Returns the path; raises a ValueError when the file is missing
/// or invalid.
std::string update_config(const std::optional<std::string>& config_file = std::nullopt);

/// `accelerate config [--config_file F]`, `accelerate config default [--config_file F]
/// [--mixed_precision no|fp16|bf16]` and `accelerate config update [--config_file F]`: runs the
/// command with `args` (what follows `config`) and returns the exit code: 0 on success, 1 on
/// an error (printed to `err`), 2 for a usage error.
int config_main(const std::vector<std::string>& args, std::istream& in, std::ostream& out, std::ostream& err);

}  // namespace accelerate::commands
