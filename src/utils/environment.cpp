// Environment and platform utilities; see include/accelerate/utils/environment.h.
#include "accelerate/utils/environment.h"

#include "accelerate/utils/dataclasses.h"
#include "build_config.h"
#include "detail/env.h"
#include "detail/warn.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#if ACCELERATE_HAVE_NUMA
#include <numa.h>
#include <sched.h>
#endif

namespace accelerate {
namespace {

std::string upper(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::toupper(c); });
  return text;
}

void set_or_unset(const std::string& key, const std::optional<std::string>& value) {
  if (value) {
    ::setenv(key.c_str(), value->c_str(), /*overwrite=*/1);
  } else {
    ::unsetenv(key.c_str());
  }
}

std::vector<long> parse_version(std::string_view text) {
  std::vector<long> parts;
  long current = -1;
  for (char c : text) {
    if (std::isdigit(static_cast<unsigned char>(c))) {
      current = (current < 0 ? 0 : current * 10) + (c - '0');
    } else if (c == '.') {
      parts.push_back(current < 0 ? 0 : current);
      current = -1;
    } else {
      break;  // local suffixes such as "+cpu" or "a0" do not take part in the comparison
    }
  }
  if (current >= 0) parts.push_back(current);
  TORCH_CHECK_VALUE(!parts.empty(), "[compare_versions] expected a dotted version such as 1.13.1, got '", text, "'");
  return parts;
}

}  // namespace

