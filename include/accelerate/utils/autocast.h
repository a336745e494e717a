// Mixed-precision regions (upstream: `Accelerator.autocast` and `get_mixed_precision_context_manager`
// in accelerate/utils/modeling.py). Inside an `AutocastGuard`, LibTorch runs eligible operations
// (matrix products, convolutions) in the lower precision and keeps precision-sensitive ones
// (reductions, losses) in fp32. On the CPU only bf16 exists: LibTorch 1.13 has no fp16 CPU
// autocast, so an fp16 guard on the CPU is refused rather than silently ignored.
//
// Example:
//   {
//     accelerate::AutocastGuard autocast(c10::kCPU, accelerate::PrecisionType::kBf16);
//     auto logits = model->forward(inputs);      // matmuls in bf16
//   }
#pragma once

#include "accelerate/utils/dataclasses.h"

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

namespace accelerate {

/// The reduced dtype of a precision on a device type: bf16 → kBFloat16, fp16 → kHalf, no → none.
std::optional<c10::ScalarType> autocast_dtype(PrecisionType precision);

/// Turns LibTorch's autocast on for `device_type` in `precision` for the guard's lifetime and
/// restores the previous autocast state (enabled flag, dtype, cache flag) on exit. With
/// `PrecisionType::kNo` or `kwargs.enabled == false` the region runs in full precision: autocast
/// is switched *off* for the device, as `torch.autocast(enabled=False)` does.
class [[nodiscard]] AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device_type, PrecisionType precision, const AutocastKwargs& kwargs = {});
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&&) = delete;
  AutocastGuard& operator=(AutocastGuard&&) = delete;

 private:
  c10::DeviceType device_type_;
  bool previous_enabled_;
  c10::ScalarType previous_dtype_;
  bool previous_cache_enabled_;
};

}  // namespace accelerate
