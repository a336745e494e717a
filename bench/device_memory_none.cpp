// A build without CUDA: no device peaks to report (see device_memory.h).
#include "device_memory.h"

namespace bench {

void reset_device_peaks(int) {}
double peak_device_allocated_mib(int) { return -1; }
double peak_device_reserved_mib(int) { return -1; }

}  // namespace bench
