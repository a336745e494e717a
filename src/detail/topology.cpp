// Topology detection from launcher environments; see env.h.
#include "detail/topology.h"

#include "detail/check.h"

#include <cctype>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <unistd.h>  // environ

namespace accelerate::detail {

EnvLookup process_env() {
  return [](const std::string& key) -> std::optional<std::string> {
    const char* value = std::getenv(key.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

EnvLookup map_env(std::map<std::string, std::string> values) {
  return [values = std::move(values)](const std::string& key) -> std::optional<std::string> {
    auto it = values.find(key);
    if (it == values.end()) return std::nullopt;
    return it->second;
  };
}

std::string to_string(LauncherFamily family) {
  switch (family) {
    case LauncherFamily::kNone: return "none";
    case LauncherFamily::kTorchrun: return "torchrun";
    case LauncherFamily::kSlurm: return "slurm";
    case LauncherFamily::kMpi: return "mpi";
  }
  return "unknown";
}

std::vector<std::pair<std::string, std::string>> environment_entries() {
  std::vector<std::pair<std::string, std::string>> entries;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const char* eq = std::strchr(*entry, '=');
    if (eq == nullptr) continue;
    entries.emplace_back(std::string(*entry, static_cast<size_t>(eq - *entry)), std::string(eq + 1));
  }
  return entries;
}

int parse_env_int(const std::string& key, const std::string& value) {
  size_t used = 0;
  long parsed = 0;
  try {
    parsed = std::stol(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  ACCELERATE_CHECK_VALUE(used > 0 && used == value.size() && parsed >= INT32_MIN && parsed <= INT32_MAX,
                         "[PartialState] environment variable ", key, " must be an integer, got '", value, "'");
  return static_cast<int>(parsed);
}

std::string first_slurm_host(std::string_view nodelist) {
  // Hosts are separated by commas outside brackets; each bracket holds suffixes (single ones or
  // ranges), of which the first is taken: "rack[1-2]-node[01-04]" → "rack1-node01".
  std::string host;
  size_t i = 0;
  while (i < nodelist.size() && nodelist[i] != ',') {
    if (nodelist[i] != '[') {
      host += nodelist[i++];
      continue;
    }
    ++i;
    std::string suffix;
    for (; i < nodelist.size() && (std::isalnum(static_cast<unsigned char>(nodelist[i])) != 0); ++i) {
      suffix += nodelist[i];
    }
    ACCELERATE_CHECK_VALUE(!suffix.empty(), "[PartialState] cannot read a host from the Slurm node list '", nodelist,
                           "'");
    host += suffix;
    while (i < nodelist.size() && nodelist[i] != ']') ++i;
    ACCELERATE_CHECK_VALUE(i < nodelist.size(), "[PartialState] cannot read a host from the Slurm node list '",
                           nodelist, "' (unclosed bracket)");
    ++i;
  }
  ACCELERATE_CHECK_VALUE(!host.empty(), "[PartialState] cannot read a host from the Slurm node list '", nodelist, "'");
  return host;
}

int parse_slurm_tasks_per_node(std::string_view text, const char* variable) {
  size_t end = 0;
  while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end])) != 0) ++end;
  ACCELERATE_CHECK_VALUE(end > 0, "[PartialState] cannot read a task count from ", variable, "='", text, "'");
  return parse_env_int(variable, std::string(text.substr(0, end)));
}

namespace {

std::optional<int> int_var(const EnvLookup& env, const std::string& key) {
  auto value = env(key);
  if (!value || value->empty()) return std::nullopt;
  return parse_env_int(key, *value);
}

// A variable whose presence selected the launcher family, so it must hold an integer.
int required_int_var(const EnvLookup& env, const std::string& key) {
  return parse_env_int(key, env(key).value_or(""));
}

// Fills the rendezvous address from MASTER_ADDR/MASTER_PORT when set.
void read_master(const EnvLookup& env, Topology& topo) {
  if (auto addr = env("MASTER_ADDR"); addr && !addr->empty()) topo.master_addr = *addr;
  if (auto port = int_var(env, "MASTER_PORT")) topo.master_port = *port;
}

void validate(const Topology& topo, const char* rank_var, const char* size_var, const char* local_var,
              const char* local_size_var) {
  ACCELERATE_CHECK_VALUE(topo.world_size >= 1, "[PartialState] ", size_var, " must be at least 1, got ",
                         topo.world_size);
  ACCELERATE_CHECK_VALUE(topo.rank >= 0 && topo.rank < topo.world_size, "[PartialState] ", rank_var, "=", topo.rank,
                         " is outside [0, ", size_var, "=", topo.world_size, ")");
  ACCELERATE_CHECK_VALUE(topo.local_world_size >= 1 && topo.local_world_size <= topo.world_size, "[PartialState] ",
                         local_size_var, "=", topo.local_world_size, " must be between 1 and ", size_var, "=",
                         topo.world_size);
  ACCELERATE_CHECK_VALUE(topo.local_rank >= 0 && topo.local_rank < topo.local_world_size, "[PartialState] ", local_var,
                         "=", topo.local_rank, " is outside [0, ", local_size_var, "=", topo.local_world_size, ")");
  ACCELERATE_CHECK_VALUE(topo.master_port >= 0 && topo.master_port <= 65535,
                         "[PartialState] MASTER_PORT must be a TCP port (0-65535), got ", topo.master_port);
}

}  // namespace

Topology detect_topology(const EnvLookup& env) {
  Topology topo;
  if (env("WORLD_SIZE") || env("RANK")) {
    topo.family = LauncherFamily::kTorchrun;
    topo.world_size = int_var(env, "WORLD_SIZE").value_or(1);
    topo.rank = int_var(env, "RANK").value_or(0);
    topo.local_rank = int_var(env, "LOCAL_RANK").value_or(topo.rank);
    topo.local_world_size = int_var(env, "LOCAL_WORLD_SIZE").value_or(topo.world_size);
    read_master(env, topo);
    validate(topo, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
    return topo;
  }
  if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    topo.family = LauncherFamily::kSlurm;
    topo.rank = required_int_var(env, "SLURM_PROCID");
    topo.world_size = required_int_var(env, "SLURM_NTASKS");
    topo.local_rank = int_var(env, "SLURM_LOCALID").value_or(0);
    if (auto per_node = env("SLURM_NTASKS_PER_NODE"); per_node && !per_node->empty()) {
      topo.local_world_size = parse_slurm_tasks_per_node(*per_node, "SLURM_NTASKS_PER_NODE");
    } else if (auto tasks = env("SLURM_STEP_TASKS_PER_NODE"); tasks && !tasks->empty()) {
      topo.local_world_size = parse_slurm_tasks_per_node(*tasks, "SLURM_STEP_TASKS_PER_NODE");
    } else if (auto tasks = env("SLURM_TASKS_PER_NODE"); tasks && !tasks->empty()) {
      topo.local_world_size = parse_slurm_tasks_per_node(*tasks, "SLURM_TASKS_PER_NODE");
    } else {
      topo.local_world_size = topo.world_size;
    }
    // On one node the store is local; across nodes it lives on the first host of the step.
    const int nodes = int_var(env, "SLURM_NNODES").value_or(topo.local_world_size < topo.world_size ? 2 : 1);
    if (nodes > 1) {
      auto list = env("SLURM_STEP_NODELIST");
      if (!list || list->empty()) list = env("SLURM_JOB_NODELIST");
      if (list && !list->empty()) topo.master_addr = first_slurm_host(*list);
    }
    read_master(env, topo);
    validate(topo, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE");
    return topo;
  }
  if (env("OMPI_COMM_WORLD_SIZE")) {
    topo.family = LauncherFamily::kMpi;
    topo.world_size = required_int_var(env, "OMPI_COMM_WORLD_SIZE");
    topo.rank = int_var(env, "OMPI_COMM_WORLD_RANK").value_or(0);
    topo.local_rank = int_var(env, "OMPI_COMM_WORLD_LOCAL_RANK").value_or(topo.rank);
    topo.local_world_size = int_var(env, "OMPI_COMM_WORLD_LOCAL_SIZE").value_or(topo.world_size);
    read_master(env, topo);
    validate(topo, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE");
    const auto master = env("MASTER_ADDR");
    ACCELERATE_CHECK_VALUE(topo.local_world_size == topo.world_size || (master && !master->empty()),
                           "[PartialState] an Open MPI job spanning several machines needs MASTER_ADDR set to the "
                           "address of the machine running rank 0");
    return topo;
  }
  if (env("PMI_SIZE") && env("PMI_RANK")) {
    topo.family = LauncherFamily::kMpi;
    topo.world_size = required_int_var(env, "PMI_SIZE");
    topo.rank = required_int_var(env, "PMI_RANK");
    topo.local_rank = int_var(env, "MPI_LOCALRANKID").value_or(topo.rank);
    topo.local_world_size = int_var(env, "MPI_LOCALNRANKS").value_or(topo.world_size);
    read_master(env, topo);
    validate(topo, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS");
    return topo;
  }
  read_master(env, topo);
  validate(topo, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  return topo;
}

}  // namespace accelerate::detail