std::optional<std::string> get_env(const std::string& key) {
  const char* value = std::getenv(key.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

bool parse_flag_from_env(const std::string& key, bool default_value) {
  auto value = get_env(key);
  if (!value || value->empty()) return default_value;
  try {
    return str_to_bool(*value);
  } catch (const c10::ValueError&) {
    C10_THROW_ERROR(ValueError, c10::str("[parse_flag_from_env] environment variable ", key,
                      " must be a boolean (1/0, true/false, yes/no), got '", *value, "'"));
  }
}

int get_int_from_env(const std::vector<std::string>& keys, int default_value) {
  for (const auto& key : keys) {
    auto value = get_env(key);
    if (!value || value->empty()) continue;
    size_t used = 0;
    int parsed = 0;
    try {
      parsed = std::stoi(*value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TORCH_CHECK_VALUE(used == value->size() && used > 0, "[get_int_from_env] environment variable ", key,
                      " must be an integer, got '", *value, "'");
    if (parsed >= 0) return parsed;  // as upstream, a negative value counts as unset

  }
  return default_value;
}

EnvironmentPatch::EnvironmentPatch(const std::map<std::string, std::string>& values) {
  saved_.reserve(values.size());
  for (const auto& [raw_key, value] : values) {
    std::string key = upper(raw_key);
    saved_.emplace_back(key, get_env(key));
    ::setenv(key.c_str(), value.c_str(), /*overwrite=*/1);
  }
}

EnvironmentPatch::~EnvironmentPatch() noexcept {
  for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) set_or_unset(it->first, it->second);
}

EnvironmentClear::EnvironmentClear() : saved_(detail::environment_entries()) {
  for (const auto& [key, value] : saved_) ::unsetenv(key.c_str());
}

EnvironmentClear::~EnvironmentClear() noexcept {
  for (const auto& [key, value] : detail::environment_entries()) ::unsetenv(key.c_str());
  for (const auto& [key, value] : saved_) ::setenv(key.c_str(), value.c_str(), /*overwrite=*/1);
}

std::map<std::string, std::string> accelerate_environment() {
  std::map<std::string, std::string> out;
  for (auto& [key, value] : detail::environment_entries()) {
    if (key.rfind("ACCELERATE_", 0) == 0) out.emplace(std::move(key), std::move(value));
  }
  return out;
}

void restore_accelerate_environment(const std::map<std::string, std::string>& snapshot) {
  for (const auto& [key, value] : accelerate_environment()) {
    if (snapshot.count(key) == 0) ::unsetenv(key.c_str());
  }
  for (const auto& [key, value] : snapshot) ::setenv(key.c_str(), value.c_str(), /*overwrite=*/1);
}

bool compare_versions(std::string_view lhs, std::string_view op, std::string_view rhs) {
  auto a = parse_version(lhs);
  auto b = parse_version(rhs);
  const size_t n = std::max(a.size(), b.size());
  a.resize(n, 0);
  b.resize(n, 0);
  const int cmp = a < b ? -1 : (a == b ? 0 : 1);
  if (op == "<") return cmp < 0;
  if (op == "<=") return cmp <= 0;
  if (op == "==") return cmp == 0;
  if (op == "!=") return cmp != 0;
  if (op == ">=") return cmp >= 0;
  if (op == ">") return cmp > 0;
  C10_THROW_ERROR(ValueError, c10::str("[compare_versions] expected an operation among <, <=, ==, !=, >=, >, got '", op, "'"));
}

std::string torch_version() {
  return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
         std::to_string(TORCH_VERSION_PATCH);
}

bool is_torch_version(std::string_view op, std::string_view version) {
  return compare_versions(torch_version(), op, version);
}

std::string accelerate_version() { return ACCELERATE_VERSION; }

bool is_cuda_available() { return torch::cuda::is_available(); }

bool is_bf16_available(bool /*ignore_tpu*/) {
  // CPU bf16 goes through oneDNN on every x86-64 LibTorch; CUDA needs compute capability 8.0+,
  // which LibTorch's C++ API does not expose without the CUDA headers, so a CUDA build answers
  // true as upstream does for CPU and lets autocast report an unsupported device.
  return true;
}

bool is_fp16_available() { return is_cuda_available(); }

bool is_gloo_available() {
#ifdef USE_C10D_GLOO
  return true;
#else
  return false;
#endif
}

bool is_nccl_available() {
#ifdef USE_C10D_NCCL
  return true;
#else
  return false;
#endif
}

bool is_mpi_available() { return ACCELERATE_HAVE_MPI != 0; }

bool is_numa_available() {
#if ACCELERATE_HAVE_NUMA
  return numa_available() >= 0;
#else
  return false;
#endif
}

int override_numa_affinity(int local_process_index, std::optional<bool> verbose) {
  TORCH_CHECK_VALUE(local_process_index >= 0, "[set_numa_affinity] expected a local process index >= 0, got ",
                    local_process_index);
#if ACCELERATE_HAVE_NUMA
  TORCH_CHECK(numa_available() >= 0, "[set_numa_affinity] the kernel reports no NUMA support on this machine");
  const int nodes = numa_num_configured_nodes();
  TORCH_CHECK(nodes > 0, "[set_numa_affinity] libnuma found no configured NUMA node");
  const int node = local_process_index % nodes;
  TORCH_CHECK(numa_run_on_node(node) == 0, "[set_numa_affinity] could not bind to NUMA node ", node, ": ",
              std::strerror(errno));
  numa_set_preferred(node);
  if (verbose.value_or(parse_flag_from_env("ACCELERATE_DEBUG_MODE"))) {
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    std::vector<int> assigned;
    if (sched_getaffinity(0, sizeof cpus, &cpus) == 0) {
      for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
        if (CPU_ISSET(cpu, &cpus)) assigned.push_back(cpu);
      }
    }
    detail::log(LogLevel::kInfo, "accelerate.utils.environment",
                c10::str("Assigning ", assigned.size(), " cpu cores to process ", local_process_index, ": {",
                         c10::Join(", ", assigned), "}"),
                {.every_process = true});
  }
  return node;
#else
  (void)verbose;
  C10_THROW_ERROR(Error, c10::str("[set_numa_affinity] accelerate-cpp was built without libnuma (install libnuma-dev and rebuild)"));
#endif
}

int set_numa_affinity(int local_process_index, std::optional<bool> verbose) {
  static std::mutex mutex;
  static std::map<std::pair<int, std::optional<bool>>, int> bound;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(local_process_index, verbose);
  if (auto it = bound.find(key); it != bound.end()) return it->second;
  const int node = override_numa_affinity(local_process_index, verbose);
  bound.emplace(key, node);
  return node;
}

}  // namespace accelerate
