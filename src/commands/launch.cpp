// `accelerate launch`: flags, configuration merging, the worker environment and the restart
// loop; see include/accelerate/commands/launch.h. Supervision itself is in detail/launcher.cpp.
#include "accelerate/commands/launch.h"

#include "accelerate/utils/environment.h"
#include "build_config.h"
#include "detail/check.h"
#include "detail/devices.h"
#include "detail/env.h"
#include "detail/files.h"
#include "detail/launcher.h"
#include "detail/network.h"
#include "detail/store_connection.h"
#include "detail/store_server.h"
#include "detail/subprocess.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <thread>
#include <sys/stat.h>
#include <unistd.h>

namespace accelerate::commands {
namespace {

namespace fs = std::filesystem;

// Registers "--name" together with its hyphenated spelling "--na-me".
std::string spellings(const std::string& name, const std::string& short_name = "") {
  std::string hyphenated = name;
  std::replace(hyphenated.begin(), hyphenated.end(), '_', '-');
  std::string out = short_name.empty() ? "" : short_name + ",";
  out += "--" + name;
  if (hyphenated != name) out += ",--" + hyphenated;
  return out;
}

template <typename T>
void add_optional(CLI::App& app, std::optional<T>& target, const std::string& name, const std::string& help,
                  const std::string& short_name = "") {
  app.add_option_function<T>(spellings(name, short_name), [&target](const T& value) { target = value; }, help);
}

struct LaunchCli {
  CLI::App app{"Launch a program on one or several processes, with the distributed environment set up.",
               "accelerate launch"};
  LaunchArgs args;
  LaunchCli() {
    app.set_help_flag("-h,--help", "Show this help and exit");
    app.prefix_command();  // everything from the program on belongs to the program
    add_optional(app, args.config_file, "config_file", "Configuration file (default: the `accelerate config` one)");
    app.add_flag(spellings("cpu"), args.cpu, "Run on the CPU even when GPUs are available");
    app.add_flag(spellings("multi_gpu"), args.multi_gpu, "Run one process per GPU");
    add_optional(app, args.mixed_precision, "mixed_precision", "no, fp16 or bf16");
    add_optional(app, args.num_processes, "num_processes", "Total number of processes of the job", "-n");
    add_optional(app, args.num_machines, "num_machines", "Number of machines of the job");
    add_optional(app, args.machine_rank, "machine_rank", "Index of this machine in the job");
    add_optional(app, args.main_process_ip, "main_process_ip", "Address of the machine of rank 0");
    add_optional(app, args.main_process_port, "main_process_port",
                 "Port of the rendezvous on the machine of rank 0 (0 picks a free port)");
    add_optional(app, args.gpu_ids, "gpu_ids", "Comma-separated GPU ids to use (CUDA_VISIBLE_DEVICES)");
    add_optional(app, args.num_cpu_threads_per_process, "num_cpu_threads_per_process",
                 "CPU threads per process (OMP_NUM_THREADS); default: cores / local processes");
    add_optional(app, args.gradient_accumulation_steps, "gradient_accumulation_steps",
                 "Gradient accumulation steps passed to Accelerator");
    add_optional(app, args.backend, "backend",
                 "Process-group back-end: gloo, nccl or mpi (mpi starts the workers through mpirun)");
    add_optional(app, args.mpirun_hostfile, "mpirun_hostfile",
                 "Host file of the machines mpirun starts the workers on (implies --backend mpi)");
    add_optional(app, args.rdzv_secret_file, "rdzv_secret_file",
                 "File holding the job's rendezvous secret, the same on every machine (else ACCELERATE_RDZV_SECRET; "
                 "one machine makes its own)");
    app.add_flag(spellings("debug"), args.debug, "Check every collective's shapes across processes");
    app.add_flag(spellings("enable_cpu_affinity"), args.enable_cpu_affinity, "Bind each process to a NUMA node");
    app.add_option(spellings("max_restarts"), args.max_restarts, "Restart the group this many times on failure");
    app.add_option(spellings("monitor_interval"), args.monitor_interval, "Seconds between health checks");
    app.add_option(spellings("rdzv_timeout"), args.rdzv_timeout, "Seconds the processes wait for each other to join");
    app.add_option(spellings("grace_period"), args.grace_period,
                   "Seconds between SIGTERM and SIGKILL when stopping workers");
    add_optional(app, args.log_dir, "log_dir", "Write each worker's output to files in this folder");
    add_optional(app, args.tee, "tee",
                 "With --log_dir, streams also shown on the console: 0 none, 1 stdout, 2 stderr, 3 both", "-t");
    app.add_flag(spellings("use_fsdp"), args.use_fsdp, "Shard prepared models over the processes (FSDP)");
    for (const auto& [key, variable] : fsdp_config_keys()) {
      const std::string name = key;
      app.add_option_function<std::string>(
          spellings(key), [this, name](const std::string& value) { args.fsdp[name] = value; },
          "FSDP setting (sets " + variable + "; see FullyShardedDataParallelPlugin)");
    }
    app.add_flag(spellings("use_parallelism_config"), args.use_parallelism_config,
                 "Give the Accelerator a ParallelismConfig from the --parallelism_config_* flags (needs --use_fsdp)");
    for (const auto& [key, variable] : parallelism_config_keys()) {
      const std::string name = key;
      app.add_option_function<std::string>(
          spellings(key), [this, name](const std::string& value) { args.parallelism[name] = value; },
          "ParallelismConfig size (sets " + variable + ")");
    }
    app.add_flag(spellings("no_python"), args.no_python, "Run the program directly, even a .py file");
    app.add_flag(spellings("module", "-m"), args.module, "Run the program as a Python module (python3 -m)");
    app.add_flag(spellings("quiet", "-q"), args.quiet, "Only print the launcher's own errors");
  }
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}


// Note [MPI by default]
// On one machine, CPU processes communicate much faster through MPI's shared memory than through
// Gloo's loopback TCP (bench/: a 4 KiB allreduce ~15 us against ~400 us; the 2-process MLP step
// 1.3-1.6x faster), so a CPU job of several processes on one machine runs on MPI when the build
// has it and mpirun is installed. Jobs of one launcher per machine, GPU jobs and builds without
// MPI keep Gloo (or NCCL); `--backend` or ACCELERATE_BACKEND chooses explicitly.
bool mpi_is_the_default(const LaunchPlan& plan) {
  if (plan.num_processes < 2 || plan.num_machines != 1 || plan.multi_gpu) return false;
  if (!is_mpi_available()) return false;
  if (!plan.use_cpu && detail::visible_cuda_devices() > 0) return false;
  try {
    (void)detail::resolve_program("mpirun");
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// Checks what the MPI back-end needs and finds mpirun.
void resolve_mpirun(LaunchPlan& plan) {
  ACCELERATE_CHECK_VALUE(is_mpi_available(),
                         "[launch] --backend mpi: the MPI back-end is not available in this build of "
                         "accelerate-cpp (it was built without MPI; install libopenmpi-dev and rebuild)");
  ACCELERATE_CHECK_VALUE(!plan.multi_gpu,
                         "[launch] --backend mpi handles CPU tensors only; use --cpu, or nccl for GPUs");
  if (plan.num_machines > 1) {
    ACCELERATE_CHECK_VALUE(plan.mpirun_hostfile.has_value(), "[launch] --backend mpi on ", plan.num_machines,
                           " machines needs --mpirun_hostfile, the machines mpirun starts the workers on");
    ACCELERATE_CHECK_VALUE(plan.machine_rank == 0,
                           "[launch] with --backend mpi, mpirun starts the workers of every "
                           "machine: run accelerate launch once, on the machine of rank 0 (--machine_rank 0)");
  }
  if (plan.mpirun_hostfile) {
    ACCELERATE_CHECK_VALUE(fs::is_regular_file(*plan.mpirun_hostfile), "[launch] --mpirun_hostfile ",
                           *plan.mpirun_hostfile, " is not a readable file");
  }
  try {
    plan.mpirun = detail::resolve_program("mpirun");
  } catch (const std::exception&) {
    ACCELERATE_CHECK_VALUE(std::string(ACCELERATE_MPIEXEC).size() > 0 && fs::exists(ACCELERATE_MPIEXEC),
                           "[launch] --backend mpi needs mpirun, which is not on PATH (Debian: openmpi-bin)");
    plan.mpirun = ACCELERATE_MPIEXEC;
  }
}

// Note [Workers under mpirun]
// With the MPI back-end, mpirun starts the workers, so they are not the launcher's children.
// mpirun runs a small wrapper script per rank, which sets the same RANK/LOCAL_RANK/... variables
// as for other workers (from mpirun's own) and keeps the launcher's guarantees:
//  * the worker's stdout and stderr go to named pipes of its rank, which the launcher relays
//    with the usual "[rankN]: " prefix (mpirun's own output gets "[mpirun]: ");
//  * it reports "start <rank> <pid>" and "exit <rank> <code>" on a status pipe, so the launcher
//    knows the first failure (the root cause) and can signal workers directly;
//  * the worker runs in its own process group (job control on), with default signal handling,
//    and dies with its wrapper (PR_SET_PDEATHSIG through setpriv); a watcher kills it when the
//    launcher itself is gone, so that no worker outlives a launcher killed with SIGKILL;
//  * the reports open the status pipe for reading and writing, which never blocks: a wrapper
//    whose launcher was killed (no reader left) still ends instead of waiting forever;
//  * once the worker runs, the wrapper's own stderr (which mpirun relays) goes nowhere and the
//    watcher leaves its job table, so that no job-control notice ("Terminated", "Killed")
//    reaches the user's output; the worker's fate reaches the launcher on the status pipe;
//  * when the worker has ended, the wrapper kills its watcher and waits (up to 2 s) until the
//    watcher's group is gone before it reports: a watcher still dying when mpirun ends would be
//    adopted by the launcher and stopped as one of the processes the workers left behind.
// The script is given to bash on its command line (`bash -c`), not as a file, since other
// machines have none of the launcher's files. There (a host file) the pipes do not exist
// either: the wrapper runs the program
// directly and mpirun relays its output and exit status.
constexpr const char* kMpiWrapper = R"(#!/bin/bash
dir=$1; launcher=$2; shift 2
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
size=${OMPI_COMM_WORLD_SIZE:-${PMI_SIZE:-1}}
local_size=${OMPI_COMM_WORLD_LOCAL_SIZE:-$size}
export RANK=$rank WORLD_SIZE=$size LOCAL_RANK=${OMPI_COMM_WORLD_LOCAL_RANK:-$rank} LOCAL_WORLD_SIZE=$local_size
export ROLE_RANK=$rank ROLE_WORLD_SIZE=$size GROUP_RANK=$((rank / local_size))
if [ ! -p "$dir/status" ]; then exec "$@"; fi
export ACCELERATE_ERROR_FILE="$dir/error.$rank"
set -m
setpriv --pdeathsig KILL -- "$@" </dev/null >"$dir/out.$rank" 2>"$dir/err.$rank" &
child=$!
exec 2>/dev/null
echo "start $rank $child" 1<>"$dir/status"
for sig in TERM INT HUP; do trap "kill -s $sig $child 2>/dev/null" $sig; done
( while kill -0 "$launcher" 2>/dev/null; do sleep 1; done; kill -s KILL "$child" ) </dev/null >/dev/null 2>&1 &
watcher=$!
disown "$watcher"
while :; do
  wait "$child"; code=$?
  kill -0 "$child" 2>/dev/null || break
done
kill -s KILL -- "-$watcher" 2>/dev/null  # the watcher and its sleep, gone before the report
for _ in {1..200}; do kill -0 -- "-$watcher" 2>/dev/null || break; sleep 0.01; done
echo "exit $rank $code" 1<>"$dir/status"
exit "$code"
)";

// The torchrun-style variables of one rank; under mpirun the ranks come from mpirun instead.
constexpr const char* kPerRankVariables[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                             "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE"};

// The variables every rank of an MPI job gets.
std::map<std::string, std::string> mpi_job_environment(const LaunchPlan& plan, int master_port, int restart_count) {
  auto env = worker_environment(plan, 0, master_port, restart_count);
  for (const char* key : kPerRankVariables) env.erase(key);
  env["ACCELERATE_BACKEND"] = "mpi";
  return env;
}

}  // namespace

LaunchArgs parse_launch_args(const std::vector<std::string>& argv) {
  LaunchCli cli;
  std::vector<std::string> reversed(argv.rbegin(), argv.rend());  // CLI11 takes them last-first
  try {
    cli.app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    LaunchArgs help;
    help.help = true;
    return help;
  } catch (const CLI::ParseError& e) {
    detail::raise_value_error(detail::concat("[launch] ", e.what(), " (see `accelerate launch --help`)"));
  }
  auto rest = cli.app.remaining();
  // Upstream's flags of Python-only integrations are named as such (docs/porting.md says what to
  // use instead), rather than as unknown.
  if (!rest.empty()) {
    static const std::vector<std::pair<std::string, std::string>> python_only = {
        {"--use_deepspeed", "DeepSpeed"},   {"--deepspeed_", "DeepSpeed"},     {"--zero_stage", "DeepSpeed"},
        {"--use_megatron_lm", "Megatron-LM"},
        {"--megatron_lm_", "Megatron-LM"},  {"--dynamo_", "TorchDynamo"},      {"--tpu", "XLA/TPU"},
        {"--use_xpu", "XPU"},               {"--ipex", "IPEX"},                {"--fp8_", "FP8 recipes"},
        {"--parallelism_config_", "parallelism_config's context and sequence parallelism"}};
    const std::string given = rest.front().substr(0, rest.front().find('='));
    std::string flag = given;  // upstream takes --use-deepspeed for --use_deepspeed
    if (flag.rfind("--", 0) == 0) std::replace(flag.begin() + 2, flag.end(), '-', '_');
    for (const auto& [prefix, feature] : python_only) {
      const bool matches = prefix.back() == '_' ? flag.rfind(prefix, 0) == 0 : flag == prefix || flag.rfind(prefix + "_", 0) == 0;
      ACCELERATE_CHECK_VALUE(
          !matches, "[launch] '", given, "' configures ", feature,
          ", a Python-only integration that accelerate-cpp does not support (docs/porting.md says what "
          "to use instead)");
    }
  }
  // Everything from the program on is left unparsed, so a mistyped flag would otherwise be taken
  // for the program's name.
  ACCELERATE_CHECK_VALUE(rest.empty() || rest.front().empty() || rest.front()[0] != '-', "[launch] unknown flag '",
                         rest.empty() ? "" : rest.front(), "' (see `accelerate launch --help`)");
  if (!rest.empty()) {
    cli.args.training_script = rest.front();
    cli.args.training_script_args.assign(rest.begin() + 1, rest.end());
  }
  return cli.args;
}

std::string launch_help() {
  LaunchCli cli;
  return cli.app.help() + "\nUsage: accelerate launch [options] <program> [program arguments...]\n";
}

LaunchPlan resolve_launch(const LaunchArgs& args) {
  std::optional<ClusterConfig> config;
  if (args.config_file) {
    config = load_config_from_file(*args.config_file);
  } else if (fs::is_regular_file(default_config_file())) {
    config = load_config_from_file(default_config_file());
  }

  LaunchPlan plan;
  plan.num_processes = args.num_processes.value_or(config ? config->num_processes : 1);
  plan.num_machines = args.num_machines.value_or(config ? config->num_machines : 1);
  plan.machine_rank = args.machine_rank.value_or(config ? config->machine_rank : 0);
  const auto config_ip = config ? config->main_process_ip : std::nullopt;
  const std::optional<std::string> ip = args.main_process_ip ? args.main_process_ip : config_ip;
  plan.main_process_ip = ip.value_or("127.0.0.1");
  plan.main_process_port = args.main_process_port.value_or(
      config && config->main_process_port ? *config->main_process_port : 29500);
  plan.multi_gpu = args.multi_gpu || (!args.cpu && config && config->distributed_type == DistributedType::kMultiGpu);
  plan.use_cpu = args.cpu || (!args.multi_gpu && config && config->use_cpu);
  plan.gpu_ids = args.gpu_ids ? args.gpu_ids : (config ? config->gpu_ids : std::nullopt);
  plan.mixed_precision = args.mixed_precision.value_or(config ? config->mixed_precision : "no");
  plan.mixed_precision = to_string(parse_precision_type(plan.mixed_precision));
  plan.gradient_accumulation_steps = args.gradient_accumulation_steps;
  plan.debug = args.debug || (config && config->debug);
  plan.enable_cpu_affinity = args.enable_cpu_affinity || (config && config->enable_cpu_affinity);
  plan.max_restarts = args.max_restarts;
  plan.monitor_interval = args.monitor_interval;
  plan.rdzv_timeout = args.rdzv_timeout;
  plan.grace_period = args.grace_period;
  plan.log_dir = args.log_dir;
  // ACCELERATE_BACKEND, which the workers read too, is the default of --backend.
  plan.backend = args.backend.value_or(get_env("ACCELERATE_BACKEND").value_or(""));
  plan.quiet = args.quiet;
  plan.use_fsdp = args.use_fsdp || !args.fsdp.empty() || (config && config->use_fsdp);
  if (plan.use_fsdp) {
    std::map<std::string, std::string> settings = config ? config->fsdp_config : std::map<std::string, std::string>{};
    for (const auto& [key, value] : args.fsdp) {
      check_fsdp_value(key, value, "launch");
      settings[key] = value;
    }
    for (const auto& [key, variable] : fsdp_config_keys()) {
      auto it = settings.find(key);
      if (it != settings.end()) plan.fsdp_environment[variable] = it->second;
    }
  }

  std::map<std::string, std::string> parallelism =
      config ? config->parallelism_config : std::map<std::string, std::string>{};
  for (const auto& [key, value] : args.parallelism) {
    check_parallelism_value(key, value, "launch");
    parallelism[key] = value;
  }
  if (args.use_parallelism_config || !parallelism.empty()) {
    ACCELERATE_CHECK_VALUE(plan.use_fsdp, "[launch] --use_parallelism_config (and the parallelism_config settings) "
                           "needs --use_fsdp: its data-parallel sizes shard models");
    plan.parallelism_environment["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true";
    for (const auto& [key, variable] : parallelism_config_keys()) {
      auto it = parallelism.find(key);
      if (it != parallelism.end()) plan.parallelism_environment[variable] = it->second;
    }
  }

  ACCELERATE_CHECK_VALUE(plan.num_processes >= 1, "[launch] --num_processes must be at least 1, got ",
                         plan.num_processes);
  ACCELERATE_CHECK_VALUE(plan.num_machines >= 1, "[launch] --num_machines must be at least 1, got ", plan.num_machines);
  ACCELERATE_CHECK_VALUE(plan.machine_rank >= 0 && plan.machine_rank < plan.num_machines, "[launch] --machine_rank ",
                         plan.machine_rank, " is outside [0, --num_machines=", plan.num_machines, ")");
  ACCELERATE_CHECK_VALUE(plan.num_processes % plan.num_machines == 0, "[launch] --num_processes (", plan.num_processes,
                         ", the total over all machines) must be a multiple of --num_machines (", plan.num_machines,
                         ")");
  plan.local_num_processes = plan.num_processes / plan.num_machines;
  if (!plan.parallelism_environment.empty()) {
    const auto size = [&](const char* variable, int fallback) {
      auto it = plan.parallelism_environment.find(variable);
      return it == plan.parallelism_environment.end() ? fallback : std::stoi(it->second);
    };
    const int replicate = size("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", 1);
    const int shard = size("PARALLELISM_CONFIG_DP_SHARD_SIZE", std::max(1, plan.num_processes / replicate));
    ACCELERATE_CHECK_VALUE(replicate * shard == plan.num_processes, "[launch] parallelism_config: dp_replicate_size (",
                           replicate, ") x dp_shard_size (", shard, ") must equal --num_processes (",
                           plan.num_processes, ")");
  }
  ACCELERATE_CHECK_VALUE(plan.main_process_port >= 0 && plan.main_process_port <= 65535,
                         "[launch] --main_process_port must be a TCP port (0-65535), got ", plan.main_process_port);
  if (plan.num_machines > 1) {
    ACCELERATE_CHECK_VALUE(ip.has_value(), "[launch] a job on ", plan.num_machines,
                           " machines needs --main_process_ip, the address of the machine of rank 0");
    ACCELERATE_CHECK_VALUE(plan.main_process_port != 0,
                           "[launch] a job on several machines needs a fixed "
                           "--main_process_port that every machine knows (0 picks a random one)");
  }
  ACCELERATE_CHECK_VALUE(!(args.cpu && args.multi_gpu), "[launch] --cpu and --multi_gpu exclude each other");
  ACCELERATE_CHECK_VALUE(!plan.multi_gpu || detail::visible_cuda_devices() > 0,
                         "[launch] --multi_gpu (or distributed_type MULTI_GPU in the config) needs CUDA devices, but ",
                         ACCELERATE_HAVE_CUDA ? "the CUDA driver reports none visible here"
                                              : "this build of accelerate-cpp has no CUDA (its LibTorch is CPU-only)",
                         "; use --cpu");
  ACCELERATE_CHECK_VALUE(plan.monitor_interval > 0, "[launch] --monitor_interval must be positive, got ",
                         plan.monitor_interval);
  ACCELERATE_CHECK_VALUE(plan.rdzv_timeout > 0, "[launch] --rdzv_timeout must be positive, got ", plan.rdzv_timeout);
  ACCELERATE_CHECK_VALUE(plan.grace_period >= 0, "[launch] --grace_period must not be negative, got ",
                         plan.grace_period);
  ACCELERATE_CHECK_VALUE(plan.max_restarts >= 0, "[launch] --max_restarts must not be negative, got ",
                         plan.max_restarts);
  ACCELERATE_CHECK_VALUE(!plan.gradient_accumulation_steps || *plan.gradient_accumulation_steps >= 1,
                         "[launch] --gradient_accumulation_steps must be at least 1, got ",
                         plan.gradient_accumulation_steps.value_or(0));
  ACCELERATE_CHECK_VALUE(
      plan.backend.empty() || plan.backend == "gloo" || plan.backend == "nccl" || plan.backend == "mpi",
      "[launch] --backend must be gloo, nccl or mpi, got '", plan.backend, "'");
  plan.mpirun_hostfile = args.mpirun_hostfile ? args.mpirun_hostfile : (config ? config->mpirun_hostfile : std::nullopt);
  if (plan.mpirun_hostfile && plan.backend.empty()) plan.backend = "mpi";
  if (plan.backend.empty() && mpi_is_the_default(plan)) plan.backend = "mpi";
  if (plan.backend == "mpi") resolve_mpirun(plan);
  // Note [The job's secret]: every process of a job shows the rendezvous store the same
  // secret (Note [The job's store]). A launcher on one machine makes one for its workers; the
  // launchers of a job on several machines must be given the same one.
  if (args.rdzv_secret_file) {
    std::string text;
    try {
      text = detail::read_file(*args.rdzv_secret_file);
    } catch (const std::exception& e) {
      detail::raise_value_error(detail::concat("[launch] --rdzv_secret_file: ", e.what()));
    }
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ')) text.pop_back();
    ACCELERATE_CHECK_VALUE(!text.empty(), "[launch] --rdzv_secret_file ", *args.rdzv_secret_file, " is empty");
    plan.rdzv_secret = text;
  } else if (auto secret = get_env("ACCELERATE_RDZV_SECRET"); secret && !secret->empty()) {
    plan.rdzv_secret = *secret;
  }
  ACCELERATE_CHECK_VALUE(
      plan.num_machines == 1 || !plan.rdzv_secret.empty() || plan.backend == "mpi", "[launch] a job on ",
      plan.num_machines,
      " machines needs a secret that every machine's launcher knows, so that the "
      "rendezvous lets in only this job: put the same one in ACCELERATE_RDZV_SECRET or in a file given "
      "with --rdzv_secret_file on every machine (e.g. `openssl rand -hex 16`)");
  ACCELERATE_CHECK_VALUE(!plan.mpirun_hostfile || plan.backend == "mpi",
                         "[launch] --mpirun_hostfile (or mpirun_config in "
                         "the config file) starts the workers through mpirun, which needs --backend mpi, not ",
                         plan.backend);
  if (args.tee) {
    const std::string& t = *args.tee;
    ACCELERATE_CHECK_VALUE(t.size() == 1 && t[0] >= '0' && t[0] <= '3', "[launch] --tee must be 0, 1, 2 or 3, got '", t,
                           "'");
    plan.tee = t[0] - '0';
  }
  if (args.num_cpu_threads_per_process) {
    ACCELERATE_CHECK_VALUE(*args.num_cpu_threads_per_process >= 1,
                           "[launch] --num_cpu_threads_per_process must be at "
                           "least 1, got ",
                           *args.num_cpu_threads_per_process);
    plan.num_cpu_threads_per_process = *args.num_cpu_threads_per_process;
  } else if (auto omp = get_env("OMP_NUM_THREADS"); omp && !omp->empty()) {
    plan.num_cpu_threads_per_process = get_int_from_env({"OMP_NUM_THREADS"}, 1);
  } else {
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    plan.num_cpu_threads_per_process = std::max(1, cores / plan.local_num_processes);
  }

  ACCELERATE_CHECK_VALUE(!args.training_script.empty(),
                         "[launch] no program to run was given: accelerate launch [options] <program> [args...]");
  const bool python = !args.no_python && (args.module || ends_with(args.training_script, ".py"));
  if (python) {
    plan.command = {detail::resolve_program("python3")};
    if (args.module) plan.command.push_back("-m");
    plan.command.push_back(args.training_script);
  } else {
    plan.command = {detail::resolve_program(args.training_script)};
  }
  plan.command.insert(plan.command.end(), args.training_script_args.begin(), args.training_script_args.end());
  return plan;
}

std::map<std::string, std::string> worker_environment(const LaunchPlan& plan, int local_rank, int master_port,
                                                      int restart_count) {
  const int rank = plan.machine_rank * plan.local_num_processes + local_rank;
  std::map<std::string, std::string> env = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(plan.num_processes)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(plan.local_num_processes)},
      {"GROUP_RANK", std::to_string(plan.machine_rank)},
      {"ROLE_RANK", std::to_string(rank)},
      {"ROLE_WORLD_SIZE", std::to_string(plan.num_processes)},
      {"MASTER_ADDR", plan.main_process_ip},
      {"MASTER_PORT", std::to_string(master_port)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart_count)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(plan.max_restarts)},
      {"ACCELERATE_MIXED_PRECISION", plan.mixed_precision},
      {"ACCELERATE_DEBUG_MODE", plan.debug ? "true" : "false"},
      {"ACCELERATE_USE_CPU", plan.use_cpu ? "true" : "false"},
      {"ACCELERATE_RDZV_TIMEOUT", std::to_string(plan.rdzv_timeout)},
      {"OMP_NUM_THREADS", std::to_string(plan.num_cpu_threads_per_process)},
      {"OPENBLAS_NUM_THREADS", std::to_string(plan.num_cpu_threads_per_process)},
      {"MKL_NUM_THREADS", std::to_string(plan.num_cpu_threads_per_process)},
      // Every line a worker writes gets "[rankN]: " from the launcher (loggers then add no rank).
      {"ACCELERATE_LAUNCH_PREFIXES_OUTPUT", "1"},
  };
  if (plan.num_processes > 1) env["ACCELERATE_STORE_HOSTED"] = "1";
  if (!plan.rdzv_secret.empty()) env["ACCELERATE_RDZV_SECRET"] = plan.rdzv_secret;
  if (plan.gradient_accumulation_steps) {
    env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = std::to_string(*plan.gradient_accumulation_steps);
  }
  if (plan.enable_cpu_affinity) env["ACCELERATE_CPU_AFFINITY"] = "1";
  if (plan.use_fsdp) {
    env["ACCELERATE_USE_FSDP"] = "true";
    for (const auto& [variable, value] : plan.fsdp_environment) env[variable] = value;
  }
  for (const auto& [variable, value] : plan.parallelism_environment) env[variable] = value;
  if (!plan.backend.empty()) env["ACCELERATE_BACKEND"] = plan.backend;
  if (plan.gpu_ids && *plan.gpu_ids != "all") env["CUDA_VISIBLE_DEVICES"] = *plan.gpu_ids;
  return env;
}

