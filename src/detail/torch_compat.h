// Note [LibTorch releases]
// The one place where the LibTorch releases accelerate-cpp builds against differ: 1.13 (Debian
// 12), 2.6 (Debian 13) and the newest (Debian sid, official downloads). Everything here is keyed
// on LibTorch's own version macros; no other file of the library tests a LibTorch version. Each
// function has the same meaning on every release, so no behaviour a user can see depends on it.
//
// What differs:
// - custom process groups: a `c10d::ProcessGroup` subclass in 1.x; from 2.0 a `c10d::Backend`
//   that a `c10d::ProcessGroup` dispatches to by device type;
// - `c10d::Reducer`'s constructor (2.14 drops the per-bucket limits, adds three arguments);
// - the flat all-gather, reduce-scatter and all-to-all (`_allgather_base` is `all_gather_single`
//   in 2.14; `alltoall_base` is deprecated there for `all_to_all_single`; 1.x's Gloo group has
//   neither the flat all-gather nor a reduce-scatter);
// - optimizer state keys (a string of the parameter's address in 1.x, the address in 2.x);
// - `c10::Error`'s constructor (the backtrace became a lazily computed value);
// - autocast (per-device functions in 2.x; the 1.x ones are deprecated there);
// - profiler event times (microseconds in 1.x, nanoseconds in 2.x);
// - generators of out-of-tree (PrivateUse1) backends (2.x only);
// - `c10::Allocator` (`allocate` const before 2.3; from 2.3 an allocator also copies data);
// - fused attention (`at::scaled_dot_product_attention` with a scale from 2.1; none in 1.13).
#pragma once

#include <ATen/Tensor.h>
#include <ATen/core/Generator.h>
#include <c10/core/Allocator.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#endif

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace c10d {
class Reducer;
}
namespace torch::autograd::profiler {
struct KinetoEvent;
}

namespace accelerate::detail::compat {

/// The base class of the process groups this library implements itself (the MPI group).
#if TORCH_VERSION_MAJOR >= 2
using BackendBase = c10d::Backend;
#else
using BackendBase = c10d::ProcessGroup;
#endif

/// The base of an allocator of this library's (the process's pool of large CPU buffers):
/// `allocate_bytes` is what c10's `allocate` does, whichever form this release declares.
class AllocatorBase : public c10::Allocator {
 public:
  virtual at::DataPtr allocate_bytes(size_t bytes) = 0;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
  at::DataPtr allocate(size_t bytes) override { return allocate_bytes(bytes); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
#else
  at::DataPtr allocate(size_t bytes) const override { return const_cast<AllocatorBase*>(this)->allocate_bytes(bytes); }
#endif
};

/// The process group that c10d's users (the Reducer, collectives) hold, over `backend`, which
/// serves tensors on each of `devices` (LibTorch 2.x refuses a collective on tensors of a device
/// type the group has no back-end for). `name` is c10d's name of the back-end ("gloo", "nccl", "mpi").
c10::intrusive_ptr<c10d::ProcessGroup> as_process_group(c10::intrusive_ptr<BackendBase> backend,
                                                        const c10::intrusive_ptr<c10d::Store>& store,
                                                        const std::string& name,
                                                        std::initializer_list<c10::DeviceType> devices);

/// Gathers every rank's `input` into the flat `output` (c10d's `_allgather_base`, renamed
/// `all_gather_single` by 2.14) and reduce-scatters the flat `input` into `output` (sum).
c10::intrusive_ptr<c10d::Work> all_gather_single(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input);
c10::intrusive_ptr<c10d::Work> reduce_scatter_single(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input);
/// Whether `group` has the two flat collectives above: LibTorch 1.x's Gloo group has neither
/// (its callers use the list all-gather and an allreduce instead).
bool has_flat_collectives(const c10d::ProcessGroup& group);
/// Sends the flat `input` to every rank in `input_splits` pieces and receives `output_splits`
/// pieces into `output` (equal pieces when a split list is empty): c10d's `alltoall_base`, named
/// `all_to_all_single` by 2.14.
c10::intrusive_ptr<c10d::Work> all_to_all_single(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input,
                                                 std::vector<int64_t>& output_splits,
                                                 std::vector<int64_t>& input_splits);

/// c10d's Reducer over `params`, with the initial buckets `bucket_indices` (whose byte limits are
/// `per_bucket_limits`), later rebuilt with a first bucket of `first_bucket_bytes` and the rest
/// of `bucket_bytes`.
std::unique_ptr<c10d::Reducer> make_reducer(std::vector<at::Tensor> params,
                                            std::vector<std::vector<size_t>> bucket_indices,
                                            std::vector<size_t> per_bucket_limits,
                                            c10::intrusive_ptr<c10d::ProcessGroup> group,
                                            std::vector<bool> expect_sparse_gradients, int64_t bucket_bytes,
                                            bool find_unused_parameters, bool gradient_as_bucket_view,
                                            std::unordered_map<size_t, std::string> param_names,
                                            int64_t first_bucket_bytes);

/// An error carrying `message` and no backtrace, for a `Work` or `Future` to fail with.
c10::Error make_error(std::string message);

/// The key of `param`'s entry in `torch::optim::Optimizer::state()`.
#if TORCH_VERSION_MAJOR >= 2
inline void* optimizer_state_key(const at::Tensor& param) { return param.unsafeGetTensorImpl(); }
#else
std::string optimizer_state_key(const at::Tensor& param);
#endif

/// Autocast state of one device type (CPU or CUDA).
bool is_autocast_enabled(c10::DeviceType device);
c10::ScalarType get_autocast_dtype(c10::DeviceType device);
void set_autocast_enabled(c10::DeviceType device, bool enabled);
void set_autocast_dtype(c10::DeviceType device, c10::ScalarType dtype);

/// The default generator of `device`, a device of an out-of-tree backend (PrivateUse1), where
/// this LibTorch lets the backend provide one (2.x, through its hooks); none in 1.x, which asks
/// only CUDA for generators, or when the backend registered no hooks.
std::optional<at::Generator> backend_generator(c10::Device device);

/// LibTorch's scaled dot-product attention, which picks a fused kernel (flash, memory-efficient)
/// where the device and the inputs allow one; nothing on releases without it (1.13), where the
/// caller computes the attention itself.
std::optional<at::Tensor> fused_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                          const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                                          std::optional<double> scale);

/// A profiler event's start and duration in whole microseconds (the Chrome trace's unit).
int64_t event_start_us(const torch::autograd::profiler::KinetoEvent& event);
int64_t event_duration_us(const torch::autograd::profiler::KinetoEvent& event);

}  // namespace accelerate::detail::compat
