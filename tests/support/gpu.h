// The GPU tier (tests/gpu/): how many CUDA devices this process can use, and skipping a test with
// the reason when there are fewer than it needs. Every GPU test starts with `SKIP_WITHOUT_GPUS(n)`,
// so the tier builds and runs everywhere and skips, saying why, on machines without enough GPUs.
#pragma once

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstdlib>
#include <string>

namespace accelerate::testing {

/// CUDA devices usable here: 0 when LibTorch has no CUDA, or finds no driver or no device.
inline int cuda_device_count() {
  return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
}

/// The CUDA_VISIBLE_DEVICES value that shows a job only the `index`-th GPU this process sees (the
/// `index`-th entry of this process's own CUDA_VISIBLE_DEVICES, else `index` itself).
inline std::string visible_gpu(int index) {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr || *visible == '\0') return std::to_string(index);
  std::string all = visible;
  for (int i = 0; i < index; ++i) {
    const auto comma = all.find(',');
    if (comma == std::string::npos) return std::to_string(index);
    all = all.substr(comma + 1);
  }
  return all.substr(0, all.find(','));
}

}  // namespace accelerate::testing

/// Skips the current test, saying why, unless at least `n` CUDA devices are usable.
#define SKIP_WITHOUT_GPUS(n)                                                                                           \
  do {                                                                                                                 \
    const int gpus_here = ::accelerate::testing::cuda_device_count();                                                  \
    if (gpus_here < (n)) {                                                                                             \
      GTEST_SKIP() << "needs " << (n) << " CUDA device(s), this process sees " << gpus_here                            \
                   << (gpus_here == 0 ? " (torch::cuda::is_available() is false: no CUDA build, driver or GPU)" : ""); \
    }                                                                                                                  \
  } while (false)
