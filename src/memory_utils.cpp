// Out-of-memory recovery; see include/accelerate/memory_utils.h.
#include "accelerate/memory_utils.h"

#include "build_config.h"

#include <c10/util/Exception.h>

#if ACCELERATE_HAVE_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <array>
#include <new>
#include <stdexcept>
#include <string_view>

namespace accelerate {
namespace {

// The messages of allocators and libraries that ran out of memory.
constexpr std::array<std::string_view, 6> kOutOfMemoryMessages = {
    " out of memory.",                           // CUDA caching allocator: "CUDA out of memory. Tried to …"
    "CUDA error: out of memory",                 // a CUDA runtime call failing to allocate
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",  // cuDNN refusing a problem too large for its workspace
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",  // posix_memalign failed
    "DefaultCPUAllocator: not enough memory",
};

bool is_out_of_memory_message(std::string_view message) {
  for (const auto statement : kOutOfMemoryMessages) {
    if (message.find(statement) != std::string_view::npos) return true;
  }
  return false;
}

}  // namespace

void clear_device_cache() {
#if ACCELERATE_HAVE_CUDA
  c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

bool should_reduce_batch_size(const std::exception& error) {
  if (dynamic_cast<const std::bad_alloc*>(&error) != nullptr) return true;
  if (dynamic_cast<const c10::OutOfMemoryError*>(&error) != nullptr) return true;
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&error)) {
    return is_out_of_memory_message(c10_error->what_without_backtrace());
  }
  if (dynamic_cast<const std::runtime_error*>(&error) != nullptr) return is_out_of_memory_message(error.what());
  return false;
}

namespace detail {

BatchSizeSearch::BatchSizeSearch(int64_t starting_batch_size, BatchSizeReducer reduce)
    : batch_size_(starting_batch_size), reduce_(std::move(reduce)) {
  TORCH_CHECK_VALUE(starting_batch_size >= 0,
                    "[find_executable_batch_size] starting_batch_size must not be negative, got ", starting_batch_size);
}

int64_t BatchSizeSearch::next() const {
  TORCH_CHECK(batch_size_ > 0, "[find_executable_batch_size] No executable batch size found, reached zero.");
  return batch_size_;
}

void BatchSizeSearch::reduce() {
  clear_device_cache();
  const int64_t failed = batch_size_;
  // Upstream's int(batch_size * 0.9) in integers (equal, as the double 0.9 lies just above 0.9),
  // split so that 9 * batch_size cannot overflow.
  const int64_t smaller = reduce_ ? reduce_(failed) : failed / 10 * 9 + failed % 10 * 9 / 10;
  TORCH_CHECK_VALUE(smaller < failed && smaller >= 0, "[find_executable_batch_size] reduce_batch_size_fn must return "
                    "a smaller, non-negative batch size; after ", failed, " it returned ", smaller);
  batch_size_ = smaller;
}

}  // namespace detail
}  // namespace accelerate
