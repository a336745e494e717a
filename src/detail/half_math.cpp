// fp16 arithmetic of the compression hook; see half_math.h.
#include "detail/half_math.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <atomic>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define ACCELERATE_HALF_VECTORS 1
#else
#define ACCELERATE_HALF_VECTORS 0
#endif

namespace accelerate::detail {

// Note [fp16 arithmetic of the compression hook]
// DDP's fp16 compression hook casts each gradient bucket to fp16, divides it by the number of
// processes, sums it across them and casts the sum back. On the CPU two of those steps cost more
// than the bytes they save: LibTorch 1.13's ATen adds and divides fp16 tensors one element at a
// time through scalar conversions (adding two 3.2 M-element fp16 tensors takes 6.8 ms, against
// 0.73 ms in fp32 and 0.75 ms in bf16), and on W13's 4 processes a step spent about 170 ms per
// process in the ring sum's fp16 additions alone, each ring step waiting for the slowest
// process's. x86-64 processors since 2012 convert 8 values between fp32 and fp16 in one
// instruction (F16C), so the two operations run here as one pass each, element by element:
// - the ring's addition: float(a) + float(b), rounded once to fp16, nearest with ties to even;
// - the compression: x rounded to fp16, widened, divided by the process count, rounded again
//   (upstream casts first and divides the fp16 tensor: the double rounding is its result, and
//   dividing first would change about a quarter of the elements at 3 processes).
// These are ATen's own results bit for bit (its fp16 arithmetic widens to fp32, computes and
// rounds once), except that a NaN may keep another payload; the test compares the two on values
// across fp16's whole range, subnormals and overflow included. Large tensors are cut across
// ATen's intra-op threads as its own element-wise operations are. The hook compresses each
// bucket into the first half of the bucket's own bytes and widens the sum back there (one
// thread each, in the direction that reads every value before it is overwritten), so it
// allocates nothing per step: a fresh 14 MB fp16 copy of each W13 bucket, and the ring's
// receive buffers, came from the kernel as new pages every time (10 times the page faults of
// the hook-less step), the process's buffer pool being bounded below what a step's buckets
// hold. Where the processor lacks F16C, or on other architectures, ATen's operations run, and
// the in-place forms go through a copy.
namespace {

std::atomic<bool> aten_forced{false};
constexpr int64_t kGrain = 1 << 16;  // elements per intra-op task

#if ACCELERATE_HALF_VECTORS
__attribute__((target("avx,f16c"))) void add_halves(uint16_t* out, const uint16_t* a, const uint16_t* b,
                                                      int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_add_ps(x, y), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) {
    const float sum = static_cast<float>(c10::Half(a[i], c10::Half::from_bits())) +
                      static_cast<float>(c10::Half(b[i], c10::Half::from_bits()));
    out[i] = c10::Half(sum).x;
  }
}

__attribute__((target("avx,f16c"))) void halves_divided(uint16_t* out, const float* from, float divisor,
                                                          int64_t n) {
  const __m256 by = _mm256_set1_ps(divisor);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i cast = _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT);
    const __m256 quotient = _mm256_div_ps(_mm256_cvtph_ps(cast), by);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(quotient, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) out[i] = c10::Half(static_cast<float>(c10::Half(from[i])) / divisor).x;
}

// fp16 to fp32 from the last element down, for `out` and `from` at the same address: each block
// of 8 reads its halves before writing its floats, and the halves still to read lie below.
__attribute__((target("avx,f16c"))) void widen_down(float* out, const uint16_t* from, int64_t n) {
  int64_t i = n;
  for (; i % 8 != 0; --i) out[i - 1] = static_cast<float>(c10::Half(from[i - 1], c10::Half::from_bits()));
  for (i -= 8; i >= 0; i -= 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i))));
  }
}
#endif

bool vectors_in_use() { return has_half_conversions() && !aten_forced.load(std::memory_order_relaxed); }

bool plain_cpu(const at::Tensor& t) { return t.is_cpu() && t.is_contiguous() && t.layout() == at::kStrided; }

