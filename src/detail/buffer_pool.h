// A pool of freed buffers by byte size, for code that frees and allocates buffers of the same
// sizes again and again: the FSDP engine's whole parameters, gathers and reductions (Note
// [Reusing the engine's buffers] in buffer_pool.cpp) and the offload prefetcher's weight copies
// (Note [Recycled weight buffers] in hooks.cpp). Bounded in bytes and in buffers; thread-safe.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <mutex>

namespace accelerate::detail {

class BufferPool {
 public:
  /// Keeps at most `max_bytes` of freed buffers, and at most `max_buffers` of them.
  explicit BufferPool(size_t max_bytes = 0, size_t max_buffers = std::numeric_limits<size_t>::max())
      : max_bytes_(max_bytes), max_buffers_(max_buffers) {}
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  /// Raises the bound on the bytes kept to at least `bytes`.
  void reserve(size_t bytes);

  /// A buffer of `bytes`: a kept one of that size, else a fresh one from `allocate` (which may
  /// give an empty pointer when it cannot).
  at::DataPtr take(size_t bytes, const std::function<at::DataPtr(size_t)>& allocate);
  at::DataPtr take(size_t bytes, at::Allocator* allocator);
  /// Keeps `data` (of `bytes`) for a later `take`, or frees it when the pool is full.
  void give(size_t bytes, at::DataPtr data);

  /// Frees the bytes of `t`'s storage into the pool (the tensor keeps its shape, with no data).
  void free_storage(const at::Tensor& t);
  /// Gives `t`'s storage its bytes again (`bytes`, when more than `t` needs).
  void allocate_storage(const at::Tensor& t, size_t bytes = 0);
  /// A flat tensor of `numel` uninitialised elements.
  at::Tensor empty(int64_t numel, const at::TensorOptions& options);
  /// Gives a tensor from `empty` back, when nothing else holds it.
  void release(at::Tensor& t);
  /// Takes the bytes of a CPU buffer that a finished collective used back into the pool, whoever
  /// still refers to it (the process group's own records of the collective may outlive the wait);
  /// `release` for other devices.
  void reclaim(at::Tensor& t);

 private:
  std::mutex mutex_;
  std::multimap<size_t, at::DataPtr> free_;
  size_t held_ = 0;
  size_t max_bytes_;
  size_t max_buffers_;
};

/// From this size on, CPU buffers come from the process's pool (Note [One pool for the
/// process's large CPU buffers] in buffer_pool.cpp).
inline constexpr size_t kPooledBytes = size_t{1} << 20;
/// The most bytes of freed buffers the process's pool keeps, and what it keeps at most when a
/// buffer it has no match for is allocated.
inline constexpr size_t kPoolKeepsBytes = size_t{1} << 30;
inline constexpr size_t kPoolKeepsOnMissBytes = size_t{32} << 20;
/// With the pool installed, glibc's heap serves every buffer below kPooledBytes and keeps up to
/// this much of what is freed at its top for the next step (Note [Small buffers from the heap]).
inline constexpr size_t kHeapKeepsBytes = size_t{64} << 20;

/// What the process's pool has done so far.
struct HostPoolStats {
  bool installed = false;    ///< whether LibTorch's CPU allocator is the pool
  uint64_t fresh = 0;        ///< buffers of kPooledBytes or more taken from the system allocator
  uint64_t reused = 0;       ///< buffers served again from the pool
  size_t kept_bytes = 0;     ///< freed buffers the pool keeps for reuse
  size_t lent_bytes = 0;     ///< pooled buffers in use
};

/// Makes LibTorch's CPU allocator the process's pool of large buffers, once per process, and
/// has glibc serve the smaller ones from its heap (unless the environment sets glibc's
/// thresholds); nothing when ACCELERATE_CPU_BUFFER_POOL is false (a value that is not a boolean
/// throws, naming it). PartialState calls it.
void install_host_pool();
/// The pool's counts so far (all zero, `installed` false, when it is not installed).
HostPoolStats host_pool_stats();
/// Frees every buffer the pool keeps.
void empty_host_pool();

/// `bytes` of private anonymous memory mapped for the caller alone (unmapped when the pointer is
/// dropped), or an empty pointer when the system has none.
at::DataPtr mapped_host_buffer(size_t bytes);

}  // namespace accelerate::detail
