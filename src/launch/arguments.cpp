// `accelerate launch`'s command line: its flags (with upstream's spellings) into `LaunchArgs`, its
// integers read whole and within int (arguments.h).
#include "launch/arguments.h"

#include "accelerate/commands/launch.h"
#include "detail/check.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <functional>

namespace accelerate::detail::launch {

std::optional<int> parse_int(const std::string& text, int min, int max) {
  const size_t sign = !text.empty() && (text[0] == '-' || text[0] == '+') ? 1 : 0;
  if (text.size() == sign ||
      !std::all_of(text.begin() + sign, text.end(), [](unsigned char c) { return std::isdigit(c) != 0; })) {
    return std::nullopt;
  }
  errno = 0;
  const long long value = std::strtoll(text.c_str(), nullptr, 10);
  if (errno == ERANGE || value < min || value > max) return std::nullopt;
  return static_cast<int>(value);
}

int int_value(const std::string& name, const std::string& text) {
  const auto value = parse_int(text);
  ACCELERATE_CHECK_VALUE(value.has_value(), "[launch] ", name, " must be an integer that fits an int (", INT_MIN,
                         " to ", INT_MAX, "), got '", text, "'");
  return *value;
}

}  // namespace accelerate::detail::launch

namespace accelerate::commands {
namespace {

// Registers "--name" together with its hyphenated spelling "--na-me".
std::string spellings(const std::string& name, const std::string& short_name = "") {
  std::string hyphenated = name;
  std::replace(hyphenated.begin(), hyphenated.end(), '_', '-');
  std::string out = short_name.empty() ? "" : short_name + ",";
  out += "--" + name;
  if (hyphenated != name) out += ",--" + hyphenated;
  return out;
}

// An integer flag, read whole and within int by `int_value` (CLI11 would say only that it "could
// not convert" a number beyond int).
void add_int(CLI::App& app, std::function<void(int)> set, const std::string& name, const std::string& help,
             const std::string& short_name = "") {
  app.add_option_function<std::string>(
         spellings(name, short_name),
         [set = std::move(set), flag = "--" + name](const std::string& text) {
           set(detail::launch::int_value(flag, text));
         },
         help)
      ->type_name("INT");
}

void add_optional_int(CLI::App& app, std::optional<int>& target, const std::string& name, const std::string& help,
                      const std::string& short_name = "") {
  add_int(app, [&target](int value) { target = value; }, name, help, short_name);
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
    add_optional_int(app, args.num_processes, "num_processes", "Total number of processes of the job", "-n");
    add_optional_int(app, args.num_machines, "num_machines", "Number of machines of the job");
    add_optional_int(app, args.machine_rank, "machine_rank", "Index of this machine in the job");
    add_optional(app, args.main_process_ip, "main_process_ip", "Address of the machine of rank 0");
    add_optional(app, args.nnodes, "nnodes",
                 "Machines of the job: N, or MIN:MAX for an elastic job (needs --rdzv_backend c10d)");
    add_optional(app, args.rdzv_conf, "rdzv_conf",
                 "torchrun's rendezvous settings, key=value[,key=value]: timeout (as --rdzv_timeout), and with "
                 "c10d join_timeout (seconds the launchers wait for each other; default --rdzv_timeout), "
                 "last_call_timeout (seconds an elastic rendezvous waits for more machines once MIN have joined; "
                 "default 30), is_host (this machine serves the rendezvous) and store_type=tcp; torchrun's "
                 "other keys are refused, saying why");
    add_optional(app, args.rdzv_backend, "rdzv_backend",
                 "static (every machine gives --machine_rank) or c10d (machines without one are numbered as they "
                 "join the rendezvous at --main_process_ip); default: the config file's rdzv_backend, else static");
    add_optional_int(app, args.main_process_port, "main_process_port",
                     "Port of the rendezvous on the machine of rank 0 (0 picks a free port)");
    add_optional(app, args.gpu_ids, "gpu_ids", "Comma-separated GPU ids to use (CUDA_VISIBLE_DEVICES)");
    add_optional_int(app, args.num_cpu_threads_per_process, "num_cpu_threads_per_process",
                     "CPU threads per process (OMP_NUM_THREADS); default: cores / local processes");
    add_optional_int(app, args.gradient_accumulation_steps, "gradient_accumulation_steps",
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
    add_int(app, [this](int value) { args.max_restarts = value; }, "max_restarts",
            "Restart the group this many times on failure");
    app.add_option(spellings("monitor_interval"), args.monitor_interval, "Seconds between health checks");
    add_optional(app, args.rdzv_timeout, "rdzv_timeout",
                 "Seconds the processes wait for each other to join (default: --rdzv_conf's timeout, else 900)");
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
          "ParallelismConfig setting (sets " + variable + ")");
    }
    app.add_flag(spellings("no_python"), args.no_python, "Run the program directly, even a .py file");
    app.add_flag(spellings("module", "-m"), args.module, "Run the program as a Python module (python3 -m)");
    app.add_flag(spellings("quiet", "-q"), args.quiet, "Only print the launcher's own errors");
  }
};

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
        {"--parallelism_config_", "parallelism_config's sequence parallelism (DeepSpeed's Ulysses)"}};
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

}  // namespace accelerate::commands
