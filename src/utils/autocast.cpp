// Autocast regions; see include/accelerate/utils/autocast.h.
#include "accelerate/utils/autocast.h"

#include "detail/torch_compat.h"

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>

namespace accelerate {
namespace {

bool autocast_enabled(c10::DeviceType device) { return detail::compat::is_autocast_enabled(device); }
c10::ScalarType autocast_dtype_of(c10::DeviceType device) { return detail::compat::get_autocast_dtype(device); }
void set_autocast(c10::DeviceType device, bool enabled, c10::ScalarType dtype) {
  detail::compat::set_autocast_enabled(device, enabled);
  detail::compat::set_autocast_dtype(device, dtype);
}

// Checked before the previous state is read: LibTorch 2.x refuses to read it for other devices.
c10::DeviceType checked_device(c10::DeviceType device_type) {
  TORCH_CHECK_VALUE(device_type == c10::kCPU || device_type == c10::kCUDA,
                    "[autocast] autocast needs a CPU or CUDA device, got ", c10::DeviceTypeName(device_type));
  return device_type;
}

}  // namespace

std::optional<c10::ScalarType> autocast_dtype(PrecisionType precision) {
  switch (precision) {
    case PrecisionType::kNo: return std::nullopt;
    case PrecisionType::kFp16: return c10::kHalf;
    case PrecisionType::kBf16: return c10::kBFloat16;
  }
  return std::nullopt;
}

AutocastGuard::AutocastGuard(c10::DeviceType device_type, PrecisionType precision, const AutocastKwargs& kwargs)
    : device_type_(checked_device(device_type)),
      previous_enabled_(autocast_enabled(device_type)),
      previous_dtype_(autocast_dtype_of(device_type)),
      previous_cache_enabled_(at::autocast::is_autocast_cache_enabled()) {
  const auto dtype = autocast_dtype(precision);
  const bool enabled = kwargs.enabled && dtype.has_value();
  TORCH_CHECK_VALUE(!(enabled && device_type == c10::kCPU && *dtype == c10::kHalf),
                    "[autocast] fp16 autocast needs a CUDA device; on the CPU use bf16");
  set_autocast(device_type, enabled, enabled ? *dtype : previous_dtype_);
  if (kwargs.cache_enabled) at::autocast::set_autocast_cache_enabled(*kwargs.cache_enabled);
  at::autocast::increment_nesting();
}

AutocastGuard::~AutocastGuard() {
  // Leaving the outermost region drops the casts cached inside it.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  set_autocast(device_type_, previous_enabled_, previous_dtype_);
  at::autocast::set_autocast_cache_enabled(previous_cache_enabled_);
}

}  // namespace accelerate
