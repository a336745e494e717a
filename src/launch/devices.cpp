// Counting CUDA devices without LibTorch; see devices.h.
#include "launch/devices.h"

#include "build_config.h"

#include <dlfcn.h>

namespace accelerate::detail::launch {

int cuda_driver_device_count() {
  // The driver library stays loaded once opened: unloading it is not supported by CUDA, and a
  // second call should not pay for starting it again.
  static const int count = [] {
    void* driver = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (driver == nullptr) return 0;
    using Init = int (*)(unsigned int);
    using DeviceCount = int (*)(int*);
    const auto init = reinterpret_cast<Init>(::dlsym(driver, "cuInit"));
    const auto device_count = reinterpret_cast<DeviceCount>(::dlsym(driver, "cuDeviceGetCount"));
    int devices = 0;
    // CUDA_SUCCESS is 0; an error (no device, a driver older than the kernel module) counts none.
    if (init == nullptr || device_count == nullptr || init(0) != 0 || device_count(&devices) != 0) return 0;
    return devices;
  }();
  return count;
}

int visible_cuda_devices() { return ACCELERATE_HAVE_CUDA ? cuda_driver_device_count() : 0; }

}  // namespace accelerate::detail::launch
