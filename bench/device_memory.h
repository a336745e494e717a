// Peak memory of a GPU as its caching allocator counts it (PyTorch's
// torch.cuda.max_memory_allocated / max_memory_reserved), for the benchmarks. Defined by
// device_memory_cuda.cpp in builds whose LibTorch has CUDA, else by device_memory_none.cpp.
#pragma once

#include <cstdio>
#include <string>

namespace bench {

/// Starts counting the peaks of CUDA device `index` afresh.
void reset_device_peaks(int index);

/// The peak MiB allocated to tensors, and reserved by the allocator, on CUDA device `index`
/// since the last reset; -1 in a build without CUDA.
double peak_device_allocated_mib(int index);
double peak_device_reserved_mib(int index);

/// The two peaks of CUDA device `index` as JSON fields to append to a result line
/// (`, "peak_device_allocated_mib": …, "peak_device_reserved_mib": …`); empty for `index` < 0.
inline std::string device_peaks_json(int index) {
  if (index < 0) return {};
  char buf[128];
  std::snprintf(buf, sizeof(buf), ", \"peak_device_allocated_mib\": %.1f, \"peak_device_reserved_mib\": %.1f",
                peak_device_allocated_mib(index), peak_device_reserved_mib(index));
  return buf;
}

}  // namespace bench