namespace {

detail::SuperviseOptions supervise_options(const LaunchPlan& plan, int attempt) {
  detail::SuperviseOptions options;
  options.monitor_interval = plan.monitor_interval;
  options.grace_period = plan.grace_period;
  options.log_dir = plan.log_dir;
  options.tee = plan.tee;
  options.attempt = attempt;
  options.quiet = plan.quiet;
  return options;
}

// One attempt of an MPI job; see Note [Workers under mpirun]. Returns the exit code when the
// launcher is done, or minus the exit code when the job is to be restarted.
int run_mpi_attempt(const LaunchPlan& plan, detail::Supervisor& supervisor,
                    const std::map<std::string, std::string>& base, const fs::path& scratch, int port, int attempt) {
  const fs::path dir = scratch / ("attempt_" + std::to_string(attempt));
  fs::create_directories(dir);
  auto make_fifo = [](const fs::path& path) {
    ACCELERATE_CHECK(::mkfifo(path.c_str(), 0600) == 0, "[launch] cannot create the pipe ", path.string(), ": ",
                     std::strerror(errno));
  };
  detail::CarrierSpec carrier;
  carrier.status_pipe = (dir / "status").string();
  make_fifo(carrier.status_pipe);
  std::vector<detail::WorkerSpec> specs(plan.num_processes);
  for (int rank = 0; rank < plan.num_processes; ++rank) {
    auto& spec = specs[rank];
    spec.rank = rank;
    spec.local_rank = rank % plan.local_num_processes;
    spec.argv = plan.command;
    spec.error_file = (dir / ("error." + std::to_string(rank))).string();
    spec.stdout_pipe = (dir / ("out." + std::to_string(rank))).string();
    spec.stderr_pipe = (dir / ("err." + std::to_string(rank))).string();
    make_fifo(spec.stdout_pipe);
    make_fifo(spec.stderr_pipe);
  }
  auto env = base;
  const auto job = mpi_job_environment(plan, port, attempt);
  for (const auto& [k, v] : job) env[k] = v;
  for (const char* key : kPerRankVariables) env.erase(key);
  if (::geteuid() == 0) {  // Open MPI refuses root unless told twice
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1";
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1";
  }
  for (const auto& [k, v] : env) carrier.env.push_back(k + "=" + v);
  carrier.argv = {plan.mpirun, "-np", std::to_string(plan.num_processes), "--bind-to", "none"};
  // Open MPI 5 and later (PRRTE's prterun beside mpirun) renamed settings the launcher passes.
  const bool prrte = fs::exists(fs::path(plan.mpirun).parent_path() / "prterun");
  if (plan.mpirun_hostfile) {
    carrier.argv.insert(carrier.argv.end(), {"--hostfile", *plan.mpirun_hostfile});
    for (const auto& [k, v] : job) carrier.argv.insert(carrier.argv.end(), {"-x", k});
    // Note [The network MPI uses]: across machines, Open MPI's own connections (its daemons' and
    // the TCP transport's) take the network this machine reaches the main process through, as
    // Gloo does (Note [The address Gloo announces]); Open MPI's default tries every interface,
    // bridges and container networks included, and can hang on one the other machines do not
    // share. The user's own choice (OMPI_MCA_*_if_include / _exclude) is left alone.
    // Open MPI 5 and later start their daemons with PRRTE, which calls the daemons' setting
    // prte_if_include and warns on every job about oob_tcp_if_include.
    if (!detail::is_loopback_address(plan.main_process_ip)) {
      const std::string network =
          detail::network_of_address(detail::source_address_towards(plan.main_process_ip, port));
      // Whether the user set `<prefix>_if_include` or `_if_exclude` themselves.
      auto chosen = [&](const std::string& prefix) {
        return env.count(prefix + "_if_include") > 0 || env.count(prefix + "_if_exclude") > 0;
      };
      if (!network.empty() && !chosen("OMPI_MCA_btl_tcp")) {
        carrier.argv.insert(carrier.argv.end(), {"--mca", "btl_tcp_if_include", network});
      }
      if (!network.empty() && !chosen("OMPI_MCA_oob_tcp") && !chosen("PRTE_MCA_prte")) {
        carrier.argv.insert(carrier.argv.end(), {"--mca", prrte ? "prte_if_include" : "oob_tcp_if_include", network});
      }
    }
  } else {
    carrier.argv.push_back("--oversubscribe");  // more processes than cores is the user's choice
    // Note [MPI's start on one machine]: MPI_Init took 0.26 s in every worker (Open MPI 4.1,
    // two processes), 0.20 s of it opening the "cm" messaging layer, whose libfabric providers
    // look for network hardware, only for Open MPI to pick "ob1" (shared memory) on one machine
    // anyway. Naming ob1 skips that search: MPI_Init takes 0.06 s, and what the job runs on is
    // the same. The user's own choice (OMPI_MCA_pml) is left alone; jobs over a host file keep
    // Open MPI's choice, which may be a faster network there.
    if (env.count("OMPI_MCA_pml") == 0) carrier.argv.insert(carrier.argv.end(), {"--mca", "pml", "ob1"});
    // Note [Only shared memory on one machine]: every peer is on this machine, so the workers
    // open only the shared-memory transport and the one to themselves ("vader", named "sm" from
    // Open MPI 5 on), not the network ones, which have nobody to reach. Open MPI 5 still opened TCP,
    // and on some machines every worker then printed "Unable to find reachable pairing between
    // local and remote interfaces" at its first collective; and the libfabric ("ofi") and TCP
    // transports left memory hooks behind that crashed the thread sanitizer's build when a
    // thread ended. The user's own choice (OMPI_MCA_btl) is left alone.
    if (env.count("OMPI_MCA_btl") == 0) {
      carrier.argv.insert(carrier.argv.end(), {"--mca", "btl", prrte ? "self,sm" : "self,vader"});
    }
  }
  // The script travels in the command line: other machines have no copy of the launcher's files.
  carrier.argv.insert(carrier.argv.end(),
                      {"bash", "-c", kMpiWrapper, "accelerate-worker", dir.string(), std::to_string(::getpid())});
  carrier.argv.insert(carrier.argv.end(), plan.command.begin(), plan.command.end());

  auto result = supervisor.run(specs, supervise_options(plan, attempt), &carrier);
  if (result.exit_code == 0 || result.interrupted || attempt >= plan.max_restarts) return result.exit_code;
  return -result.exit_code;
}

// Note [A machine that comes back]
// With --max_restarts, the launchers of a job on several machines restart their workers
// together: each counts its attempts, and the workers of attempt N meet under the store keys of
// attempt N. A machine that died and is started again (a new launcher, counting from 0) would
// meet nobody. So the launcher of machine 0, which serves the store, publishes the attempt it is
// starting under kAttemptKey, and the launcher of any other machine reads it before each of its
// attempts and joins the later one: the restarted workers of machine 0, waiting for the others
// at their rendezvous (--rdzv_timeout), are joined by those of the machine that came back. An
// attempt that already has all its processes (the one that just failed, while machine 0 tears it
// down) is not joined: the launcher waits, up to --rdzv_timeout, for machine 0 to start the next.
// The job's restart budget is shared: the attempt a launcher joins counts against its
// --max_restarts.
// A machine 0 that dies takes the store with it, and the job with it (as with torchrun's static
// rendezvous). MPI jobs are restarted by machine 0's launcher alone.
constexpr const char* kAttemptKey = "accelerate/launcher_attempt";

// The attempt a launcher of another machine runs, given its own count: machine 0's when that is
// later and still takes processes (Note [A machine that comes back]). When machine 0 cannot be
// asked, its own count (the workers then report what is wrong with the store).
int attempt_to_join(const LaunchPlan& plan, int port, int own) {
  namespace proto = detail::store_protocol;
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(plan.rdzv_timeout));
  std::unique_ptr<detail::StoreConnection> store;
  int published = 0;
  try {
    store = std::make_unique<detail::StoreConnection>(plan.main_process_ip, port, plan.rdzv_secret,
                                                      std::chrono::seconds(5));
    while (true) {
      const auto found = store->request(proto::Op::kCheck, {kAttemptKey}, std::chrono::seconds(5));
      if (found.size() == 1 && found[0] == "1") {
        const auto value = store->request(proto::Op::kGet, {kAttemptKey}, std::chrono::seconds(5));
        if (value.size() == 1) published = std::stoi(value[0]);
      }
      if (own > published) return own;  // machine 0 will come to it
      const std::string full = "accelerate/attempt" + std::to_string(published) + "/joined/complete";
      const auto taken = store->request(proto::Op::kCheck, {full}, std::chrono::seconds(5));
      if (taken.size() != 1 || taken[0] != "1") return published;
      if (std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  } catch (const std::exception&) {
    return std::max(own, published);
  }
  detail::raise_error(detail::concat(
      "[launch] the job's attempt ", published, " already has all its ", plan.num_processes,
      " processes, and the launcher of machine 0 started no other within --rdzv_timeout (", plan.rdzv_timeout,
      "s): it has no restart left (--max_restarts), or this machine's launcher runs twice"));
}

}  // namespace

int launch_command(const LaunchPlan& given) {
  LaunchPlan plan = given;
  if (plan.rdzv_secret.empty() && plan.num_processes > 1) plan.rdzv_secret = detail::new_job_secret();
  // Signals are blocked before the store starts its thread; see Supervisor.
  detail::Supervisor supervisor;
  std::unique_ptr<detail::StoreServer> store;
  int port = plan.main_process_port;
  if (plan.num_processes > 1 && plan.machine_rank == 0) {
    store = std::make_unique<detail::StoreServer>(
        detail::store_bind_address(plan.main_process_ip, plan.num_machines > 1), port, plan.rdzv_secret,
        [](const std::string& line) { std::cerr << "accelerate launch: " + line + "\n" << std::flush; });
    port = store->port();
  }

  // The launcher's scratch folder (pipes of the MPI wrappers, error files), under TMPDIR.
  std::string tmp_root = get_env("TMPDIR").value_or("");
  if (tmp_root.empty()) tmp_root = "/tmp";
  std::string tmpl = tmp_root + "/accelerate-launch-XXXXXX";
  const char* tmp = ::mkdtemp(tmpl.data());
  ACCELERATE_CHECK(tmp != nullptr, "[launch] cannot create a temporary folder in ", tmp_root, ": ",
                   std::strerror(errno));
  const fs::path scratch(tmp);
  // Removed however the launcher leaves this function: an error thrown by a later attempt's
  // rendezvous or by mpirun's start must not leave the folder behind.
  struct RemovedOnExit {
    fs::path path;
    ~RemovedOnExit() { (void)detail::try_remove_tree(path); }
  } remove_scratch{scratch};

  // The inherited environment, minus what the contract sets per worker.
  std::map<std::string, std::string> base;
  for (auto& [key, value] : detail::environment_entries()) base.emplace(std::move(key), std::move(value));
  base.erase("ACCELERATE_ERROR_FILE");

  // Note [A machine that comes back].
  const bool restarts_together = plan.num_machines > 1 && plan.max_restarts > 0 && plan.backend != "mpi";
  std::unique_ptr<detail::StoreConnection> publisher;
  if (restarts_together && store) {
    publisher = std::make_unique<detail::StoreConnection>(plan.main_process_ip, port, plan.rdzv_secret,
                                                          std::chrono::seconds(10));
  }

  int exit_code = 0;
  for (int attempt = 0;; ++attempt) {
    if (restarts_together && !store) {
      const int joined = attempt_to_join(plan, port, attempt);
      if (joined > attempt) {
        attempt = joined;
        if (!plan.quiet) {
          std::cerr << "accelerate launch: joining the job at restart " << attempt << " of " << plan.max_restarts
                    << ", where the launcher of machine 0 is" << std::endl;
        }
      }
    }
    if (publisher) {
      publisher->request(detail::store_protocol::Op::kSet, {kAttemptKey, std::to_string(attempt)},
                         std::chrono::seconds(10));
    }
    if (plan.backend == "mpi") {
      exit_code = run_mpi_attempt(plan, supervisor, base, scratch, port, attempt);
      if (exit_code >= 0) break;
      exit_code = -exit_code;
      if (!plan.quiet) std::cerr << "accelerate launch: restarting all " << plan.num_processes << " worker(s) (restart "
                << attempt + 1 << " of " << plan.max_restarts << ")" << std::endl;
      continue;
    }
    std::vector<detail::WorkerSpec> specs(plan.local_num_processes);
    for (int local = 0; local < plan.local_num_processes; ++local) {
      auto& spec = specs[local];
      spec.local_rank = local;
      spec.rank = plan.machine_rank * plan.local_num_processes + local;
      spec.argv = plan.command;
      spec.error_file = (scratch / ("error_" + std::to_string(attempt) + "_" + std::to_string(spec.rank))).string();
      auto env = base;
      for (auto& [k, v] : worker_environment(plan, local, port, attempt)) env[k] = v;
      env["ACCELERATE_ERROR_FILE"] = spec.error_file;
      for (auto& [k, v] : env) spec.env.push_back(k + "=" + v);
    }
    auto result = supervisor.run(specs, supervise_options(plan, attempt));
    exit_code = result.exit_code;
    if (exit_code == 0 || result.interrupted || attempt >= plan.max_restarts) break;
    if (!plan.quiet) std::cerr << "accelerate launch: restarting all " << plan.local_num_processes << " worker(s) (restart "
              << attempt + 1 << " of " << plan.max_restarts << ")" << std::endl;
  }
  return exit_code;
}

int launch_main(const std::vector<std::string>& argv) {
  try {
    LaunchArgs args = parse_launch_args(argv);
    if (args.help) {
      std::cout << launch_help();
      return 0;
    }
    return launch_command(resolve_launch(args));
  } catch (const std::exception& e) {
    std::cerr << "accelerate launch: error: " << detail::error_text(e) << std::endl;
    return 2;
  }
}

}  // namespace accelerate::commands
