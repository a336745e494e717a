// Which accelerator this process computes on when it is not told to use the CPU.
//
// Note [Accelerators other than CUDA]
// Like `torch.accelerator` in PyTorch, the library takes CUDA when LibTorch has it and sees a
// GPU, else a device that an out-of-tree backend registered through LibTorch's PrivateUse1
// extension point (a device guard that reports at least one device), else none. Such a backend
// gets what is device-generic: the process's device, `prepare`'s placement, device maps
// (integers name its devices), dispatch, checkpoints and, where LibTorch lets the backend provide
// one (2.x), its generators' states. What needs more than LibTorch offers such a backend is
// refused with a reason: fp16 mixed precision (autocast and the scaler's kernels are CUDA's) and
// jobs of several processes (c10d's Gloo and NCCL take CPU and CUDA tensors only). The test suite
// runs the device-generic paths on such a device (tests/stand_in/).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/DeviceType.h>

namespace accelerate::detail {

/// kCUDA, kPrivateUse1 (a registered backend with devices) or, when there is none, kCPU.
c10::DeviceType accelerator_type();

/// How many devices of accelerator_type() this process sees (0 for kCPU).
int accelerator_count();

/// Makes `device` the calling thread's current device of its kind (a no-op for the CPU).
void set_current_device(c10::Device device);

}  // namespace accelerate::detail
