// The fp16 operations of DDP's fp16 compression on the CPU, with ATen's bits but not its speed
// on every LibTorch (Note [fp16 arithmetic of the compression hook] in half_math.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace accelerate::detail {

/// `out` = `a` + `b` element by element, for contiguous CPU tensors of one floating dtype and one
/// element count; `out` may be `a`. For fp16 each element is float(a) + float(b) rounded once to
/// the nearest fp16 (ties to even), as ATen's add gives.
void add_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b);

/// A new fp16 tensor holding `from` cast to fp16 and then divided by `divisor` (each element
/// float(half(x)) / divisor rounded once to fp16), the bits of `from.to(at::kHalf).div_(divisor)`;
/// `from` is a contiguous fp32 CPU tensor.
at::Tensor to_half_divided(const at::Tensor& from, int64_t divisor);

/// The same values as `to_half_divided(bucket, divisor)`, written over the first half of the fp32
/// CPU tensor `bucket`'s own bytes (which then no longer hold its values): returns the fp16 view
/// of `bucket.numel()` elements there, so that nothing is allocated.
at::Tensor to_half_divided_in_place(const at::Tensor& bucket, int64_t divisor);

/// Widens `halves`, the fp16 view that `to_half_divided_in_place` returned over `bucket`, back
/// into `bucket` as fp32 (each value exactly), in place.
void widen_in_place(const at::Tensor& bucket, const at::Tensor& halves);

/// Whether this processor converts between fp32 and fp16 in vector instructions of its own (F16C),
/// which the functions above then use; `false` where they fall back to ATen's operations.
bool has_half_conversions();

/// For tests: makes these functions use ATen's operations (`true`) or this processor's own when it
/// has them (`false`, the default).
void use_aten_for_half_math(bool aten);

}  // namespace accelerate::detail
