// Planning a launch: the flags merged with the configuration file, the environment and the
// machine into a `LaunchPlan`, and each worker's environment (the torchrun contract).
#include "accelerate/commands/launch.h"

#include "build_config.h"

#include "accelerate/utils/environment.h"
#include "detail/check.h"
#include "detail/topology.h"
#include "detail/files.h"
#include "detail/subprocess.h"
#include "detail/text.h"
#include "launch/arguments.h"
#include "launch/devices.h"
#include "launch/mpi.h"

#include <climits>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <thread>

namespace accelerate::commands {
namespace {

namespace fs = std::filesystem;

// torchrun's --nnodes (N or MIN:MAX), over --num_machines.
void plan_elastic(const LaunchArgs& args, LaunchPlan& plan) {
  if (!args.nnodes) return;
  const std::string& text = *args.nnodes;
  const auto colon = text.find(':');
  auto number = [&](const std::string& part) {
    const auto n = detail::launch::parse_int(part, 1);
    ACCELERATE_CHECK_VALUE(n.has_value(), "[launch] --nnodes must be N or MIN:MAX, whole numbers from 1 to ", INT_MAX,
                           ", got '", text, "'");
    return *n;
  };
  const int min = number(text.substr(0, colon));
  const int max = colon == std::string::npos ? min : number(text.substr(colon + 1));
  ACCELERATE_CHECK_VALUE(min <= max, "[launch] --nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got '", text, "'");
  ACCELERATE_CHECK_VALUE(!args.num_machines || *args.num_machines == max, "[launch] --nnodes ", text,
                         " and --num_machines ", args.num_machines.value_or(0), " disagree on the number of machines");
  plan.num_machines = max;
  plan.min_machines = min;
  plan.elastic = min < max;
  if (!plan.elastic) return;
  ACCELERATE_CHECK_VALUE(plan.rdzv_backend == "c10d", "[launch] --nnodes ", text,
                         " (an elastic job) needs --rdzv_backend c10d (or rdzv_backend: c10d in the config file), "
                         "whose rendezvous numbers the machines that join; a static rendezvous needs a fixed number "
                         "of machines");
  ACCELERATE_CHECK_VALUE(!args.machine_rank, "[launch] --machine_rank cannot be given with --nnodes ", text,
                         ": an elastic job numbers its machines at each rendezvous");
}

// Note [The keys of --rdzv_conf]
// torchrun hands --rdzv_conf to its rendezvous handler. The c10d one reads join_timeout,
// last_call_timeout, close_timeout, heartbeat_timeout, keep_alive_interval and
// keep_alive_max_attempt (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py,
// create_handler) and store_type, read_timeout, is_host and use_libuv (c10d_rendezvous_backend.py,
// create_backend); torchrun itself sets timeout (which its static and etcd rendezvous read) and,
// for a static one, rank; the etcd one reads protocol, cacert, cert and key. Each key is honoured
// where the launchers' own rendezvous (elastic.cpp) has the same notion, and refused by name with
// the reason where it has none, so that no setting is silently ignored; any other key is refused
// as unknown. As with torchrun, the keys are comma-separated key=value pairs and a repeated key
// takes its last value.

// The keys of torchrun's rendezvous that accelerate-cpp's has no use for, each with the reason.
const std::map<std::string, std::string>& refused_rdzv_conf_keys() {
  static const std::string keep_alive =
      "accelerate-cpp's rendezvous keeps no keep-alive of its members: a lost machine shows as the failure of "
      "the others' workers, and the machines that remain form the group again at the next round";
  static const std::string etcd =
      "it configures torchrun's etcd rendezvous, which accelerate-cpp does not have (--rdzv_backend is static or "
      "c10d)";
  static const std::map<std::string, std::string> keys = {
      {"close_timeout",
       "torchrun waits this long for a closed rendezvous to be noticed; here machine 0 publishes the job's end in "
       "its store, which the other launchers read at once"},
      {"heartbeat_timeout", keep_alive},
      {"keep_alive_interval", keep_alive},
      {"keep_alive_max_attempt", keep_alive},
      {"read_timeout",
       "the launchers bound each of their requests to the rendezvous store themselves, and the workers' requests "
       "wait up to --rdzv_timeout"},
      {"use_libuv",
       "the launcher of machine 0 serves the rendezvous store itself, not through TCPStore, so there is no libuv "
       "server to choose"},
      {"rank", "torchrun sets it from --node_rank for a static rendezvous; give --machine_rank"},
      {"protocol", etcd},
      {"cacert", etcd},
      {"cert", etcd},
      {"key", etcd},
  };
  return keys;
}

std::string trimmed(const std::string& text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  return text.substr(first, text.find_last_not_of(" \t") - first + 1);
}

enum class Zero { kAllowed, kRefused };

// A number of seconds, at most a year.
double rdzv_conf_seconds(const std::string& key, const std::string& value, Zero zero) {
  char* end = nullptr;
  const double seconds = std::strtod(value.c_str(), &end);
  const bool number = !value.empty() && end != nullptr && *end == '\0' && std::isfinite(seconds);
  ACCELERATE_CHECK_VALUE(number && (zero == Zero::kAllowed ? seconds >= 0 : seconds > 0) && seconds <= 31536000,
                         "[launch] --rdzv_conf: ", key, " must be a number of seconds, ",
                         zero == Zero::kAllowed ? "from 0" : "above 0", " to 31536000, got '", value, "'");
  return seconds;
}

// --rdzv_conf's keys (Note [The keys of --rdzv_conf]), and --rdzv_timeout, which its timeout stands
// for when the flag is not given.
void plan_rdzv_conf(const LaunchArgs& args, LaunchPlan& plan) {
  std::map<std::string, std::string> conf;
  if (args.rdzv_conf) {
    const std::string& text = *args.rdzv_conf;
    // Split by hand: a trailing comma leaves an empty entry, which torchrun refuses too.
    for (size_t start = 0, comma = 0; comma != std::string::npos; start = comma + 1) {
      comma = text.find(',', start);
      const std::string entry = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      const auto eq = entry.find('=');
      const std::string key = trimmed(entry.substr(0, eq));
      const std::string value = eq == std::string::npos ? "" : trimmed(entry.substr(eq + 1));
      ACCELERATE_CHECK_VALUE(!key.empty() && !value.empty(), "[launch] --rdzv_conf must be key=value[,key=value...], "
                             "got '", entry, "' in '", *args.rdzv_conf, "'");
      conf[key] = value;
    }
  }
  for (const auto& [key, value] : conf) {
    const auto refused = refused_rdzv_conf_keys().find(key);
    ACCELERATE_CHECK_VALUE(refused == refused_rdzv_conf_keys().end(), "[launch] --rdzv_conf: ", key,
                           " is not supported: ", refused == refused_rdzv_conf_keys().end() ? "" : refused->second);
    static const std::set<std::string> honoured = {"timeout", "join_timeout", "last_call_timeout", "is_host",
                                                   "store_type"};
    ACCELERATE_CHECK_VALUE(honoured.count(key) > 0, "[launch] --rdzv_conf: unknown setting '", key,
                           "' (accelerate-cpp's rendezvous takes timeout, join_timeout, last_call_timeout, is_host and "
                           "store_type)");
    const bool c10d_only = key == "join_timeout" || key == "last_call_timeout" || key == "is_host";
    ACCELERATE_CHECK_VALUE(!c10d_only || plan.rdzv_backend == "c10d", "[launch] --rdzv_conf: ", key,
                           " is a setting of the c10d rendezvous, but this job's is ", plan.rdzv_backend,
                           ": give --rdzv_backend c10d (or rdzv_backend: c10d in the config file)",
                           key == "join_timeout" ? ", or set how long a static one waits with --rdzv_timeout" : "");
  }

  plan.rdzv_timeout = args.rdzv_timeout.value_or(900);
  if (auto it = conf.find("timeout"); it != conf.end()) {
    const double timeout = rdzv_conf_seconds("timeout", it->second, Zero::kRefused);
    ACCELERATE_CHECK_VALUE(!args.rdzv_timeout || *args.rdzv_timeout == timeout, "[launch] --rdzv_timeout ",
                           args.rdzv_timeout.value_or(0), " and --rdzv_conf timeout=", it->second,
                           " disagree; give one of them");
    plan.rdzv_timeout = timeout;
  }
  if (auto it = conf.find("join_timeout"); it != conf.end()) {
    plan.join_timeout = rdzv_conf_seconds("join_timeout", it->second, Zero::kRefused);
  }
  if (auto it = conf.find("last_call_timeout"); it != conf.end()) {
    plan.last_call_timeout = rdzv_conf_seconds("last_call_timeout", it->second, Zero::kAllowed);
  }
  if (auto it = conf.find("store_type"); it != conf.end()) {
    const std::string type = detail::ascii_lower(it->second);
    ACCELERATE_CHECK_VALUE(type != "file", "[launch] --rdzv_conf: store_type=file is not supported: the rendezvous "
                           "store is the TCP store that the launcher of machine 0 serves (store_type=tcp)");
    ACCELERATE_CHECK_VALUE(type == "tcp", "[launch] --rdzv_conf: store_type must be tcp or file, got '", it->second,
                           "'");
  }
  if (auto it = conf.find("is_host"); it != conf.end()) {
    try {
      plan.is_host = str_to_bool(it->second);
    } catch (const std::exception&) {
      detail::raise_value_error(
          detail::concat("[launch] --rdzv_conf: is_host must be a boolean (true or false), got '", it->second, "'"));
    }
    // Only machines numbered at the rendezvous are told by it whether they are machine 0.
    ACCELERATE_CHECK_VALUE(plan.machine_rank_at_rendezvous || *plan.is_host == (plan.machine_rank == 0),
                           "[launch] --rdzv_conf: is_host=", it->second, " disagrees with ",
                           plan.num_machines == 1 ? "a job on one machine, whose launcher hosts its rendezvous"
                                                  : detail::concat("--machine_rank ", plan.machine_rank,
                                                                   ": the machine of rank 0 hosts the rendezvous"));
  }
}

// The steps of `resolve_launch`, in order.

// The flags, else the configuration file's settings, else the defaults.
void merge_flags_with_config(const LaunchArgs& args, const std::optional<ClusterConfig>& config, LaunchPlan& plan,
                             bool& ip_given) {
  plan.num_processes = args.num_processes.value_or(config ? config->num_processes : 1);
  plan.num_machines = args.num_machines.value_or(config ? config->num_machines : 1);
  plan.machine_rank = args.machine_rank.value_or(config ? config->machine_rank : 0);
  // The config file's rdzv_backend was checked when it was read.
  plan.rdzv_backend = args.rdzv_backend.value_or(config ? config->rdzv_backend : "static");
  ACCELERATE_CHECK_VALUE(plan.rdzv_backend == "static" || plan.rdzv_backend == "c10d",
                         "[launch] --rdzv_backend must be static or c10d, got '", plan.rdzv_backend,
                         "' (the launchers' own store serves the rendezvous; etcd is not supported)");
  plan_elastic(args, plan);
  plan.machine_rank_at_rendezvous =
      plan.rdzv_backend == "c10d" && !args.machine_rank && plan.num_machines > 1;
  const auto config_ip = config ? config->main_process_ip : std::nullopt;
  const std::optional<std::string> ip = args.main_process_ip ? args.main_process_ip : config_ip;
  plan.main_process_ip = ip.value_or("127.0.0.1");
  ip_given = ip.has_value();
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
  // Note [Elastic membership]: machines numbered at the rendezvous take part in rounds when the job
  // may restart, so that a machine lost and launched again joins the next one (the number it had
  // is not taken twice), as with torchrun's c10d rendezvous of a fixed size.
  if (plan.machine_rank_at_rendezvous && plan.max_restarts > 0 && !plan.elastic) {
    plan.elastic = true;
    plan.min_machines = plan.num_machines;
  }
  plan.monitor_interval = args.monitor_interval;
  plan_rdzv_conf(args, plan);
  plan.grace_period = args.grace_period;
  plan.log_dir = args.log_dir;
  // ACCELERATE_BACKEND, which the workers read too, is the default of --backend.
  plan.backend = args.backend.value_or(get_env("ACCELERATE_BACKEND").value_or(""));
  plan.quiet = args.quiet;
}

// The FSDP settings the workers read from their environment.
void plan_fsdp(const LaunchArgs& args, const std::optional<ClusterConfig>& config, LaunchPlan& plan) {
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

}

// The parallelism_config settings the workers read from their environment.
void plan_parallelism(const LaunchArgs& args, const std::optional<ClusterConfig>& config, LaunchPlan& plan) {
  std::map<std::string, std::string> parallelism =
      config ? config->parallelism_config : std::map<std::string, std::string>{};
  for (const auto& [key, value] : args.parallelism) {
    check_parallelism_value(key, value, "launch");
    parallelism[key] = value;
  }
  if (args.use_parallelism_config || !parallelism.empty()) {
    const auto above_one = [&](const char* key) {
      auto it = parallelism.find(key);
      return it != parallelism.end() && it->second != "1";
    };
    ACCELERATE_CHECK_VALUE(plan.use_fsdp || above_one("parallelism_config_tp_size") ||
                               above_one("parallelism_config_cp_size"),
                           "[launch] --use_parallelism_config (and the parallelism_config settings) needs --use_fsdp, "
                           "--parallelism_config_tp_size above 1 or --parallelism_config_cp_size above 1: without "
                           "tensor or context parallelism, its data-parallel sizes shard models");
    plan.parallelism_environment["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true";
    for (const auto& [key, variable] : parallelism_config_keys()) {
      auto it = parallelism.find(key);
      if (it != parallelism.end()) plan.parallelism_environment[variable] = it->second;
    }
  }

}

// The machines the rendezvous expects: its numbering against the back-end, once that is chosen (a
// host file or the config file's mpirun_config choose MPI too), and against a Slurm allocation.
void check_rendezvous(const LaunchPlan& plan) {
  ACCELERATE_CHECK_VALUE(!plan.elastic || plan.min_machines == plan.num_machines || plan.backend != "mpi",
                         "[launch] an elastic job (--nnodes MIN:MAX) runs one launcher per machine; --backend mpi "
                         "starts every machine's workers from one mpirun, which cannot lose or gain a machine");
  ACCELERATE_CHECK_VALUE(!plan.machine_rank_at_rendezvous || plan.backend != "mpi",
                         "[launch] --rdzv_backend c10d numbers the machines of one launcher each; with --backend mpi, "
                         "one launcher on the machine of rank 0 starts every machine's workers through mpirun");
  // Inside a Slurm allocation, a job on more machines than it has nodes would wait for the missing
  // ones until --rdzv_timeout. An elastic job needs only its minimum.
  const int needed = plan.elastic ? plan.min_machines : plan.num_machines;
  const bool ranged = needed < plan.num_machines;
  if (const auto nodes = get_env("SLURM_JOB_NUM_NODES"); nodes && !nodes->empty() && needed > 1) {
    const int allocated = detail::launch::int_value("the environment variable SLURM_JOB_NUM_NODES", *nodes);
    ACCELERATE_CHECK_VALUE(allocated <= 0 || needed <= allocated, "[launch] the job has ",
                           ranged ? "a minimum of --nnodes " : "--num_machines ",
                           ranged ? std::to_string(needed) + ":" + std::to_string(plan.num_machines)
                                  : std::to_string(needed),
                           ", but its Slurm allocation (job ", get_env("SLURM_JOB_ID").value_or("?"), ") has ",
                           allocated, " node(s) (SLURM_JOB_NUM_NODES): ask for --nodes=", needed,
                           ", or launch fewer machines");
  }
}

// The job's size and place: processes, machines, the main process's address.
void check_job_size(LaunchPlan& plan, bool ip_given) {
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
    // Each size is at most a million (check_parallelism_value), so their product fits a long long,
    // not an int.
    const auto size = [&](const char* variable, long long fallback) {
      auto it = plan.parallelism_environment.find(variable);
      return it == plan.parallelism_environment.end() ? fallback : std::stoll(it->second);
    };
    const long long replicate = size("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", 1);
    const long long tp = size("PARALLELISM_CONFIG_TP_SIZE", 1);
    const long long cp = size("PARALLELISM_CONFIG_CP_SIZE", 1);
    const long long shard =
        size("PARALLELISM_CONFIG_DP_SHARD_SIZE", std::max(1LL, plan.num_processes / (replicate * tp * cp)));
    ACCELERATE_CHECK_VALUE(replicate * shard * tp * cp == plan.num_processes, "[launch] parallelism_config: "
                           "dp_replicate_size (", replicate, ") x dp_shard_size (", shard, ") x tp_size (", tp,
                           ")", (cp > 1 ? " x cp_size (" + std::to_string(cp) + ")" : std::string()),
                           " must equal --num_processes (", plan.num_processes, ")");
  }
  ACCELERATE_CHECK_VALUE(plan.main_process_port >= 0 && plan.main_process_port <= 65535,
                         "[launch] --main_process_port must be a TCP port (0-65535), got ", plan.main_process_port);
  if (plan.num_machines > 1) {
    ACCELERATE_CHECK_VALUE(ip_given, "[launch] a job on ", plan.num_machines,
                           " machines needs --main_process_ip, the address of the machine of rank 0");
    ACCELERATE_CHECK_VALUE(plan.main_process_port != 0,
                           "[launch] a job on several machines needs a fixed "
                           "--main_process_port that every machine knows (0 picks a random one)");
  }
}

// The remaining flags' ranges, and the devices they ask for.
void check_flags(const LaunchArgs& args, const LaunchPlan& plan) {
  ACCELERATE_CHECK_VALUE(!(args.cpu && args.multi_gpu), "[launch] --cpu and --multi_gpu exclude each other");
  ACCELERATE_CHECK_VALUE(!plan.multi_gpu || detail::launch::visible_cuda_devices() > 0,
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
}

// The back-end: the flag or ACCELERATE_BACKEND, else MPI for a host file or where MPI is the
// default (Note [MPI by default] in mpi.cpp); mpirun is found now.
void choose_backend(const LaunchArgs& args, const std::optional<ClusterConfig>& config, LaunchPlan& plan) {
  plan.mpirun_hostfile = args.mpirun_hostfile ? args.mpirun_hostfile : (config ? config->mpirun_hostfile : std::nullopt);
  if (plan.mpirun_hostfile && plan.backend.empty()) plan.backend = "mpi";
  if (plan.backend.empty() && detail::launch::mpi_is_the_default(plan)) plan.backend = "mpi";
  if (plan.backend == "mpi") detail::launch::resolve_mpirun(plan);
}

// Note [The job's secret]: every process of a job shows the rendezvous store the same
// secret (Note [The job's store]). A launcher on one machine makes one for its workers; the
// launchers of a job on several machines must be given the same one.
void read_secret(const LaunchArgs& args, LaunchPlan& plan) {
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
}

// A host file starts the workers through mpirun.
void check_hostfile_backend(const LaunchPlan& plan) {
  ACCELERATE_CHECK_VALUE(!plan.mpirun_hostfile || plan.backend == "mpi",
                         "[launch] --mpirun_hostfile (or mpirun_config in "
                         "the config file) starts the workers through mpirun, which needs --backend mpi, not ",
                         plan.backend);
}

// Where the workers' output goes, and their CPU threads.
void plan_output_and_threads(const LaunchArgs& args, LaunchPlan& plan) {
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

}

// The program each worker runs, and its arguments.
void plan_command(const LaunchArgs& args, LaunchPlan& plan) {
  ACCELERATE_CHECK_VALUE(!args.training_script.empty(),
                         "[launch] no program to run was given: accelerate launch [options] <program> [args...]");
  const bool python = !args.no_python && (args.module || args.training_script.ends_with(".py"));
  if (python) {
    plan.command = {detail::resolve_program("python3")};
    if (args.module) plan.command.push_back("-m");
    plan.command.push_back(args.training_script);
  } else {
    plan.command = {detail::resolve_program(args.training_script)};
  }
  plan.command.insert(plan.command.end(), args.training_script_args.begin(), args.training_script_args.end());
}

}  // namespace

LaunchPlan resolve_launch(const LaunchArgs& args) {
  std::optional<ClusterConfig> config;
  if (args.config_file) {
    config = load_config_from_file(*args.config_file);
  } else if (fs::is_regular_file(default_config_file())) {
    config = load_config_from_file(default_config_file());
  }

  LaunchPlan plan;
  bool ip_given = false;
  merge_flags_with_config(args, config, plan, ip_given);
  plan_fsdp(args, config, plan);
  plan_parallelism(args, config, plan);
  check_job_size(plan, ip_given);
  check_flags(args, plan);
  choose_backend(args, config, plan);
  read_secret(args, plan);
  check_hostfile_backend(plan);
  check_rendezvous(plan);
  plan_output_and_threads(args, plan);
  plan_command(args, plan);
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

}  // namespace accelerate::commands
