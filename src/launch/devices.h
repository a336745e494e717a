// The CUDA devices this process can see, asked of the CUDA driver directly. Torch-free: the
// launcher decides with it whether a job runs on GPUs (Note [The launcher without LibTorch]).
#pragma once

namespace accelerate::detail::launch {

/// How many CUDA devices the driver (libcuda.so.1, loaded on first use) lets this process see,
/// after CUDA_VISIBLE_DEVICES; 0 when the driver is missing or fails to start.
int cuda_driver_device_count();

/// The CUDA devices the job can use: the driver's count when this build's LibTorch has CUDA,
/// else 0.
int visible_cuda_devices();

}  // namespace accelerate::detail::launch
