// The buffer pool; see buffer_pool.h.
#include "detail/buffer_pool.h"

#include "accelerate/utils/environment.h"
#include "detail/torch_compat.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

#include <sys/mman.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <list>
#include <unordered_map>
#include <utility>
#include <vector>

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

// Note [One pool for the process's large CPU buffers]
// On a virtual machine whose kernel hands free pages back to the host, memory that a process
// frees and takes again is paid for twice: glibc returns a buffer above its mmap threshold (at
// most 32 MiB) to the kernel at once, and the next one of that size faults in fresh pages, at
// a tenth of the speed of writing pages the process already has. Every step of a loop frees and
// takes the same large buffers: the copy a reduction returns, a gather's output, the gradients
// that zero_grad drops and the backward pass makes again, the optimizer's temporaries, a
// loader's batches, a loaded tensor.
//
// So LibTorch's CPU allocator becomes one pool for the process (installed when the first
// PartialState is made): buffers of kPooledBytes or more are rounded up to a size class (a
// sixteenth of their power of two) and, when freed, kept by size, the least recently freed let go
// first beyond kPoolKeepsBytes; smaller ones go to the system allocator untouched. The FSDP
// engine's BufferPool and the offload prefetcher's sit in front of it: what they let go of
// returns here. A buffer taken when nothing kept matches is fresh memory on top of what the pool
// keeps, so before taking it the pool lets go of all but kPoolKeepsOnMissBytes: the process's
// peak memory grows by at most that over what malloc alone would give it.
//
// For that bound to hold, letting go of a buffer must give its memory back, so the pool maps its
// buffers itself (mapped_host_buffer) and unmaps those it lets go of. Taken from malloc, as they
// were, they were heap memory that glibc kept: a freed chunk it had mapped raises its mmap
// threshold to the chunk's size (up to 32 MiB), later ones of that size come from the heap, and a
// freed heap chunk stays resident until the top of the heap can be trimmed. Measured on the two
// patterns of HostPool.PeakMemoryStaysWithinTheBoundOverThePoolSwitchedOff, the peak rose over
// the pool switched off by 144 MiB (48 size classes taken in turn) and 102 MiB (two threads taking
// buffers of 1-256 MiB); mapped, by at most the bound (figures in docs/design.md). A fresh buffer
// costs its page faults, as one above malloc's threshold did; reused ones cost none. When the
// system will map no more, the buffer comes from the system allocator, which says so in its error.
//
// Gloo and Open MPI allocate their own temporaries with malloc, out of the pool's reach; so does
// everything below kPooledBytes (Note [Small buffers from the heap]). The one library temporary
// that glibc could not keep, Open MPI's allreduce of more than 32 MiB, is gone with the MPI
// group's ring allreduce (Note [A ring allreduce] in mpi_ring.cpp). ACCELERATE_CPU_BUFFER_POOL=0
// leaves LibTorch's allocator, and glibc's thresholds, as they were.

// Note [Small buffers from the heap]
// glibc's thresholds are dynamic: its mmap threshold starts at 128 KiB, and a freed chunk that
// glibc had mapped raises it to that chunk's size (up to 32 MiB) and the trim threshold, the free
// memory at the top of the heap past which the heap shrinks, to twice that. With the pool
// installed, no chunk of 1 MiB or more ever passes through malloc, so the thresholds stay at
// their start: every buffer of 128 KiB to 1 MiB (a small model's activations: W10's are 512 KiB
// and 1 MiB) was mapped and unmapped by glibc at each use, and the heap gave back every step's
// smaller ones too. W10's DDP at 4 processes took 930,000 page faults in 62 steps (3,700 per
// process and step, 15 MiB of fresh pages each); Python's twin, whose imports had raised glibc's
// thresholds long before, a sixth of that per step.
//
// So installing the pool also fixes glibc's mmap threshold at kPooledBytes, where the pool takes
// over (everything smaller comes from the heap), and its trim threshold at kHeapKeepsBytes: the
// heap keeps up to 64 MiB freed at its top for the next step. The faults fell to 155,000 (mostly
// start-up), W10's DDP at 4 processes ran 8 % faster (4 rounds, each faster than its neighbour
// without), and the peak resident memory rose by 2 MiB (249.7 to 251.7 MiB). The bound holds
// whatever the model: chunks below 1 MiB only, at most 64 MiB of them kept beyond what is in use.
// Earlier, fixing the mmap threshold at its 32 MiB maximum and the trim threshold at 256 MiB had
// cost W9's SHARD_GRAD_OP 20-70 MiB of peak for no gain in W4 or W9: the heap then also kept
// Gloo's and Open MPI's temporaries of 1-32 MiB, which are still mapped now, and up to 256 MiB at
// its top. A process whose environment sets glibc's thresholds itself
// (GLIBC_TUNABLES' glibc.malloc.mmap_threshold, trim_threshold, top_pad or mmap_max, or
// MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_, MALLOC_MMAP_MAX_) keeps them.
namespace {

void serve_small_buffers_from_heap() {
#if defined(__GLIBC__)
  for (const char* key : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_"}) {
    if (std::getenv(key) != nullptr) return;
  }
  if (const char* tunables = std::getenv("GLIBC_TUNABLES")) {
    for (const char* key : {"glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold", "glibc.malloc.top_pad",
                            "glibc.malloc.mmap_max"}) {
      if (std::strstr(tunables, key) != nullptr) return;
    }
  }
  ::mallopt(M_MMAP_THRESHOLD, static_cast<int>(kPooledBytes));
  ::mallopt(M_TRIM_THRESHOLD, static_cast<int>(kHeapKeepsBytes));
#endif
}

size_t size_class(size_t bytes) {
  size_t power = kPooledBytes;
  while (power < bytes) power <<= 1;
  const size_t step = power / 16;
  return (bytes + step - 1) / step * step;
}

class HostPool final : public compat::AllocatorBase {
 public:
  explicit HostPool(c10::Allocator* system) : system_(system) {}

