// Reading and writing upstream's configuration files; see include/accelerate/commands/config.h.
#include "accelerate/commands/config.h"

#include "accelerate/utils/environment.h"
#include "detail/check.h"
#include "detail/files.h"
#include "detail/text.h"

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <set>

namespace accelerate::commands {
namespace {

namespace fs = std::filesystem;

}  // namespace

const std::vector<std::pair<std::string, std::string>>& fsdp_config_keys() {
  static const std::vector<std::pair<std::string, std::string>> keys = {
      {"fsdp_version", "FSDP_VERSION"},
      {"fsdp_sharding_strategy", "FSDP_SHARDING_STRATEGY"},
      {"fsdp_reshard_after_forward", "FSDP_RESHARD_AFTER_FORWARD"},
      {"fsdp_offload_params", "FSDP_OFFLOAD_PARAMS"},
      {"fsdp_min_num_params", "FSDP_MIN_NUM_PARAMS"},
      {"fsdp_auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY"},
      {"fsdp_transformer_layer_cls_to_wrap", "FSDP_TRANSFORMER_CLS_TO_WRAP"},
      {"fsdp_backward_prefetch", "FSDP_BACKWARD_PREFETCH"},
      {"fsdp_state_dict_type", "FSDP_STATE_DICT_TYPE"},
      {"fsdp_forward_prefetch", "FSDP_FORWARD_PREFETCH"},
      {"fsdp_use_orig_params", "FSDP_USE_ORIG_PARAMS"},
      {"fsdp_cpu_ram_efficient_loading", "FSDP_CPU_RAM_EFFICIENT_LOADING"},
      {"fsdp_sync_module_states", "FSDP_SYNC_MODULE_STATES"},
      {"fsdp_activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING"},
      {"fsdp_limit_all_gathers", "FSDP_LIMIT_ALL_GATHERS"},
  };
  return keys;
}

const std::vector<std::pair<std::string, std::string>>& parallelism_config_keys() {
  static const std::vector<std::pair<std::string, std::string>> keys = {
      {"parallelism_config_dp_replicate_size", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE"},
      {"parallelism_config_dp_shard_size", "PARALLELISM_CONFIG_DP_SHARD_SIZE"},
      {"parallelism_config_tp_size", "PARALLELISM_CONFIG_TP_SIZE"},
      {"parallelism_config_cp_size", "PARALLELISM_CONFIG_CP_SIZE"},
      {"parallelism_config_cp_backend", "PARALLELISM_CONFIG_CP_BACKEND"},
      {"parallelism_config_cp_comm_strategy", "PARALLELISM_CONFIG_CP_COMM_STRATEGY"},
  };
  return keys;
}

namespace {

// `value` as a positive integer, or 0 when it is not one (empty, signed, trailing text, overflow).
long long positive_integer(const std::string& value) {
  size_t used = 0;
  long long number = 0;
  try {
    number = std::stoll(value, &used);
  } catch (const std::exception&) {
    return 0;
  }
  return used == value.size() && number > 0 ? number : 0;
}

}  // namespace

bool is_parallelism_size(const std::string& key) {
  return key.size() > 5 && key.compare(key.size() - 5, 5, "_size") == 0;
}

void check_parallelism_value(const std::string& key, const std::string& value, const std::string& where) {
  if (key == "parallelism_config_cp_backend") {
    ACCELERATE_CHECK_VALUE(value == "torch", "[", where, "] ", key, ": expected 'torch' (the one context-parallel "
                           "backend), got '", value, "'");
    return;
  }
  if (key == "parallelism_config_cp_comm_strategy") {
    ACCELERATE_CHECK_VALUE(value == "allgather" || value == "alltoall", "[", where, "] ", key, ": expected 'allgather' "
                           "or 'alltoall', got '", value, "'");
    return;
  }
  const long long number = positive_integer(value);
  ACCELERATE_CHECK_VALUE(number > 0 && number <= 1000000, "[", where, "] ", key,
                         ": expected a positive integer, got '", value, "'");
}

void check_fsdp_value(const std::string& key, const std::string& value, const std::string& where) {
  try {
    if (key == "fsdp_sharding_strategy") {
      (void)parse_fsdp_sharding_strategy(value);
    } else if (key == "fsdp_auto_wrap_policy") {
      (void)parse_fsdp_auto_wrap_policy(value);
    } else if (key == "fsdp_backward_prefetch") {
      (void)parse_fsdp_backward_prefetch(value);
    } else if (key == "fsdp_state_dict_type") {
      (void)parse_fsdp_state_dict_type(value);
    } else if (key == "fsdp_reshard_after_forward") {
      // A boolean (version 2) or a sharding strategy (version 1 configurations).
      try {
        (void)str_to_bool(value);
      } catch (const std::exception&) {
        (void)parse_fsdp_sharding_strategy(value);
      }
    } else if (key == "fsdp_version" || key == "fsdp_min_num_params") {
      ACCELERATE_CHECK_VALUE(positive_integer(value) > 0, "expected a positive integer, got '", value, "'");
    } else if (key != "fsdp_transformer_layer_cls_to_wrap") {
      (void)str_to_bool(value);
    }
  } catch (const std::exception& e) {
    detail::raise_value_error(detail::concat("[", where, "] ", key, ": ", detail::error_text(e)));
  }
}

namespace {

// Every key of upstream's ClusterConfig/BaseConfig, plus older spellings converted on load.
const std::set<std::string>& known_keys() {
  static const std::set<std::string> keys = {
      "compute_environment", "distributed_type", "mixed_precision", "use_cpu", "debug", "num_processes",
      "machine_rank", "num_machines", "gpu_ids", "main_process_ip", "main_process_port", "rdzv_backend",
      "same_network", "main_training_function", "enable_cpu_affinity", "fp8_config", "deepspeed_config",
      "fsdp_config", "parallelism_config", "megatron_lm_config", "mpirun_config", "downcast_bf16", "tpu_name",
      "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "command_file", "commands", "tpu_vm", "tpu_env",
      "dynamo_config", "ipex_config",
      // older schema versions
      "fp16", "dynamo_backend"};
  return keys;
}

struct Reader {
  const std::string& path;

  [[noreturn]] void fail(const std::string& key, const std::string& expected, const YAML::Node& node) const {
    std::string got = node.IsScalar() ? "'" + node.Scalar() + "'" : (node.IsSequence() ? "a list" : "a mapping");
    detail::raise_value_error(
        detail::concat("[load_config_from_file] ", path, ": key '", key, "' expects ", expected, ", got ", got));
  }
  bool boolean(const std::string& key, const YAML::Node& node) const {
    if (!node.IsScalar()) fail(key, "a boolean", node);
    try {
      return str_to_bool(node.Scalar());
    } catch (const std::exception&) {
      fail(key, "a boolean", node);
    }
  }
  int integer(const std::string& key, const YAML::Node& node) const {
    if (!node.IsScalar()) fail(key, "an integer", node);
    try {
      size_t used = 0;
      int value = std::stoi(node.Scalar(), &used);
      if (used == node.Scalar().size()) return value;
    } catch (const std::exception&) {
    }
    fail(key, "an integer", node);
  }
  std::string text(const std::string& key, const YAML::Node& node) const {
    if (!node.IsScalar()) fail(key, "a string", node);
    return node.Scalar();
  }
  // True when an integration section asks for something (a non-empty mapping or list, or a
  // scalar that is neither empty nor false).
  static bool requests(const YAML::Node& node) {
    if (!node || node.IsNull()) return false;
    if (node.IsMap() || node.IsSequence()) return node.size() > 0;
    const std::string& s = node.Scalar();
    return !(s.empty() || s == "false" || s == "False" || s == "no" || s == "NO" || s == "null");
  }
  // True when a section of switches turns one on; upstream writes `ipex_config: {ipex: false}`.
  static bool turns_on(const YAML::Node& node) {
    if (!node || !node.IsMap()) return requests(node);
    for (const auto& entry : node) {
      if (requests(entry.second)) return true;
    }
    return false;
  }
};

// Whether PyYAML (YAML 1.1) would read `value` as something other than a string when unquoted.
bool needs_quotes(const std::string& value) {
  const std::string lower = detail::ascii_lower(value);
  static const std::set<std::string> special = {"yes", "no", "true", "false", "on", "off", "y", "n", "null", "~"};
  return value.empty() || special.count(lower) > 0 ||
         std::all_of(value.begin(), value.end(), [](char c) { return (c >= '0' && c <= '9') || c == ','; });
}

}  // namespace

std::string default_config_file() {
  std::string home;
  if (auto hf = get_env("HF_HOME"); hf && !hf->empty()) {
    home = *hf;
  } else if (auto xdg = get_env("XDG_CACHE_HOME"); xdg && !xdg->empty()) {
    home = *xdg + "/huggingface";
  } else {
    home = get_env("HOME").value_or(".") + "/.cache/huggingface";
  }
  return home + "/accelerate/default_config.yaml";
}

ClusterConfig load_config_from_file(const std::string& path) {
  ACCELERATE_CHECK_VALUE(fs::is_regular_file(path), "[load_config_from_file] the configuration file '", path,
                         "' does not exist; pass an existing file with --config_file or create the default one with "
                         "`accelerate config`");
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    detail::raise_value_error(detail::concat("[load_config_from_file] ", path, " is not valid YAML: ", e.what()));
  }
  ACCELERATE_CHECK_VALUE(root.IsMap(), "[load_config_from_file] ", path,
                         " must hold a mapping of configuration keys, e.g. 'distributed_type: MULTI_CPU'");

  std::vector<std::string> unknown;
  ClusterConfig config;
  for (const auto& entry : root) {
    const std::string key = entry.first.as<std::string>();
    if (known_keys().count(key) == 0) unknown.push_back(key);
    config.keys_present.push_back(key);
  }
  if (!unknown.empty()) {
    std::sort(unknown.begin(), unknown.end());
    std::string listed;
    for (const auto& key : unknown) listed += (listed.empty() ? "" : ", ") + key;
    detail::raise_value_error(detail::concat("[load_config_from_file] the config file at ", path, " has unknown keys (",
                                             listed, "); fix or remove them"));
  }

  const Reader r{path};
  auto has = [&](const char* key) { return root[key] && !root[key].IsNull(); };
  if (has("compute_environment")) {
    config.compute_environment = r.text("compute_environment", root["compute_environment"]);
    // Upstream's names are recognised (SageMaker's included) before anything else is refused.
    std::optional<ComputeEnvironment> environment;
    try {
      environment = parse_compute_environment(config.compute_environment);
    } catch (const std::exception&) {
    }
    ACCELERATE_CHECK_VALUE(environment == ComputeEnvironment::kLocalMachine, "[load_config_from_file] ", path,
                           ": compute_environment '", config.compute_environment, "' is ",
                           environment ? "not supported by accelerate-cpp (SageMaker jobs are Python's)"
                                       : "not one of LOCAL_MACHINE, AMAZON_SAGEMAKER",
                           "; only LOCAL_MACHINE is supported");
  }
  ACCELERATE_CHECK_VALUE(has("distributed_type"), "[load_config_from_file] ", path,
                         ": a `distributed_type` must be specified (NO, MULTI_CPU or MULTI_GPU)");
  try {
    const std::string type = r.text("distributed_type", root["distributed_type"]);
    config.use_fsdp = type == "FSDP";
    // FSDP runs on the processes of a multi-GPU (or, with use_cpu, multi-CPU) job.
    const bool cpu = has("use_cpu") && r.boolean("use_cpu", root["use_cpu"]);
    config.distributed_type = config.use_fsdp ? (cpu ? DistributedType::kMultiCpu : DistributedType::kMultiGpu)
                                              : parse_distributed_type(type);
  } catch (const std::exception& e) {
    detail::raise_value_error(detail::concat("[load_config_from_file] ", path, ": ", detail::error_text(e)));
  }
  if (has("mixed_precision")) {
    const std::string text = r.text("mixed_precision", root["mixed_precision"]);
    try {
      config.mixed_precision = to_string(parse_precision_type(text));
    } catch (const std::exception& e) {
      detail::raise_value_error(detail::concat("[load_config_from_file] ", path, ": ", detail::error_text(e)));
    }
  } else if (has("fp16") && r.boolean("fp16", root["fp16"])) {
    config.mixed_precision = "fp16";  // older schema
  }
  if (has("use_cpu")) config.use_cpu = r.boolean("use_cpu", root["use_cpu"]);
  if (has("debug")) config.debug = r.boolean("debug", root["debug"]);
  if (has("num_processes")) {
    config.num_processes = r.integer("num_processes", root["num_processes"]);
    // upstream writes -1 when a scheduler decides; treat it as "not set"
    if (config.num_processes < 0) config.num_processes = 1;
  }
  if (has("machine_rank")) config.machine_rank = r.integer("machine_rank", root["machine_rank"]);
  if (has("num_machines")) config.num_machines = r.integer("num_machines", root["num_machines"]);
  if (has("gpu_ids")) config.gpu_ids = r.text("gpu_ids", root["gpu_ids"]);
  if (has("main_process_ip")) config.main_process_ip = r.text("main_process_ip", root["main_process_ip"]);
  if (has("main_process_port")) config.main_process_port = r.integer("main_process_port", root["main_process_port"]);
  if (has("rdzv_backend")) config.rdzv_backend = r.text("rdzv_backend", root["rdzv_backend"]);
  if (has("same_network")) config.same_network = r.boolean("same_network", root["same_network"]);
  if (has("main_training_function")) {
    config.main_training_function = r.text("main_training_function", root["main_training_function"]);
  }
  if (has("enable_cpu_affinity")) config.enable_cpu_affinity = r.boolean("enable_cpu_affinity", root["enable_cpu_affinity"]);
  if (has("downcast_bf16")) config.downcast_bf16 = r.boolean("downcast_bf16", root["downcast_bf16"]);
  if (has("mpirun_config") && root["mpirun_config"].IsMap() && root["mpirun_config"]["mpirun_hostfile"]) {
    config.mpirun_hostfile = r.text("mpirun_config.mpirun_hostfile", root["mpirun_config"]["mpirun_hostfile"]);
  }
  ACCELERATE_CHECK_VALUE(config.rdzv_backend == "static" || config.rdzv_backend == "c10d", "[load_config_from_file] ",
                         path, ": rdzv_backend '", config.rdzv_backend, "' is not supported; use 'static' or 'c10d'");

  if (root["fsdp_config"] && root["fsdp_config"].IsMap() && root["fsdp_config"].size() > 0) {
    for (const auto& entry : root["fsdp_config"]) {
      const std::string key = entry.first.as<std::string>();
      const bool known = std::any_of(fsdp_config_keys().begin(), fsdp_config_keys().end(),
                                     [&](const auto& k) { return k.first == key; });
      ACCELERATE_CHECK_VALUE(known, "[load_config_from_file] ", path, ": fsdp_config has an unknown key '", key, "'");
      std::string value;
      if (entry.second.IsSequence()) {  // a list of class names
        for (const auto& item : entry.second) value += (value.empty() ? "" : ",") + item.as<std::string>();
      } else {
        value = r.text("fsdp_config." + key, entry.second);
      }
      check_fsdp_value(key, value, path + ": fsdp_config");
      config.fsdp_config[key] = value;
    }
  } else if (root["fsdp_config"] && !root["fsdp_config"].IsNull() && !root["fsdp_config"].IsMap()) {
    r.fail("fsdp_config", "a mapping", root["fsdp_config"]);
  }
  if (root["parallelism_config"] && root["parallelism_config"].IsMap() && root["parallelism_config"].size() > 0) {
    for (const auto& entry : root["parallelism_config"]) {
      const std::string key = entry.first.as<std::string>();
      const bool known = std::any_of(parallelism_config_keys().begin(), parallelism_config_keys().end(),
                                     [&](const auto& k) { return k.first == key; });
      ACCELERATE_CHECK_VALUE(known, "[load_config_from_file] ", path, ": parallelism_config has '", key,
                             "', which accelerate-cpp does not support (it takes parallelism_config_dp_replicate_size, "
                             "parallelism_config_dp_shard_size, parallelism_config_tp_size, parallelism_config_cp_size, "
                             "parallelism_config_cp_backend and parallelism_config_cp_comm_strategy)");
      const std::string value = r.text("parallelism_config." + key, entry.second);
      check_parallelism_value(key, value, path + ": parallelism_config");
      config.parallelism_config[key] = value;
    }
  } else if (root["parallelism_config"] && !root["parallelism_config"].IsNull() && !root["parallelism_config"].IsMap()) {
    r.fail("parallelism_config", "a mapping", root["parallelism_config"]);
  }
  for (const char* key : {"deepspeed_config", "megatron_lm_config", "fp8_config",
                          "ipex_config", "tpu_name", "tpu_use_cluster", "command_file", "commands"}) {
    const bool asked = std::string(key) == "ipex_config" ? Reader::turns_on(root[key]) : Reader::requests(root[key]);
    ACCELERATE_CHECK_VALUE(!asked, "[load_config_from_file] ", path, ": '", key,
                           "' configures a Python-only integration that accelerate-cpp does not support; remove it");
  }
  for (const char* key : {"dynamo_config", "dynamo_backend"}) {
    YAML::Node node = root[key];
    if (node && node.IsMap()) node = node["dynamo_backend"];
    const bool off = !node || node.IsNull() || (node.IsScalar() && (node.Scalar() == "NO" || node.Scalar() == "no"));
    ACCELERATE_CHECK_VALUE(off || !Reader::requests(node), "[load_config_from_file] ", path,
                           ": TorchDynamo compilation is a Python-only feature that accelerate-cpp does not support; "
                           "set dynamo_backend to NO or remove '",
                           key, "'");
  }
  ACCELERATE_CHECK_VALUE(config.num_processes >= 1, "[load_config_from_file] ", path,
                         ": num_processes must be >= 1, got ", config.num_processes);
  ACCELERATE_CHECK_VALUE(config.num_machines >= 1, "[load_config_from_file] ", path,
                         ": num_machines must be >= 1, got ", config.num_machines);
  ACCELERATE_CHECK_VALUE(config.machine_rank >= 0 && config.machine_rank < config.num_machines,
                         "[load_config_from_file] ", path, ": machine_rank ", config.machine_rank,
                         " is outside [0, num_machines=", config.num_machines, ")");
  return config;
}

void save_config_file(const ClusterConfig& config, const std::string& path) {
  const fs::path target(path);
  std::string text;
  if (target.extension() == ".json") {
    // nlohmann's objects keep their keys sorted, as `json.dumps(sort_keys=True)` does.
    nlohmann::json json = {{"compute_environment", config.compute_environment},
                           {"debug", config.debug},
                           {"distributed_type", config.use_fsdp ? "FSDP" : to_string(config.distributed_type)},
                           {"downcast_bf16", config.downcast_bf16},
                           {"enable_cpu_affinity", config.enable_cpu_affinity},
                           {"machine_rank", config.machine_rank},
                           {"main_training_function", config.main_training_function},
                           {"mixed_precision", config.mixed_precision},
                           {"num_machines", config.num_machines},
                           {"num_processes", config.num_processes},
                           {"rdzv_backend", config.rdzv_backend},
                           {"same_network", config.same_network},
                           {"tpu_env", nlohmann::json::array()},
                           {"tpu_use_cluster", false},
                           {"tpu_use_sudo", false},
                           {"use_cpu", config.use_cpu}};
    if (config.gpu_ids) json["gpu_ids"] = *config.gpu_ids;
    if (config.main_process_ip) json["main_process_ip"] = *config.main_process_ip;
    if (config.main_process_port) json["main_process_port"] = *config.main_process_port;
    if (config.mpirun_hostfile) json["mpirun_config"] = {{"mpirun_hostfile", *config.mpirun_hostfile}};
    if (!config.fsdp_config.empty()) json["fsdp_config"] = config.fsdp_config;
    if (!config.parallelism_config.empty()) {
      for (const auto& [key, value] : config.parallelism_config) {
        // Sizes are numbers in upstream's file, the backend and strategy strings.
        if (is_parallelism_size(key)) {
          json["parallelism_config"][key] = std::stoi(value);
        } else {
          json["parallelism_config"][key] = value;
        }
      }
    }
    text = json.dump(2) + "\n";
  } else {
    YAML::Emitter out;
    out << YAML::BeginMap;
    auto quoted = [&](const char* key, const std::string& value) {
      out << YAML::Key << key << YAML::Value;
      // Strings YAML would read as booleans or numbers are quoted, as yaml.safe_dump does.
      if (needs_quotes(value)) {
        out << YAML::SingleQuoted << value;
      } else {
        out << value;
      }
    };
    // Keys in sorted order, as upstream writes them.
    quoted("compute_environment", config.compute_environment);
    out << YAML::Key << "debug" << YAML::Value << config.debug;
    quoted("distributed_type", config.use_fsdp ? "FSDP" : to_string(config.distributed_type));
    out << YAML::Key << "downcast_bf16" << YAML::Value << config.downcast_bf16;
    out << YAML::Key << "enable_cpu_affinity" << YAML::Value << config.enable_cpu_affinity;
    if (!config.fsdp_config.empty()) {
      out << YAML::Key << "fsdp_config" << YAML::Value << YAML::BeginMap;
      for (const auto& [key, value] : config.fsdp_config) quoted(key.c_str(), value);
      out << YAML::EndMap;
    }
    if (config.gpu_ids) quoted("gpu_ids", *config.gpu_ids);
    out << YAML::Key << "machine_rank" << YAML::Value << config.machine_rank;
    if (config.main_process_ip) quoted("main_process_ip", *config.main_process_ip);
    if (config.main_process_port) out << YAML::Key << "main_process_port" << YAML::Value << *config.main_process_port;
    quoted("main_training_function", config.main_training_function);
    quoted("mixed_precision", config.mixed_precision);
    if (config.mpirun_hostfile) {
      out << YAML::Key << "mpirun_config" << YAML::Value << YAML::BeginMap;
      quoted("mpirun_hostfile", *config.mpirun_hostfile);
      out << YAML::EndMap;
    }
    out << YAML::Key << "num_machines" << YAML::Value << config.num_machines;
    out << YAML::Key << "num_processes" << YAML::Value << config.num_processes;
    if (!config.parallelism_config.empty()) {
      out << YAML::Key << "parallelism_config" << YAML::Value << YAML::BeginMap;
      for (const auto& [key, value] : config.parallelism_config) {
        out << YAML::Key << key << YAML::Value;
        if (is_parallelism_size(key)) {
          out << std::stoi(value);
        } else {
          out << value;
        }
      }
      out << YAML::EndMap;
    }
    quoted("rdzv_backend", config.rdzv_backend);
    out << YAML::Key << "same_network" << YAML::Value << config.same_network;
    out << YAML::Key << "tpu_env" << YAML::Value << YAML::Flow << YAML::BeginSeq << YAML::EndSeq;
    out << YAML::Key << "tpu_use_cluster" << YAML::Value << false;
    out << YAML::Key << "tpu_use_sudo" << YAML::Value << false;
    out << YAML::Key << "use_cpu" << YAML::Value << config.use_cpu;
    out << YAML::EndMap;
    text = std::string(out.c_str()) + "\n";
  }

  try {
    if (target.has_parent_path()) fs::create_directories(target.parent_path());
    detail::write_file_atomically(path, text);
  } catch (const std::exception& e) {
    ACCELERATE_CHECK(false, "[save_config_file] cannot write ", path, ": ", e.what());
  }
}

}  // namespace accelerate::commands
