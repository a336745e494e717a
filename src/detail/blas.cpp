// BLAS detection; see src/detail/blas.h.
#include "detail/blas.h"
#include "detail/text.h"
#include "detail/warn.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <dlfcn.h>
#include <filesystem>
#include <fstream>
#include <mutex>

namespace accelerate::detail {
namespace {

namespace fs = std::filesystem;

}  // namespace

std::string blas_family(const std::string& path) {
  const std::string name = ascii_lower(path);
  if (name.find("mkl") != std::string::npos) return "Intel MKL";
  if (name.find("openblas") != std::string::npos) return "OpenBLAS";
  if (name.find("blis") != std::string::npos) return "BLIS";
  if (name.find("atlas") != std::string::npos) return "ATLAS";
  if (name.find("flexiblas") != std::string::npos) return "FlexiBLAS";
  if (name.find("libblas") != std::string::npos) return "reference BLAS (Netlib)";
  return "";
}

bool is_reference_blas(const std::string& family) { return family == "reference BLAS (Netlib)"; }

BlasInfo detect_blas() {
  {
    // Make sure the BLAS library is loaded and bound, as it is in a training step.
    const at::Tensor a = at::ones({64, 64}, at::kFloat);
    (void)at::mm(a, a).sum().item<float>();
  }
  BlasInfo info;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string file = ascii_lower(fs::path(path).filename().string());
    const bool blas_like = !blas_family(file).empty() || file.find("lapack") != std::string::npos;
    if (blas_like && file.find(".so") != std::string::npos &&
        std::find(info.loaded.begin(), info.loaded.end(), path) == info.loaded.end()) {
      info.loaded.push_back(path);
    }
  }
  // The object whose sgemm_ the dynamic linker binds LibTorch's calls to.
  if (void* symbol = ::dlsym(RTLD_DEFAULT, "sgemm_")) {
    Dl_info where{};
    if (::dladdr(symbol, &where) != 0 && where.dli_fname != nullptr) {
      std::error_code error;
      const auto resolved = fs::canonical(where.dli_fname, error);
      info.library = error ? std::string(where.dli_fname) : resolved.string();
    }
  }
  if (info.library.empty() || blas_family(info.library).empty()) {
    for (const char* family : {"Intel MKL", "OpenBLAS", "BLIS", "ATLAS", "FlexiBLAS", "reference BLAS (Netlib)"}) {
      const auto found = std::find_if(info.loaded.begin(), info.loaded.end(),
                                      [&](const std::string& path) { return blas_family(path) == family; });
      if (found != info.loaded.end()) {
        info.library = *found;
        break;
      }
    }
  }
  info.name = info.library.empty() ? "not found" : blas_family(info.library);
  if (info.name.empty()) info.name = "unknown";
  using ConfigFunction = const char* (*)();
  if (auto get_config = reinterpret_cast<ConfigFunction>(::dlsym(RTLD_DEFAULT, "openblas_get_config"))) {
    info.config = get_config();
  }
  return info;
}

std::string reference_blas_warning(const BlasInfo& info) {
  if (!is_reference_blas(info.name)) return "";
  return "[PartialState] float32 matrix products run on the unoptimised reference BLAS (" + info.library +
         "), often more than 10x slower than an optimised one. Install OpenBLAS (Debian: apt-get install "
         "libopenblas0-pthread) or select it with update-alternatives --config libblas.so.3-x86_64-linux-gnu; "
         "`accelerate env` shows the BLAS in use.";
}

// Note [Reference BLAS warning]
// Debian's LibTorch calls whatever libblas.so.3 the system selects, by default Netlib's reference
// BLAS, which makes float32 training an order of magnitude slower without any other sign. The
// first PartialState built in a process (every Accelerator builds one) detects the BLAS and warns
// once; `accelerate env` reports the same detection. The check costs one 64x64 product and a read
// of /proc/self/maps, once per process.
void warn_once_if_reference_blas() {
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string warning = reference_blas_warning(detect_blas());
    // Raised while the first PartialState is built: every process writes it, as a lone one.
    if (!warning.empty()) warn("accelerate.blas", warning, {.use_process_state = false});
  });
}

}  // namespace accelerate::detail
