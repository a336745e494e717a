// The `accelerate config` command: the questionnaire, `config default` and `config update`; see
// include/accelerate/commands/config.h. Reading and writing the files is in config.cpp.
#include "accelerate/commands/config.h"
#include "accelerate/utils/environment.h"
#include "detail/text.h"
#include "commands/cli.h"

#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <filesystem>
#include <functional>
#include <iostream>
#include <istream>
#include <limits>
#include <map>
#include <ostream>
#include <unistd.h>

namespace accelerate::commands {
namespace {

namespace fs = std::filesystem;

std::string trim(const std::string& text) {
  const auto begin = text.find_first_not_of(" \t\r\n");
  if (begin == std::string::npos) return "";
  return text.substr(begin, text.find_last_not_of(" \t\r\n") - begin + 1);
}

// An answer that cannot be used; its message is shown before the question is asked again.
struct InvalidAnswer {
  std::string message;
};

// Asks questions on `out` and reads one answer per line from `in`.
class Prompter {
 public:
  Prompter(std::istream& in, std::ostream& out, const QuestionnaireOptions& options)
      : in_(in), out_(out), options_(options) {}

  void say(const std::string& text) { out_ << text << "\n"; }

  // Asks until `convert` accepts the answer; an empty answer gives `fallback` when there is one.
  template <typename T>
  T ask(const std::string& question, const std::function<T(const std::string&)>& convert,
        const std::optional<T>& fallback = std::nullopt) {
    while (true) {
      const std::string answer = read(question);
      if (answer.empty() && fallback) return *fallback;
      try {
        if (answer.empty()) throw InvalidAnswer{"An answer is required."};
        return convert(answer);
      } catch (const InvalidAnswer& invalid) {
        say(invalid.message);
      }
    }
  }

  // Asks for one of `choices` by number (from 0) or by name; returns the index.
  int choose(const std::string& question, const std::vector<std::vector<std::string>>& choices, int fallback = 0) {
    std::string menu = question + "\n";
    for (size_t i = 0; i < choices.size(); ++i) menu += "  [" + std::to_string(i) + "] " + choices[i].front() + "\n";
    menu += "Please enter a number or a name [" + std::to_string(fallback) + "]: ";
    return ask<int>(
        menu,
        [&](const std::string& answer) {
          for (size_t i = 0; i < choices.size(); ++i) {
            if (answer == std::to_string(i)) return static_cast<int>(i);
            for (const auto& name : choices[i]) {
              if (detail::ascii_lower(answer) == detail::ascii_lower(name)) return static_cast<int>(i);
            }
          }
          std::string names;
          for (const auto& choice : choices) names += (names.empty() ? "" : ", ") + choice.front();
          throw InvalidAnswer{"Please enter a number from 0 to " + std::to_string(choices.size() - 1) +
                              " or one of: " + names + "."};
        },
        fallback);
  }

  bool yes_no(const std::string& question, bool fallback) {
    return ask<bool>(
        question,
        [](const std::string& answer) {
          const std::string a = detail::ascii_lower(answer);
          if (a == "yes" || a == "y") return true;
          if (a == "no" || a == "n") return false;
          throw InvalidAnswer{"Please enter yes or no."};
        },
        fallback);
  }

  int integer(const std::string& question, int minimum, int maximum, std::optional<int> fallback) {
    return ask<int>(
        question,
        [&](const std::string& answer) {
          size_t used = 0;
          int value = 0;
          try {
            value = std::stoi(answer, &used);
          } catch (const std::exception&) {
            used = 0;
          }
          if (used == 0 || used != answer.size()) throw InvalidAnswer{"Please enter an integer."};
          if (value < minimum || value > maximum) {
            throw InvalidAnswer{"Please enter an integer from " + std::to_string(minimum) + " to " +
                                std::to_string(maximum) + "."};
          }
          return value;
        },
        fallback);
  }

