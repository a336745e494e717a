// A stand-in accelerator for the CPU test suite: a device registered through LibTorch's
// PrivateUse1 extension point, so that the library's device-generic paths (placement, device
// maps, dispatch, checkpoints, the scaler, generators) run on every CI run without a GPU.
// See Note [The stand-in device] in device.cpp.
//
//   accelerate::testing::stand_in::install();            // once, before the first backward pass
//   auto t = torch::ones({2}, stand_in::device(0));      // privateuseone:0
//
// What it shares with a GPU, so that the mistakes a GPU punishes are caught here too:
// - its memory cannot be read or written by host code: a tensor's data_ptr() is an address the
//   processor refuses (reading it is a segmentation fault, as with CUDA memory);
// - every kernel refuses tensors of another device, except scalars (0-dimensional CPU tensors),
//   with CUDA's message;
// - random draws on it come from its own generator per device, not the CPU's.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/Device.h>

#include <cstdint>

namespace accelerate::testing::stand_in {

/// How many stand-in devices there are (privateuseone:0 and privateuseone:1).
constexpr int kDevices = 2;

/// Registers the device, its kernels and its generators; later calls do nothing. Call it before
/// the first backward pass of the process (autograd starts its device threads once).
void install();

/// privateuseone:index.
c10::Device device(int index = 0);

/// Bytes of stand-in memory allocated and not yet freed, over every device.
int64_t bytes_in_use();

/// Copies between the host and the stand-in since the process started (each `_copy_from`).
int64_t copies();

/// The generator of device `index` (random draws of kernels on it that name no generator).
at::Generator default_generator(int index);

}  // namespace accelerate::testing::stand_in
