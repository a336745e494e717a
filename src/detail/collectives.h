// Tensor and byte collectives over a state's process group: the primitives that the operations
// module, the data loaders and the checkpoint code build on. Each one waits with the state's
// timeout, names the calling API in its errors, and in debug mode first checks that every process
// is calling the same operation on compatible tensors (see Note [Debug-mode collective check]).
// With a single process every function is the identity.
#pragma once

#include "accelerate/state.h"
#include "detail/collective_watch.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <string>
#include <vector>

namespace accelerate::detail {

/// How a reduction combines values.
enum class Reduction { kSum, kMean, kMax, kMin, kProduct };
/// Parses upstream's names: "sum", "mean", "max", "min", "prod"/"product".
Reduction parse_reduction(const std::string& name, const char* api);

/// What is compared across processes before a collective in debug mode.
enum class ShapeCheck {
  kExact,       ///< dtype, device and the full shape must agree
  kTrailing,    ///< dtype, device, rank and every dimension but the first must agree
  kDtypeOnly,   ///< sizes may differ (padding, variable-length payloads)
};

/// In debug mode, verifies that every process calls `api` with a matching tensor; raises on
/// every process with each process's values otherwise. A no-op outside debug mode.
void verify_collective(const PartialState& state, const char* api, const at::Tensor& tensor, ShapeCheck check);

/// In debug mode, compares `signature` (a one-line description of what this process is about to
/// do) with every other process's; raises on every process with each one's line when they
/// differ. `must_agree` completes "every process must …" in the message. A no-op outside debug mode.
void verify_signature(const PartialState& state, const char* api, const std::string& signature,
                      const char* must_agree);

/// `t` where `state`'s process group can move it: itself, except a CPU tensor on a group that
/// carries only device tensors (NCCL), which is copied to the job's device. The library's own
/// messages (lengths, bytes, flags) are made on the CPU and travel through this; so do a user's
/// CPU tensors given to the collectives below, which give results back on the input's device.
at::Tensor on_collective_device(const PartialState& state, const at::Tensor& t);

/// Every process's `tensor` (same shape everywhere), in process order.
std::vector<at::Tensor> all_gather(const PartialState& state, const at::Tensor& tensor, const char* api);
/// Every process's `tensor` (of the same shape), concatenated along the first dimension.
at::Tensor all_gather_cat(const PartialState& state, const at::Tensor& tensor, const char* api);
/// `tensor` of process `from_process` on every process (same shape and dtype everywhere).
at::Tensor broadcast(const PartialState& state, const at::Tensor& tensor, int from_process, const char* api);
/// The elementwise reduction of every process's `tensor`.
at::Tensor all_reduce(const PartialState& state, const at::Tensor& tensor, Reduction reduction, const char* api);

/// Sends `tensor` to the next process of the group (process i to i+1, the last to the first) and
/// returns what the previous one sent, of shape `incoming` (one step around a ring, as an
/// all-to-all in which each process has one peer; 16-bit floats travel as float).
at::Tensor pass_to_next(const PartialState& state, const at::Tensor& tensor, at::IntArrayRef incoming,
                        const char* api);

/// Gathers every process's flat `input` (same length everywhere) into `output`, which holds
/// `num_processes()` times as many elements, in process order.
void all_gather_into(const PartialState& state, at::Tensor& output, at::Tensor& input, const char* api);
/// Sums the flat `input` (`num_processes()` equal pieces) over the processes and writes this
/// process's piece of the sum into `output`. `input` may be overwritten.
void reduce_scatter_sum(const PartialState& state, at::Tensor& output, at::Tensor& input, const char* api);

/// A collective started and not yet waited for.
struct PendingCollective {
  c10::intrusive_ptr<c10d::Work> work;
  std::function<void()> finish;  ///< runs after the wait (copies out of a fallback's buffer)
  CollectiveTicket ticket;       ///< what the watch knows of it (Note [The collective watch])
};
/// `all_gather_into`, started: `output` holds the result once `wait_collective` returned. Both
/// tensors must stay alive and untouched until then.
PendingCollective all_gather_into_async(const PartialState& state, at::Tensor& output, at::Tensor& input,
                                        const char* api);
/// `reduce_scatter_sum`, started: `output` holds the result once `wait_collective` returned.
/// `input` must stay alive and untouched until then.
PendingCollective reduce_scatter_sum_async(const PartialState& state, at::Tensor& output, at::Tensor& input,
                                           const char* api);
/// Waits for `pending`, with the state's timeout and an error that names `api`.
void wait_collective(const PartialState& state, PendingCollective& pending, const char* api);

/// Every process's bytes, of any length, in process order.
std::vector<std::vector<char>> all_gather_bytes(const PartialState& state, const std::vector<char>& bytes,
                                                const char* api);
/// The bytes of process `from_process`, on every process.
std::vector<char> broadcast_bytes(const PartialState& state, const std::vector<char>& bytes, int from_process,
                                  const char* api);

/// Every process's value (pickled through LibTorch), in process order.
std::vector<c10::IValue> all_gather_ivalue(const PartialState& state, const c10::IValue& value, const char* api);
/// The value of process `from_process`, on every process.
c10::IValue broadcast_ivalue(const PartialState& state, const c10::IValue& value, int from_process, const char* api);

}  // namespace accelerate::detail