  std::string text(const std::string& question, const std::optional<std::string>& fallback) {
    return ask<std::string>(
        question, [](const std::string& answer) { return answer; }, fallback);
  }

 private:
  std::string read(const std::string& question) {
    out_ << question << std::flush;
    std::string line;
    if (!std::getline(in_, line)) {
      out_ << "\n";
      C10_THROW_ERROR(ValueError, c10::str("[config] the input ended before this question was answered: \"",
                                           trim(question.substr(0, question.find('\n'))),
                                           "\"; give one answer per line (an empty line takes the default)"));
    }
    line = trim(line);
    if (options_.echo_answers) out_ << line << "\n";
    return line;
  }

  std::istream& in_;
  std::ostream& out_;
  QuestionnaireOptions options_;
};

// The fully sharded questions (upstream's, less the settings accelerate-cpp does not support),
// answered into `fsdp`, the config file's `fsdp_config` section, and for version 2 the
// `parallelism` section.
void ask_fsdp(Prompter& ask, std::map<std::string, std::string>& fsdp, std::map<std::string, std::string>& parallelism) {
  const int version = ask.integer("What should be your FSDP version (1 or 2)? [2]: ", 1, 2, 2);
  fsdp["fsdp_version"] = std::to_string(version);
  if (version == 1) {
    static const std::array<const char*, 5> strategies = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD",
                                                          "_HYBRID_SHARD_ZERO2"};
    const int strategy = ask.choose("What should be your sharding strategy?",
                                    {{"FULL_SHARD"}, {"SHARD_GRAD_OP"}, {"NO_SHARD"}, {"HYBRID_SHARD"},
                                     {"_HYBRID_SHARD_ZERO2", "HYBRID_SHARD_ZERO2"}});
    fsdp["fsdp_sharding_strategy"] = strategies[strategy];
  } else {
    const bool reshard = ask.yes_no(
        "Do you want to free each unit's gathered parameters after its forward, gathering them again for its "
        "backward (reshard_after_forward)? [YES/no]: ",
        true);
    fsdp["fsdp_reshard_after_forward"] = reshard ? "true" : "false";
  }
  fsdp["fsdp_offload_params"] =
      ask.yes_no("Do you want to offload parameters and gradients to CPU (the optimizer steps there too)? [yes/NO]: ",
                 false)
          ? "true"
          : "false";
  static const std::array<const char*, 3> policies = {"TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"};
  const int policy = ask.choose("What should be your auto wrap policy?",
                                {{"TRANSFORMER_BASED_WRAP"}, {"SIZE_BASED_WRAP"}, {"NO_WRAP"}});
  fsdp["fsdp_auto_wrap_policy"] = policies[policy];
  if (policy == 0) {
    fsdp["fsdp_transformer_layer_cls_to_wrap"] = ask.ask<std::string>(
        "Specify the comma-separated list of module class names to wrap, each block of your model a unit "
        "(e.g. `Block` for TORCH_MODULE(Block)): ",
        [](const std::string& answer) { return answer; }, std::nullopt);  // required: no default
  } else if (policy == 1) {
    fsdp["fsdp_min_num_params"] = std::to_string(
        ask.integer("What should be the minimum number of parameters of a unit? [100000000]: ", 1,
                    std::numeric_limits<int>::max(), 100000000));
  }
  if (version == 1) {  // version 2 prefetches as PyTorch's fully_shard does, without settings
    static const std::array<const char*, 3> prefetches = {"BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"};
    const int prefetch = ask.choose("What should be your FSDP's backward prefetch policy?",
                                    {{"BACKWARD_PRE"}, {"BACKWARD_POST"}, {"NO_PREFETCH"}});
    fsdp["fsdp_backward_prefetch"] = prefetches[prefetch];
  }
  static const std::array<const char*, 3> types = {"FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT"};
  const int type = ask.choose("What should be your FSDP's state dict type?",
                              {{"FULL_STATE_DICT"}, {"LOCAL_STATE_DICT"}, {"SHARDED_STATE_DICT"}});
  fsdp["fsdp_state_dict_type"] = types[type];
  if (version == 1) {
    fsdp["fsdp_forward_prefetch"] =
        ask.yes_no("Do you want to enable FSDP's forward prefetch policy? [yes/NO]: ", false) ? "true" : "false";
  }
  const bool efficient = ask.yes_no(
      "Do you want to enable CPU RAM efficient model loading (process 0 holds the values, the others build the "
      "model on the meta device)? [yes/NO]: ",
      false);
  fsdp["fsdp_cpu_ram_efficient_loading"] = efficient ? "true" : "false";
  // Efficient loading needs process 0's values broadcast, as upstream sets it.
  const bool sync = efficient || ask.yes_no(
                                     "Do you want each process to start from process 0's parameters and buffers "
                                     "(sync_module_states)? [YES/no]: ",
                                     true);
  fsdp["fsdp_sync_module_states"] = sync ? "true" : "false";
  if (policy != 2) {  // activation checkpointing recomputes the wrapped units, so NO_WRAP has none
    fsdp["fsdp_activation_checkpointing"] =
        ask.yes_no("Do you want to enable FSDP activation checkpointing (each unit's forward runs again in the "
                   "backward pass instead of keeping its activations)? [yes/NO]: ",
                   false)
            ? "true"
            : "false";
  }
  if (version == 2 && ask.yes_no("Do you want to use the parallelism config (replicas of groups that each shard the "
                                 "model: hybrid sharding)? [yes/NO]: ",
                                 false)) {
    parallelism["parallelism_config_dp_replicate_size"] =
        std::to_string(ask.integer("What is the data parallelism replicate size? [1]: ", 1, 1 << 20, 1));
    const int shard = ask.integer("What is the FSDP shard size (0: the processes / the replicate size)? [0]: ", 0,
                                  1 << 20, 0);
    if (shard > 0) parallelism["parallelism_config_dp_shard_size"] = std::to_string(shard);
    const int tp = ask.integer("What is the tensor parallelism size (processes that split each layer of the "
                               "model's plan)? [1]: ",
                               1, 1 << 20, 1);
    if (tp > 1) parallelism["parallelism_config_tp_size"] = std::to_string(tp);
    const int cp = ask.integer("What is the context parallelism size (processes that split each sequence)? [1]: ", 1,
                               1 << 20, 1);
    if (cp > 1) {
      parallelism["parallelism_config_cp_size"] = std::to_string(cp);
      const int strategy = ask.choose("What is the context parallelism communication strategy?",
                                      {{"allgather"}, {"alltoall"}});
      parallelism["parallelism_config_cp_comm_strategy"] = strategy == 0 ? "allgather" : "alltoall";
    }
  }
  ask.say("Not asked: use_orig_params=false, not supported by accelerate-cpp.");
}

}  // namespace

