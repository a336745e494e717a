// The buffer pool; see buffer_pool.h.
#include "detail/buffer_pool.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

#include <sys/mman.h>

#include <algorithm>
#include <utility>

namespace accelerate::detail {

// Note [Reusing the engine's buffers]
// Every unit's whole parameters, and the flat buffers of its gathers and reductions, are needed
// for a moment and then freed, unit after unit, several times a step. Given back to malloc,
// buffers of this size end up kept in its heap (glibc raises its mmap threshold to the size of
// the first ones freed) and the process's resident memory grows well past what is in use. The
// engine keeps them instead: a freed buffer goes to a pool by byte size, bounded by a few units'
// worth, and the next buffer of that size comes from there. So do the whole gradients (Note
// [Lending gradient buffers]). A collective's CPU buffers are taken back once it has been waited
// for, whoever still refers to them: the process group's own records of a collective (MPI's
// queue, a work object) can outlive the wait, and a buffer given back only when nothing held it
// went back to malloc instead, most of the time. A gradient buffer goes back only while nothing
// else holds it, since the user may keep a gradient.
void BufferPool::reserve(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  max_bytes_ = std::max(max_bytes_, bytes);
}

at::DataPtr BufferPool::take(size_t bytes, const std::function<at::DataPtr(size_t)>& allocate) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(bytes);
    if (it != free_.end()) {
      at::DataPtr out = std::move(it->second);
      free_.erase(it);
      held_ -= bytes;
      return out;
    }
  }
  return allocate(bytes);
}

at::DataPtr BufferPool::take(size_t bytes, at::Allocator* allocator) {
  return take(bytes, [allocator](size_t n) { return allocator->allocate(n); });
}

void BufferPool::give(size_t bytes, at::DataPtr data) {
  if (!data || bytes == 0) return;
  std::unique_lock<std::mutex> lock(mutex_);
  if (held_ + bytes > max_bytes_ || free_.size() >= max_buffers_) {
    lock.unlock();
    return;  // `data` is freed here, outside the lock
  }
  held_ += bytes;
  free_.emplace(bytes, std::move(data));
}

void BufferPool::free_storage(const at::Tensor& t) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  const size_t bytes = storage->nbytes();
  if (bytes == 0) return;
  give(bytes, storage->set_data_ptr(at::DataPtr(nullptr, t.device())));
  storage->set_nbytes(0);
}

void BufferPool::allocate_storage(const at::Tensor& t, size_t bytes) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  bytes = std::max(bytes, static_cast<size_t>(t.numel()) * t.element_size());
  if (storage->nbytes() == bytes) return;
  storage->set_data_ptr_noswap(take(bytes, storage->allocator()));
  storage->set_nbytes(bytes);
}

at::Tensor BufferPool::empty(int64_t numel, const at::TensorOptions& options) {
  at::Tensor out = at::empty({0}, options);
  auto* storage = out.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(numel) * out.element_size();
  storage->set_data_ptr_noswap(take(bytes, storage->allocator()));
  storage->set_nbytes(bytes);
  out.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  return out;
}

void BufferPool::reclaim(at::Tensor& t) {
  // On a GPU the wait only orders the caller's stream after the collective, which may still be
  // running: the process group's references keep its memory from the allocator until it is
  // done, so there the buffer goes back only when nothing else holds it.
  if (!t.defined() || !t.is_cpu()) return release(t);
  free_storage(t);
  t = at::Tensor();
}

void BufferPool::release(at::Tensor& t) {
  if (t.defined() && t.use_count() == 1 && t.storage().use_count() == 1) free_storage(t);
  t = at::Tensor();
}

namespace {

struct Mapping {
  void* memory;
  size_t bytes;
};

void unmap(void* context) {
  auto* mapping = static_cast<Mapping*>(context);
  ::munmap(mapping->memory, mapping->bytes);
  delete mapping;
}

}  // namespace

at::DataPtr mapped_host_buffer(size_t bytes) {
  void* memory = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) return at::DataPtr(nullptr, at::Device(at::kCPU));
  return at::DataPtr(memory, new Mapping{memory, bytes}, &unmap, at::Device(at::kCPU));
}

}  // namespace accelerate::detail
