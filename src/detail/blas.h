// Which BLAS library LibTorch's float32 matrix products run on, shared by `accelerate env` and
// the start-up warning about the slow reference BLAS. See Note [Reference BLAS warning].
#pragma once

#include <string>
#include <vector>

namespace accelerate::detail {

/// The BLAS library in use, as `detect_blas` finds it (`accelerate env` reports it as the public
/// `commands::BlasInfo`; this layer stays below the commands).
struct BlasInfo {
  std::string name;                 // a `blas_family` result, or "not found"
  std::string library;              // the shared object that provides `sgemm_`
  std::vector<std::string> loaded;  // every BLAS/LAPACK-like shared object mapped
  std::string config;               // `openblas_get_config`, when OpenBLAS is loaded
};

/// The BLAS family a shared object's path or file name names ("OpenBLAS", "Intel MKL", "BLIS",
/// "ATLAS", "FlexiBLAS", "reference BLAS (Netlib)"), or "" when it names no BLAS library.
std::string blas_family(const std::string& path);

/// Whether `family` (a `blas_family` result) is Netlib's unoptimised reference BLAS.
bool is_reference_blas(const std::string& family);

/// Runs a small float32 matrix product, then names the shared object that provides `sgemm_` and
/// every BLAS/LAPACK-like object mapped into this process (/proc/self/maps).
BlasInfo detect_blas();

/// The warning for `info`, or "" when its BLAS is not the reference one.
std::string reference_blas_warning(const BlasInfo& info);

/// Detects the BLAS once per process and, if it is the reference BLAS, warns once (TORCH_WARN).
/// Called whenever a PartialState is built; later calls do nothing.
void warn_once_if_reference_blas();

}  // namespace accelerate::detail
