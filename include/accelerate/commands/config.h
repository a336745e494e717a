// Reading upstream's `default_config.yaml` (upstream: accelerate/commands/config/config_args.py):
// the same schema, the same default location (`$HF_HOME/accelerate/default_config.yaml`, else
// `$XDG_CACHE_HOME/huggingface/…`, else `~/.cache/huggingface/…`), older schema spellings
// converted, unknown keys refused with their names. Python-only integrations (DeepSpeed, FSDP,
// Megatron-LM, TPU, SageMaker, dynamo) are refused when a file asks for them.
#pragma once

#include "accelerate/utils/dataclasses.h"

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
  std::string rdzv_backend = "static";
  bool same_network = true;
  std::string main_training_function = "main";
  bool enable_cpu_affinity = false;
  bool downcast_bf16 = false;
  /// `mpirun_config.mpirun_hostfile`, for the MPI back-end.
  std::optional<std::string> mpirun_hostfile;
  /// Keys present in the file (so callers can tell a default from a value that was written).
  std::vector<std::string> keys_present;
};

/// The default configuration file path, following upstream's location rules.
std::string default_config_file();

/// Reads a YAML (or, for a `.json` name, JSON) configuration; throws `c10::ValueError` naming the
/// file for a missing file, unknown keys (all listed), a value of the wrong type, or an
/// unsupported integration.
ClusterConfig load_config_from_file(const std::string& path);

/// Writes `config` in upstream's YAML schema (keys sorted, as `yaml.safe_dump` writes them).
void save_config_file(const ClusterConfig& config, const std::string& path);

}  // namespace accelerate::commands
