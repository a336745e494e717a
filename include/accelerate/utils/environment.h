// Environment and platform utilities (upstream: accelerate/utils/environment.py, imports.py and
// the environment helpers of other.py): reading flags from the environment, patching it for a
// scope, availability checks for back-ends, version comparison and NUMA affinity. Checks for
// Python-only back-ends (TPU, MPS, XPU, NPU, …) exist so ported code compiles, and answer false.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace accelerate {

/// Reads an environment variable, or `std::nullopt` when it is unset.
std::optional<std::string> get_env(const std::string& key);

/// Reads a boolean flag from the environment, `default_value` when unset (upstream:
/// `parse_flag_from_env`); a value that is not a boolean throws naming the variable.
bool parse_flag_from_env(const std::string& key, bool default_value = false);

/// Returns the first of `keys` that holds a non-negative integer, else `default_value` (upstream:
/// `get_int_from_env`); a non-integer value throws naming the variable.
int get_int_from_env(const std::vector<std::string>& keys, int default_value);

/// Sets environment variables for its lifetime and restores the previous values (or absence)
/// on destruction, even when unwinding (upstream: `patch_environment`). Keys are upper-cased.
///
/// Example:
///   { auto env = accelerate::patch_environment({{"foo", "bar"}});  // sets FOO=bar
///     ... }                                                         // FOO restored
class [[nodiscard]] EnvironmentPatch {
 public:
  explicit EnvironmentPatch(const std::map<std::string, std::string>& values);
  ~EnvironmentPatch() noexcept;
  EnvironmentPatch(const EnvironmentPatch&) = delete;
  EnvironmentPatch& operator=(const EnvironmentPatch&) = delete;
  EnvironmentPatch(EnvironmentPatch&&) = delete;
  EnvironmentPatch& operator=(EnvironmentPatch&&) = delete;

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

/// See `EnvironmentPatch`.
[[nodiscard]] inline EnvironmentPatch patch_environment(const std::map<std::string, std::string>& values) {
  return EnvironmentPatch(values);
}

/// Empties the environment for its lifetime and restores it exactly on destruction, dropping
/// whatever was added meanwhile (upstream: `clear_environment`).
class [[nodiscard]] EnvironmentClear {
 public:
  EnvironmentClear();
  ~EnvironmentClear() noexcept;
  EnvironmentClear(const EnvironmentClear&) = delete;
  EnvironmentClear& operator=(const EnvironmentClear&) = delete;
  EnvironmentClear(EnvironmentClear&&) = delete;
  EnvironmentClear& operator=(EnvironmentClear&&) = delete;

 private:
  std::vector<std::pair<std::string, std::string>> saved_;
};

/// See `EnvironmentClear`.
[[nodiscard]] inline EnvironmentClear clear_environment() { return EnvironmentClear(); }

/// A snapshot of every `ACCELERATE_*` variable; used by `purge_accelerate_environment`.
std::map<std::string, std::string> accelerate_environment();
/// Restores the `ACCELERATE_*` variables to `snapshot`: changed ones get their old value back,
/// added ones are removed.
void restore_accelerate_environment(const std::map<std::string, std::string>& snapshot);

/// Wraps `fn` so that every `ACCELERATE_*` variable it sets or changes is undone when it returns
/// or throws (upstream: the `purge_accelerate_environment` decorator).
template <typename Fn>
auto purge_accelerate_environment(Fn fn) {
  return [fn = std::move(fn)](auto&&... args) -> decltype(auto) {
    struct Restore {
      std::map<std::string, std::string> snapshot = accelerate_environment();
      ~Restore() { restore_accelerate_environment(snapshot); }
    } restore;
    return fn(std::forward<decltype(args)>(args)...);
  };
}

/// Whether `lhs op rhs` holds for dotted version strings ("1.13.1" >= "1.13"); `op` is one of
/// "<", "<=", "==", "!=", ">=", ">" (upstream: `compare_versions`).
bool compare_versions(std::string_view lhs, std::string_view op, std::string_view rhs);
/// Whether the LibTorch this program runs with satisfies `op version` (upstream: `is_torch_version`).
bool is_torch_version(std::string_view op, std::string_view version);
/// The LibTorch version, e.g. "1.13.1".
std::string torch_version();
/// This library's version.
std::string accelerate_version();

/// Whether CUDA devices are usable by this LibTorch build.
bool is_cuda_available();
/// Whether bf16 arithmetic is available on the default device (true on CPU).
bool is_bf16_available(bool ignore_tpu = false);
/// Whether fp16 mixed precision can run (it needs CUDA).
bool is_fp16_available();
/// Whether LibTorch was built with the Gloo process group.
bool is_gloo_available();
/// Whether LibTorch was built with the NCCL process group.
bool is_nccl_available();
/// Whether the MPI back-end of accelerate-cpp is available.
bool is_mpi_available();
/// Whether libnuma was found at build time (needed by `set_numa_affinity`).
bool is_numa_available();
/// Python-only back-ends: always false in accelerate-cpp.
inline bool is_mps_available() { return false; }
inline bool is_xpu_available() { return false; }
inline bool is_npu_available() { return false; }
inline bool is_mlu_available() { return false; }
inline bool is_musa_available() { return false; }
inline bool is_hpu_available() { return false; }
inline bool is_torch_xla_available() { return false; }
inline bool is_deepspeed_available() { return false; }
inline bool is_ipex_available() { return false; }

/// Binds this process to the NUMA node matching `local_process_index` (round robin over the
/// machine's nodes: its CPUs, and its memory as the preferred node) and returns the node, every
/// time it is called (upstream: `override_numa_affinity`). With `verbose` (default: the flag
/// ACCELERATE_DEBUG_MODE) it logs "Assigning N cpu cores to process I: {…}" at INFO through the
/// logger "accelerate.utils.environment". Throws when libnuma is not available. (Upstream binds to
/// the CPUs NVML reports for the process's GPU, and does nothing without one; a GPU's CPUs are
/// its NUMA node's, and a CPU job has its node by this round robin.)
int override_numa_affinity(int local_process_index, std::optional<bool> verbose = std::nullopt);
/// `override_numa_affinity` once per process and arguments: a later call with the same arguments
/// returns the node of the first without binding again (upstream: `set_numa_affinity`, memoised;
/// call `override_numa_affinity` to bind anew). `accelerate launch --enable_cpu_affinity` makes
/// every process call it when its state is created.
int set_numa_affinity(int local_process_index, std::optional<bool> verbose = std::nullopt);

}  // namespace accelerate
