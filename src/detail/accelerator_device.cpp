// See Note [Accelerators other than CUDA] in accelerator_device.h.
#include "detail/accelerator_device.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

namespace accelerate::detail {
namespace {

int backend_devices() {
  if (!c10::impl::hasDeviceGuardImpl(c10::DeviceType::PrivateUse1)) return 0;
  return static_cast<int>(c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1)->deviceCount());
}

}  // namespace

c10::DeviceType accelerator_type() {
  if (torch::cuda::is_available()) return c10::kCUDA;
  if (backend_devices() > 0) return c10::DeviceType::PrivateUse1;
  return c10::kCPU;
}

int accelerator_count() {
  switch (accelerator_type()) {
    case c10::kCUDA: return static_cast<int>(torch::cuda::device_count());
    case c10::DeviceType::PrivateUse1: return backend_devices();
    default: return 0;
  }
}

void set_current_device(c10::Device device) {
  if (device.is_cpu() || !device.has_index()) return;
  c10::impl::getDeviceGuardImpl(device.type())->setDevice(device);
}

}  // namespace accelerate::detail