ClusterConfig get_user_input(std::istream& in, std::ostream& out, const QuestionnaireOptions& options) {
  Prompter ask(in, out, options);
  ClusterConfig config;
  config.compute_environment = "LOCAL_MACHINE";
  ask.say("Compute environment: this machine (Amazon SageMaker is not supported by accelerate-cpp).");

  const int type = ask.choose(
      "Which type of machine are you using?",
      {{"No distributed training", "NO"}, {"multi-CPU", "MULTI_CPU", "CPU"}, {"multi-GPU", "MULTI_GPU", "GPU"}});
  config.distributed_type =
      std::array{DistributedType::kNo, DistributedType::kMultiCpu, DistributedType::kMultiGpu}[type];
  const bool multi = config.distributed_type != DistributedType::kNo;

  if (multi) {
    config.num_machines = ask.integer(
        "How many different machines will you use (use more than 1 for multi-node training)? [1]: ", 1, 1 << 20, 1);
    if (config.num_machines > 1) {
      config.machine_rank = ask.integer(
          "What is the rank of this machine (0 to " + std::to_string(config.num_machines - 1) + ")? [0]: ", 0,
          config.num_machines - 1, 0);
      config.main_process_ip =
          ask.text("What is the IP address of the machine that will host the main process? ", std::nullopt);
      config.main_process_port =
          ask.integer("What is the port you will use to communicate with the main process? ", 1, 65535, std::nullopt);
      config.same_network = ask.yes_no(
          "Are all the machines on the same local network? Answer `no` if they are in the cloud or on different "
          "networks [YES/no]: ",
          true);
      if (!config.same_network) {
        config.rdzv_backend = ask.ask<std::string>(
            "What rendezvous backend will you use? ('static' or 'c10d') [static]: ",
            [](const std::string& answer) {
              if (answer != "static" && answer != "c10d") throw InvalidAnswer{"Please enter static or c10d."};
              return answer;
            },
            std::string("static"));
      }
    }
    config.debug = ask.yes_no(
        "Should distributed operations be checked while running for errors? This can avoid timeout issues but will "
        "be slower. [yes/NO]: ",
        false);
    config.use_fsdp = ask.yes_no("Do you want to use FullyShardedDataParallel? [yes/NO]: ", false);
    if (config.use_fsdp) ask_fsdp(ask, config.fsdp_config, config.parallelism_config);
  }

  if (config.distributed_type == DistributedType::kNo) {
    config.use_cpu =
        ask.yes_no("Do you want to run your training on CPU only (even if a GPU is available)? [yes/NO]: ", false);
  } else {
    config.use_cpu = config.distributed_type == DistributedType::kMultiCpu;
  }

  ask.say(
      "Not asked: launching through mpirun, TorchDynamo, DeepSpeed, Megatron-LM and TPU "
      "settings are Python-only integrations that accelerate-cpp does not support.");

  if (multi) {
    const std::string what = config.distributed_type == DistributedType::kMultiCpu ? "processes" : "GPU(s)";
    config.num_processes =
        ask.integer("How many " + what + " should be used for distributed training? [1]: ", 1, 1 << 20, 1);
  }
  TORCH_CHECK_VALUE(
      !(config.distributed_type == DistributedType::kMultiGpu && config.num_machines == 1 && config.num_processes == 1),
      "[config] MULTI_GPU was chosen with a single GPU on a single machine; choose `No distributed "
      "training` for the type of machine instead");

  const bool gpu = !config.use_cpu && (config.distributed_type == DistributedType::kNo ||
                                       config.distributed_type == DistributedType::kMultiGpu);
  if (gpu) {
    config.gpu_ids = ask.ask<std::string>(
        "What GPU(s) (by id) should be used for training on this machine as a comma-separated list? [all]: ",
        [](const std::string& answer) {
          if (answer == "all") return answer;
          bool valid = answer.front() != ',' && answer.back() != ',' && answer.find(",,") == std::string::npos;
          for (char c : answer) valid = valid && (std::isdigit(static_cast<unsigned char>(c)) || c == ',');
          if (!valid) throw InvalidAnswer{"Please enter `all` or GPU ids separated by commas, e.g. 0,1."};
          return answer;
        },
        std::string("all"));
    config.enable_cpu_affinity = ask.yes_no(
        "Would you like to enable numa efficiency (each process bound to the cores of one NUMA node)? [yes/NO]: ",
        false);
  }

  const int precision = ask.choose("Do you wish to use mixed precision? (fp8 is not supported by accelerate-cpp)",
                                   {{"no"}, {"fp16"}, {"bf16"}});
  config.mixed_precision = std::array{"no", "fp16", "bf16"}[precision];
  return config;
}

