// `accelerate env`; see include/accelerate/commands/env.h.
#include "accelerate/commands/env.h"

#include "accelerate/commands/config.h"
#include "accelerate/utils/environment.h"
#include "commands/cli.h"
#include "detail/blas.h"
#include "detail/files.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <gnu/libc-version.h>
#include <ostream>
#include <sched.h>
#include <sstream>
#include <sys/utsname.h>
#include <thread>
#include <unistd.h>

namespace accelerate::commands {
namespace {

namespace fs = std::filesystem;

std::string compiler() {
#if defined(__clang__)
  return "Clang " __clang_version__;
#elif defined(__GNUC__)
  return "GCC " __VERSION__;
#elif defined(_MSC_VER)
  return "MSVC " + std::to_string(_MSC_VER);
#else
  return "unknown";
#endif
}

std::string cxx_standard() {
  const long value = __cplusplus;
  const std::string name = value > 202002L    ? "C++23"
                           : value >= 202002L ? "C++20"
                           : value >= 201703L ? "C++17"
                                              : "C++14";
  return name + " (__cplusplus = " + std::to_string(value) + ")";
}

std::string platform() {
  struct utsname names {};
  if (::uname(&names) != 0) return "unknown";
  return std::string(names.sysname) + " " + names.release + " " + names.machine + " (glibc " +
         ::gnu_get_libc_version() + ")";
}

std::string cpu() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string model = "unknown model";
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  const int usable = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : -1;
  return model + " (" + std::to_string(std::thread::hardware_concurrency()) + " logical cores, " +
         (usable > 0 ? std::to_string(usable) : std::string("?")) + " usable by this process)";
}

std::string system_ram() {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    long long kilobytes = 0;
    meminfo >> kilobytes;
    if (key == "MemTotal:") {
      char text[32];
      std::snprintf(text, sizeof(text), "%.2f GB", static_cast<double>(kilobytes) / (1024.0 * 1024.0));
      return text;
    }
    meminfo.ignore(256, '\n');
  }
  return "unknown";
}

std::string env_or_unset(const char* key) { return get_env(key).value_or("unset"); }

std::string self_executable() {
  std::error_code error;
  const auto path = fs::read_symlink("/proc/self/exe", error);
  return error ? "unknown" : path.string();
}

}  // namespace

BlasInfo detect_blas() {
  auto found = detail::detect_blas();
  return {std::move(found.name), std::move(found.library), std::move(found.loaded), std::move(found.config)};
}

std::vector<std::pair<std::string, std::string>> environment_info() {
  const bool cuda = is_cuda_available();
  const BlasInfo blas = detect_blas();
  auto yes_no = [](bool value) { return value ? std::string("yes") : std::string("no"); };
  std::vector<std::pair<std::string, std::string>> info = {
      {"`accelerate-cpp` version", accelerate_version()},
      {"`accelerate` location", self_executable()},
      {"Platform", platform()},
      {"Compiler", compiler()},
      {"C++ standard", cxx_standard()},
      {"LibTorch version", torch_version()},
      {"LibTorch threads", std::to_string(at::get_num_threads()) + " intra-op, " +
                               std::to_string(at::get_num_interop_threads()) + " inter-op"},
      {"CPU", cpu()},
      {"System RAM", system_ram()},
      {"PyTorch accelerator", cuda ? "CUDA" : "N/A"},
      {"CUDA devices", cuda ? std::to_string(torch::cuda::device_count()) : "0 (CUDA not available)"},
      {"Gloo available", yes_no(is_gloo_available())},
      {"NCCL available", yes_no(is_nccl_available())},
      {"MPI available", yes_no(is_mpi_available())},
      {"Default CPU back-end", is_mpi_available() ? "mpi for `accelerate launch` on one machine and under mpirun, "
                                                    "gloo otherwise"
                                                  : "gloo"},
      {"BLAS", blas.name + (blas.library.empty() ? "" : " (" + blas.library + ")")},
  };
  if (!blas.config.empty()) info.emplace_back("BLAS build", blas.config);
  std::string loaded;
  for (const auto& path : blas.loaded) loaded += (loaded.empty() ? "" : ", ") + path;
  info.emplace_back("BLAS/LAPACK libraries loaded", loaded.empty() ? "none" : loaded);
  info.emplace_back("Thread settings", "OMP_NUM_THREADS=" + env_or_unset("OMP_NUM_THREADS") +
                                           ", OPENBLAS_NUM_THREADS=" + env_or_unset("OPENBLAS_NUM_THREADS") +
                                           ", MKL_NUM_THREADS=" + env_or_unset("MKL_NUM_THREADS"));
  return info;
}

int env_main(const std::vector<std::string>& args, std::istream& /*in*/, std::ostream& out, std::ostream& err) {
  CLI::App app{"Prints the versions and settings a bug report needs.", "accelerate env"};
  app.set_help_flag("-h,--help", "Show this help and exit");
  std::optional<std::string> config_file;
  app.add_option_function<std::string>(
      detail::cli_spellings("config_file"), [&](const std::string& v) { config_file = v; },
      "The configuration file to show (default: the default configuration file)");
  if (auto code = detail::parse_cli(app, args, "env", out, err)) return *code;

  return detail::run_cli_command("env", err, [&] {
    const std::string path = config_file.value_or(default_config_file());
    TORCH_CHECK_VALUE(!config_file || fs::is_regular_file(path), "[env] the configuration file ", path,
                      " does not exist");
    out << "\nCopy-and-paste the text below in your GitHub issue\n\n";
    for (const auto& [label, value] : environment_info()) out << "- " << label << ": " << value << "\n";
    out << (config_file ? "- `Accelerate` config passed: " : "- `Accelerate` default config: ");
    if (!fs::is_regular_file(path)) {
      out << "Not found (no file at " << path << ")\n";
      return 0;
    }
    out << path << "\n";
    std::istringstream text(detail::read_file(path));
    for (std::string line; std::getline(text, line);) out << "\t" << line << "\n";
    try {
      (void)load_config_from_file(path);
    } catch (const std::exception& e) {
      out << "\t(this file is not usable by accelerate-cpp: " << detail::error_text(e) << ")\n";
    }
    return 0;
  });
}

}  // namespace accelerate::commands