  at::DataPtr allocate_bytes(size_t n) override {
    if (n < kPooledBytes) return system_->allocate(n);
    const size_t bytes = size_class(n);
    std::vector<at::DataPtr> dropped;  // freed after the lock
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = by_size_.find(bytes);
      if (it != by_size_.end()) {
        Block block = std::move(*it->second);
        kept_.erase(it->second);
        by_size_.erase(it);
        kept_bytes_ -= bytes;
        ++reused_;
        return lend(std::move(block));
      }
      ++fresh_;
      while (kept_bytes_ > kPoolKeepsOnMissBytes) dropped.push_back(drop_oldest());
    }
    dropped.clear();
    at::DataPtr data = mapped_host_buffer(bytes);
    if (!data) data = system_->allocate(bytes);
    std::lock_guard<std::mutex> lock(mutex_);
    return lend(Block{std::move(data), bytes});
  }

  c10::DeleterFnPtr raw_deleter() const override { return &HostPool::give_back; }

  HostPoolStats stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {true, fresh_, reused_, kept_bytes_, lent_bytes_};
  }

  void empty() {
    std::vector<at::DataPtr> dropped;
    std::lock_guard<std::mutex> lock(mutex_);
    while (!kept_.empty()) dropped.push_back(drop_oldest());
  }

  static HostPool* instance;

 private:
  struct Block {
    at::DataPtr data;
    size_t bytes;
  };

  // With mutex_ held.
  at::DataPtr lend(Block block) {
    void* ptr = block.data.get();
    lent_bytes_ += block.bytes;
    lent_.emplace(ptr, std::move(block));
    return at::DataPtr(ptr, ptr, &HostPool::give_back, at::Device(at::kCPU));
  }

  // With mutex_ held: the least recently freed buffer, no longer kept.
  at::DataPtr drop_oldest() {
    Block& oldest = kept_.back();
    auto range = by_size_.equal_range(oldest.bytes);
    for (auto it = range.first; it != range.second; ++it) {
      if (&*it->second == &oldest) {
        by_size_.erase(it);
        break;
      }
    }
    kept_bytes_ -= oldest.bytes;
    at::DataPtr data = std::move(oldest.data);
    kept_.pop_back();
    return data;
  }

  // The deleter of every buffer the pool lends; also c10's raw deleter, which may be handed a
  // small buffer of the system allocator's.
  static void give_back(void* ptr) { instance->take_back(ptr); }

  void take_back(void* ptr) {
    std::vector<at::DataPtr> dropped;
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = lent_.find(ptr);
    if (it == lent_.end()) {
      lock.unlock();
      if (auto deleter = system_->raw_deleter()) deleter(ptr);
      return;
    }
    Block block = std::move(it->second);
    lent_.erase(it);
    lent_bytes_ -= block.bytes;
    if (block.bytes > kPoolKeepsBytes) {
      lock.unlock();
      return;  // freed here
    }
    while (kept_bytes_ + block.bytes > kPoolKeepsBytes) dropped.push_back(drop_oldest());
    kept_bytes_ += block.bytes;
    kept_.push_front(std::move(block));
    by_size_.emplace(kept_.front().bytes, kept_.begin());
  }

  c10::Allocator* system_;
  std::mutex mutex_;
  std::list<Block> kept_;  // most recently freed first
  std::multimap<size_t, std::list<Block>::iterator> by_size_;
  std::unordered_map<void*, Block> lent_;
  size_t kept_bytes_ = 0;
  size_t lent_bytes_ = 0;
  uint64_t fresh_ = 0;
  uint64_t reused_ = 0;
};

HostPool* HostPool::instance = nullptr;

}  // namespace

void install_host_pool() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (!parse_flag_from_env("ACCELERATE_CPU_BUFFER_POOL", true)) return;  // a non-boolean value throws, naming it
    HostPool::instance = new HostPool(c10::GetAllocator(at::kCPU));  // lives as long as the process
    c10::SetAllocator(at::kCPU, HostPool::instance, /*priority=*/1);
    serve_small_buffers_from_heap();
  });
}

HostPoolStats host_pool_stats() { return HostPool::instance ? HostPool::instance->stats() : HostPoolStats{}; }

void empty_host_pool() {
  if (HostPool::instance) HostPool::instance->empty();
}

}  // namespace accelerate::detail
