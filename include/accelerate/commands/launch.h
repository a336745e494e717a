// `accelerate launch`: starts, watches and tears down the processes of a job (upstream:
// accelerate/commands/launch.py, which delegates to torchrun). Any executable can be launched;
// `.py` scripts run under python3. The launcher serves the rendezvous store itself, sets the
// environment contract of each worker, prefixes their output with the rank, forwards signals,
// reports the root cause of a failure, restarts the group on request and never leaves a worker
// behind (workers die with it, even when it is killed with SIGKILL).
#pragma once

#include "accelerate/commands/config.h"

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace accelerate::commands {

/// The flags of `accelerate launch` as given; unset ones come from the config file or defaults.
struct LaunchArgs {
  std::optional<std::string> config_file;
  bool cpu = false;
  bool multi_gpu = false;
  std::optional<std::string> mixed_precision;
  std::optional<int> num_processes;
  std::optional<int> num_machines;
  std::optional<int> machine_rank;
  /// "static" or "c10d"; unset: the config file's `rdzv_backend`, else "static"
  std::optional<std::string> rdzv_backend;
  std::optional<std::string> nnodes;  ///< torchrun's "N" or "MIN:MAX" (elastic)
  /// torchrun's "key=value,..." (Note [The keys of --rdzv_conf] in src/launch/plan.cpp)
  std::optional<std::string> rdzv_conf;
  std::optional<std::string> main_process_ip;
  std::optional<int> main_process_port;
  std::optional<std::string> gpu_ids;
  std::optional<int> num_cpu_threads_per_process;
  std::optional<int> gradient_accumulation_steps;
  bool debug = false;
  bool enable_cpu_affinity = false;
  int max_restarts = 0;
  double monitor_interval = 0.1;   ///< seconds between health checks of the workers
  /// seconds the workers wait for each other at start-up; unset: rdzv_conf's timeout, else 900
  std::optional<double> rdzv_timeout;
  double grace_period = 5;  ///< seconds between SIGTERM and SIGKILL when tearing down
  std::optional<std::string> log_dir;
  std::optional<std::string> tee;  ///< streams also shown on the console with --log_dir: 0-3
  std::optional<std::string> backend;
  std::optional<std::string> mpirun_hostfile;  ///< machines for `--backend mpi` (mpirun's --hostfile)
  std::optional<std::string> rdzv_secret_file;  ///< file holding the job's rendezvous secret
  bool use_fsdp = false;                      ///< --use_fsdp: prepared models are fully sharded
  std::map<std::string, std::string> fsdp;    ///< the --fsdp_* flags, by key (`fsdp_sharding_strategy`)
  bool use_parallelism_config = false;        ///< --use_parallelism_config
  /// the --parallelism_config_* flags, by key (`parallelism_config_dp_shard_size`)
  std::map<std::string, std::string> parallelism;
  bool no_python = false;
  bool module = false;
  bool quiet = false;            ///< silence the launcher's informational lines (errors still show)
  bool help = false;             ///< --help was given
  std::string training_script;
  std::vector<std::string> training_script_args;
};

/// Parses the arguments that follow `accelerate launch`; throws `c10::ValueError` naming an
/// unknown or malformed flag. Hyphenated spellings (`--num-processes`) are accepted.
LaunchArgs parse_launch_args(const std::vector<std::string>& argv);

/// The usage text of `accelerate launch --help`.
std::string launch_help();

/// Everything resolved: flags merged over the config file over defaults, validated.
struct LaunchPlan {
  int num_processes = 1;  ///< in the whole job
  int num_machines = 1;
  int machine_rank = 0;
  /// `--rdzv_backend c10d` without `--machine_rank`: the machine whose address is
  /// --main_process_ip is machine 0; the others get theirs at the rendezvous, in the order they
  /// join (Note [Machine ranks from the rendezvous] in src/launch/elastic.cpp).
  bool machine_rank_at_rendezvous = false;
  std::string rdzv_backend = "static";
  /// `--nnodes MIN:MAX` with MIN < MAX: the job runs on as many of num_machines (MAX) machines
  /// as join, and at least `min_machines`, and is formed again when one is lost or one comes
  /// (Note [Elastic membership] in src/launch/elastic.cpp). Machine ranks come from the rendezvous.
  /// Also a job of a fixed size (MIN = MAX) whose machines are numbered at the rendezvous and that
  /// may restart: each attempt's group is formed at a round, which a relaunched machine joins.
  bool elastic = false;
  int min_machines = 1;
  /// Seconds the rendezvous waits for more machines once `min_machines` have joined (rdzv_conf's
  /// last_call_timeout).
  double last_call_timeout = 30;
  /// Seconds the launchers wait for each other at their c10d rendezvous (rdzv_conf's
  /// join_timeout); unset: `rdzv_timeout`.
  std::optional<double> join_timeout;
  /// Whether this machine's launcher hosts the rendezvous store, as machine 0 (rdzv_conf's
  /// is_host); unset: whether --main_process_ip is an address of this machine.
  std::optional<bool> is_host;
  int local_num_processes = 1;
  std::string main_process_ip = "127.0.0.1";
  int main_process_port = 29500;
  bool use_cpu = false;
  bool multi_gpu = false;
  std::optional<std::string> gpu_ids;
  std::string mixed_precision = "no";
  std::optional<int> gradient_accumulation_steps;
  int num_cpu_threads_per_process = 1;
  bool debug = false;
  bool enable_cpu_affinity = false;
  int max_restarts = 0;
  double monitor_interval = 0.1;
  double rdzv_timeout = 900;
  double grace_period = 5;
  std::optional<std::string> log_dir;
  int tee = 3;
  std::string backend;
  /// With backend "mpi": the workers are started by this mpirun, on the machines of the host
  /// file when there is one.
  std::string mpirun;
  std::optional<std::string> mpirun_hostfile;
  /// The secret every process of the job shows the rendezvous store: from --rdzv_secret_file or
  /// ACCELERATE_RDZV_SECRET (required on several machines); empty on one machine, where
  /// `launch_command` makes a fresh one.
  std::string rdzv_secret;
  bool use_fsdp = false;
  /// The `FSDP_*` variables of the workers (flags over the config file's `fsdp_config`).
  std::map<std::string, std::string> fsdp_environment;
  /// The `PARALLELISM_CONFIG_*` variables of the workers (flags over the config file's
  /// `parallelism_config`); empty without one.
  std::map<std::string, std::string> parallelism_environment;
  bool quiet = false;
  std::vector<std::string> command;  ///< the program and its arguments
};

/// Merges `args` over the config file (`--config_file`, else the default file when it exists)
/// and defaults; throws `c10::ValueError` for inconsistent or unsupported settings.
LaunchPlan resolve_launch(const LaunchArgs& args);

/// The environment variables a launcher sets for the worker of local index `local_rank`, on top
/// of its own environment (`master_port` is the port actually served).
std::map<std::string, std::string> worker_environment(const LaunchPlan& plan, int local_rank, int master_port,
                                                      int restart_count);

/// Runs the job and returns the launcher's exit code: 0 when every worker succeeded, else the
/// failing worker's exit code (128 + signal number when it was killed by a signal).
int launch_command(const LaunchPlan& plan);

/// `accelerate launch <argv>`: parse, resolve, run; prints errors and returns the exit code.
int launch_main(const std::vector<std::string>& argv);

}  // namespace accelerate::commands