std::optional<std::string> write_basic_config(const std::string& mixed_precision, const std::string& save_location) {
  const std::string precision = detail::ascii_lower(mixed_precision);
  TORCH_CHECK_VALUE(precision == "no" || precision == "fp16" || precision == "bf16",
                    "[write_basic_config] `mixed_precision` should be one of 'no', 'fp16' or 'bf16', got '",
                    mixed_precision, "'");
  if (fs::exists(save_location)) return std::nullopt;
  ClusterConfig config;
  config.mixed_precision = precision;
  const int gpus = is_cuda_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  if (gpus > 0) {
    config.num_processes = gpus;
    config.use_cpu = false;
    config.distributed_type = gpus > 1 ? DistributedType::kMultiGpu : DistributedType::kNo;
  } else {
    config.num_processes = 1;
    config.use_cpu = true;
    config.distributed_type = DistributedType::kNo;
  }
  save_config_file(config, save_location);
  return save_location;
}

std::string update_config(const std::optional<std::string>& config_file) {
  const std::string path = config_file.value_or(default_config_file());
  TORCH_CHECK_VALUE(fs::is_regular_file(path), "[update_config] the config file ", path,
                    config_file ? " does not exist" : " (the default one) does not exist; pass --config_file",
                    " (create one with `accelerate config`)");
  save_config_file(load_config_from_file(path), path);
  return path;
}