// The fp16 view over the first half of an fp32 tensor's bytes.
at::Tensor first_half_as_halves(const at::Tensor& bucket) {
  return bucket.view({-1}).view(at::kHalf).narrow(0, 0, bucket.numel());
}

}  // namespace

bool has_half_conversions() {
#if ACCELERATE_HALF_VECTORS
  static const bool has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return has;
#else
  return false;
#endif
}

void use_aten_for_half_math(bool aten) { aten_forced.store(aten, std::memory_order_relaxed); }

void add_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  TORCH_INTERNAL_ASSERT(a.numel() == b.numel() && out.numel() == a.numel() && a.scalar_type() == b.scalar_type() &&
                            out.scalar_type() == a.scalar_type(),
                        "add_out takes tensors of one dtype and one element count");
#if ACCELERATE_HALF_VECTORS
  if (a.scalar_type() == at::kHalf && vectors_in_use() && plain_cpu(out) && plain_cpu(a) && plain_cpu(b)) {
    auto* to = reinterpret_cast<uint16_t*>(out.data_ptr());
    const auto* x = reinterpret_cast<const uint16_t*>(a.data_ptr());
    const auto* y = reinterpret_cast<const uint16_t*>(b.data_ptr());
    at::parallel_for(0, a.numel(), kGrain,
                     [&](int64_t begin, int64_t end) { add_halves(to + begin, x + begin, y + begin, end - begin); });
    return;
  }
#endif
  at::Tensor into = out;
  at::add_out(into, a, b);
}

at::Tensor to_half_divided(const at::Tensor& from, int64_t divisor) {
  TORCH_INTERNAL_ASSERT(from.scalar_type() == at::kFloat && divisor > 0, "to_half_divided takes fp32 tensors");
#if ACCELERATE_HALF_VECTORS
  if (vectors_in_use() && plain_cpu(from)) {
    at::Tensor out = at::empty(from.sizes(), from.options().dtype(at::kHalf));
    auto* to = reinterpret_cast<uint16_t*>(out.data_ptr());
    const float* x = from.data_ptr<float>();
    const auto by = static_cast<float>(divisor);
    at::parallel_for(0, from.numel(), kGrain,
                     [&](int64_t begin, int64_t end) { halves_divided(to + begin, x + begin, by, end - begin); });
    return out;
  }
#endif
  return from.to(at::kHalf).div_(divisor);
}

at::Tensor to_half_divided_in_place(const at::Tensor& bucket, int64_t divisor) {
  TORCH_INTERNAL_ASSERT(bucket.scalar_type() == at::kFloat && plain_cpu(bucket) && divisor > 0,
                        "to_half_divided_in_place takes contiguous fp32 CPU tensors");
  at::Tensor halves = first_half_as_halves(bucket);
#if ACCELERATE_HALF_VECTORS
  if (vectors_in_use()) {
    // One thread, from the first element up: each block of 8 reads its floats before writing its
    // halves over the lower half of them, and the floats still to read lie above.
    halves_divided(reinterpret_cast<uint16_t*>(bucket.data_ptr()), bucket.data_ptr<float>(),
                   static_cast<float>(divisor), bucket.numel());
    return halves;
  }
#endif
  halves.copy_(to_half_divided(bucket, divisor));
  return halves;
}

void widen_in_place(const at::Tensor& bucket, const at::Tensor& halves) {
  TORCH_INTERNAL_ASSERT(bucket.scalar_type() == at::kFloat && plain_cpu(bucket) && halves.scalar_type() == at::kHalf &&
                            halves.numel() == bucket.numel() && halves.data_ptr() == bucket.data_ptr(),
                        "widen_in_place takes the fp16 view to_half_divided_in_place returned");
#if ACCELERATE_HALF_VECTORS
  if (vectors_in_use()) {
    widen_down(bucket.data_ptr<float>(), reinterpret_cast<const uint16_t*>(bucket.data_ptr()), bucket.numel());
    return;
  }
#endif
  bucket.view({-1}).copy_(halves.clone());
}

}  // namespace accelerate::detail
