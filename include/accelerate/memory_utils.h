// Keeping training alive when memory runs out (upstream: accelerate/utils/memory.py):
// `find_executable_batch_size` retries a function with smaller batch sizes after out-of-memory
// errors, `should_reduce_batch_size` tells those errors apart, and `clear_device_cache` hands the
// CUDA caching allocator's unused blocks back to the driver. Upstream's `release_memory` is left
// out: it drops Python references and runs the garbage collector, which C++ handles do not need
// (let tensors go out of scope, then call `clear_device_cache`).
//
// Example:
//   auto train = accelerate::find_executable_batch_size(
//       [&](int64_t batch_size, Model& model) { return fit(model, batch_size); }, /*starting_batch_size=*/128);
//   auto loss = train(model);  // tries 128, then 115, 103, … until one fits
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <type_traits>

namespace accelerate {

/// Returns cached but unused device memory to the driver (CUDA's caching allocator
/// `emptyCache`); a no-op when LibTorch was built without CUDA. Upstream's `garbage_collection`
/// flag has no C++ counterpart: memory is freed when the last handle to it goes away.
void clear_device_cache();

/// Whether `error` means the device (or the CPU) ran out of memory, so that a smaller batch may
/// fit: `std::bad_alloc`, `c10::OutOfMemoryError`, or a `c10::Error` / `std::runtime_error` whose
/// message is an allocator's out-of-memory message (CUDA's "CUDA out of memory.", a CUDA runtime
/// "CUDA error: out of memory", cuDNN's CUDNN_STATUS_NOT_SUPPORTED and CUDNN_STATUS_ALLOC_FAILED,
/// LibTorch's CPU allocator's "DefaultCPUAllocator: can't allocate memory" and "not enough
/// memory"). Upstream: `should_reduce_batch_size`.
bool should_reduce_batch_size(const std::exception& error);

/// Computes the batch size to try after an out-of-memory error from the one that failed.
using BatchSizeReducer = std::function<int64_t(int64_t failed_batch_size)>;

namespace detail {
/// The state of one `find_executable_batch_size` wrapper, shared by its copies.
class BatchSizeSearch {
 public:
  BatchSizeSearch(int64_t starting_batch_size, BatchSizeReducer reduce);
  /// The batch size to try next; throws once it has reached zero.
  int64_t next() const;
  /// Frees cached memory and moves to a smaller batch size after an out-of-memory error.
  void reduce();

 private:
  int64_t batch_size_;
  BatchSizeReducer reduce_;
};
}  // namespace detail

/// Wraps `fn(batch_size, args...)` into a callable taking `args...` that runs `fn` with
/// `starting_batch_size` and, whenever it fails with an out-of-memory error (see
/// `should_reduce_batch_size`), frees cached memory (`clear_device_cache`) and runs it again with
/// a smaller batch size. By default the next size is `int(batch_size * 0.9)` (upstream's rule:
/// 128, 115, 103, 92, …); `reduce_batch_size_fn` replaces it and receives the size that failed
/// (upstream's takes no argument), and must return a smaller one. Other exceptions propagate
/// unchanged after the first call; when the size reaches zero the wrapper throws
/// "No executable batch size found, reached zero.".
///
/// The wrapper and its copies remember the last size tried, so a later call starts from the size
/// that fitted (as upstream's decorator does); they are not meant to be called concurrently.
/// `args...` are passed to `fn` as lvalues, since a retry passes the same objects again.
/// Upstream also rejects a function whose first parameter is not the batch size; here the
/// compiler does that check, as `fn` must be callable as `fn(int64_t, args...)`.
///
/// Example:
///   auto run = accelerate::find_executable_batch_size(
///       [](int64_t batch_size, const std::string& name) { return train(name, batch_size); });
///   auto result = run("mlp");
template <typename Fn>
auto find_executable_batch_size(Fn fn, int64_t starting_batch_size = 128, BatchSizeReducer reduce_batch_size_fn = {}) {
  auto search = std::make_shared<detail::BatchSizeSearch>(starting_batch_size, std::move(reduce_batch_size_fn));
  return [fn = std::move(fn), search = std::move(search)](auto&&... args) mutable -> decltype(auto) {
    clear_device_cache();
    while (true) {
      const int64_t batch_size = search->next();
      try {
        return fn(batch_size, args...);
      } catch (const std::exception& error) {
        if (!should_reduce_batch_size(error)) throw;
      }
      search->reduce();
    }
  };
}

}  // namespace accelerate