int config_main(const std::vector<std::string>& args, std::istream& in, std::ostream& out, std::ostream& err) {
  const std::string location_help =
      "Where the file goes (a `.json` name writes JSON). Default: default_config.yaml under $HF_HOME/accelerate, "
      "else $XDG_CACHE_HOME/huggingface/accelerate, else ~/.cache/huggingface/accelerate";
  CLI::App app{"Asks a few questions and saves the answers as the configuration `accelerate launch` uses by default.",
               "accelerate config"};
  app.set_help_flag("-h,--help", "Show this help and exit");
  std::optional<std::string> config_file;
  app.add_option_function<std::string>(
      detail::cli_spellings("config_file"), [&](const std::string& v) { config_file = v; }, location_help);

  CLI::App* basic = app.add_subcommand("default", "Write a configuration for this machine without asking anything");
  basic->set_help_flag("-h,--help", "Show this help and exit");
  std::optional<std::string> basic_file;
  std::string mixed_precision = "no";
  basic->add_option_function<std::string>(
      detail::cli_spellings("config_file"), [&](const std::string& v) { basic_file = v; }, location_help);
  basic->add_option(detail::cli_spellings("mixed_precision"), mixed_precision, "no, fp16 or bf16 (default: no)")
      ->check(CLI::IsMember({"no", "fp16", "bf16"}, CLI::ignore_case));

  CLI::App* update = app.add_subcommand("update", "Rewrite an existing configuration file in the current schema");
  update->set_help_flag("-h,--help", "Show this help and exit");
  std::optional<std::string> update_file;
  update->add_option_function<std::string>(
      detail::cli_spellings("config_file"), [&](const std::string& v) { update_file = v; },
      "The file to update (default: the default configuration file)");

  if (auto code = detail::parse_cli(app, args, "config", out, err)) return *code;
  if (basic->parsed()) {
    return detail::run_cli_command("config default", err, [&] {
      const std::string path = basic_file.value_or(config_file.value_or(default_config_file()));
      if (!write_basic_config(mixed_precision, path)) {
        out << "Configuration already exists at " << path
            << ", will not override. Run `accelerate config` to change it, or pass another --config_file.\n";
        return 0;
      }
      out << "accelerate configuration saved at " << path << "\n";
      return 0;
    });
  }
  if (update->parsed()) {
    return detail::run_cli_command("config update", err, [&] {
      const std::string path = update_config(update_file ? update_file : config_file);
      out << "Successfully updated the configuration file at " << path << ".\n";
      return 0;
    });
  }
  return detail::run_cli_command("config", err, [&] {
    const bool from_terminal = &in == &std::cin && ::isatty(STDIN_FILENO) == 1;
    const ClusterConfig config = get_user_input(in, out, {.echo_answers = !from_terminal});
    const std::string path = config_file.value_or(default_config_file());
    save_config_file(config, path);
    out << "accelerate configuration saved at " << path << "\n";
    return 0;
  });
}

}  // namespace accelerate::commands
