// The CUDA caching allocator's peaks (see device_memory.h).
#include "device_memory.h"

#include <c10/cuda/CUDACachingAllocator.h>

namespace bench {
namespace {

// Index 0 of each statistic array is the aggregate over pool types (StatType::AGGREGATE).
constexpr size_t kAggregate = 0;

}  // namespace

void reset_device_peaks(int index) {
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
}

double peak_device_allocated_mib(int index) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  return static_cast<double>(stats.allocated_bytes[kAggregate].peak) / 1048576.0;
}

double peak_device_reserved_mib(int index) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  return static_cast<double>(stats.reserved_bytes[kAggregate].peak) / 1048576.0;
}

}  // namespace bench
