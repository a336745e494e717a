// `accelerate env`: the facts a bug report needs, ready to paste (upstream:
// accelerate/commands/env.py). Besides upstream's list (versions, platform, memory, accelerator,
// configuration) it names what decides speed and correctness in C++: the compiler and C++
// standard the library was built with, the CPU, the process-group back-ends, and the BLAS library
// LibTorch's float32 matrix products actually run on, with the thread settings that steer it.
//
// Example:
//   accelerate env --config_file cpu.yaml
#pragma once

#include <iosfwd>
#include <string>
#include <utility>
#include <vector>

namespace accelerate::commands {

/// The BLAS library in use.
struct BlasInfo {
  /// "OpenBLAS", "Intel MKL", "BLIS", "ATLAS", "FlexiBLAS", "reference BLAS (Netlib)", or
  /// "not found" when no BLAS library is loaded (LibTorch may then carry its own).
  std::string name;
  /// The shared object that provides `sgemm_` (else the first BLAS-like one loaded).
  std::string library;
  /// Every BLAS/LAPACK-like shared object mapped into this process.
  std::vector<std::string> loaded;
  /// OpenBLAS's own description of its build (`openblas_get_config`), when OpenBLAS is loaded.
  std::string config;
};

/// Runs a small float32 matrix product, then looks at the shared objects mapped into this process
/// (/proc/self/maps) and at which of them provides `sgemm_`, to name the BLAS library in use.
BlasInfo detect_blas();

/// Labels and values of the report, in order (upstream: the `info` of `env_command`).
std::vector<std::pair<std::string, std::string>> environment_info();

/// `accelerate env [--config_file F]`: prints the report and the configuration file's contents
/// (the default file, or that there is none). Returns 0, 1 on an error (printed to `err`), 2 for a
/// usage error.
int env_main(const std::vector<std::string>& args, std::istream& in, std::ostream& out, std::ostream& err);

}  // namespace accelerate::commands
