// Reading the job's topology from the environment: torchrun-style variables, else Slurm, else
// Open MPI (and MPICH's PMI), else a single process. Pure functions over an environment lookup
// so that every launcher family is unit-testable without touching the real environment.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace accelerate::detail {

/// Looks up one environment variable.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

/// The real process environment.
EnvLookup process_env();
/// A lookup over a fixed map, for tests.
EnvLookup map_env(std::map<std::string, std::string> values);

/// Which launcher family described the job.
enum class LauncherFamily { kNone, kTorchrun, kSlurm, kMpi };
std::string to_string(LauncherFamily family);

/// Where this process stands in the job.
struct Topology {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  LauncherFamily family = LauncherFamily::kNone;
};

/// Reads the topology; throws `c10::ValueError` naming the variable for malformed or inconsistent
/// values (a rank outside the world size, a non-integer, …).
Topology detect_topology(const EnvLookup& env);

/// The first host of a Slurm node list: "node[07-09,12],gpu3" → "node07".
std::string first_slurm_host(std::string_view nodelist);
/// Tasks on the first node from a Slurm tasks-per-node list: "4(x2),3" → 4; errors name `variable`.
int parse_slurm_tasks_per_node(std::string_view text, const char* variable = "SLURM_NTASKS_PER_NODE");

/// Every variable of the process environment, in its order.
std::vector<std::pair<std::string, std::string>> environment_entries();

/// Parses an integer environment value, throwing with the variable name.
int parse_env_int(const std::string& key, const std::string& value);

}  // namespace accelerate::detail
