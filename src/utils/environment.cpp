// Environment and platform utilities; see include/accelerate/utils/environment.h.
#include "accelerate/utils/environment.h"

#include "accelerate/utils/dataclasses.h"
#include "build_config.h"
#include "detail/topology.h"
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
