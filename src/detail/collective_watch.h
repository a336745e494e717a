// The collective watch: every wait of a library collective goes through `watch_wait`, which
// waits as before on the fast path and, when a wait lasts longer than a few seconds, compares
// notes with the other processes through the job's store, so that a collective some processes
// skip is named within seconds instead of hanging until the process group's timeout (Note [The
// collective watch]). The DDP reducer's bucket allreduces, which the reducer waits for inside the
// backward pass, are watched through their futures (`watch_future`); c10d's coalesced broadcasts
// are not watched.
#pragma once

#include "accelerate/state.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue_inl.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cstdint>
#include <exception>
#include <string>

namespace accelerate::detail {

struct PartialStateImpl;

/// A collective as the watch knows it: its number among the watched collectives of its process
/// group, counted from 1 since the group was made, and its operation ("all_gather", "barrier", …).
struct CollectiveTicket {
  uint64_t number = 0;
  const char* operation = "";
};

/// Names the library call a thread is in (`get_state_dict`, `save_state`, `backward`, …) for the
/// collectives it issues underneath: their records, and debug mode's check, read "from
/// get_state_dict (FullyShardedDataParallel)" instead of the engine's name alone. The outermost
/// scope of a thread wins; one thread-local store on entry and one on exit.
class CallingApi {
 public:
  explicit CallingApi(const char* name) noexcept;
  ~CallingApi();
  CallingApi(const CallingApi&) = delete;
  CallingApi& operator=(const CallingApi&) = delete;

 private:
  bool outermost_;
};

/// `api` as the records name it: "<calling API> (<api>)" inside a `CallingApi` scope of another
/// name, `api` itself otherwise.
std::string api_in_context(const char* api);

/// Records that this process enters `operation` on `state`'s process group and sends `sent` bytes
/// in it (the process's communication counters): relaxed atomic increments, nothing else.
CollectiveTicket enter_collective(const PartialState& state, const char* operation, uint64_t sent) noexcept;

/// Counts a collective that the watch does not follow (c10d's coalesced broadcasts, the rings of
/// compressed buckets) in the process's communication counters.
void count_unwatched(uint64_t sent) noexcept;

// The bytes one process sends in a collective over `processes` processes (Note [Counting the
// bytes a process sends]): a ring allreduce of `bytes`, an all-gather of pieces of `piece` bytes,
// a reduce-scatter of `bytes` in all, a broadcast of `bytes` from its root.
uint64_t all_reduce_sent(int processes, uint64_t bytes) noexcept;
uint64_t all_gather_sent(int processes, uint64_t piece) noexcept;
uint64_t reduce_scatter_sent(int processes, uint64_t bytes) noexcept;
uint64_t broadcast_sent(int processes, bool root, uint64_t bytes) noexcept;
/// The process's counters (`accelerate::communication_counters`): collectives entered, bytes sent.
struct Traffic {
  uint64_t collectives = 0;
  uint64_t bytes_sent = 0;
};
Traffic communication_totals() noexcept;
/// The bytes of a tensor's elements.
uint64_t bytes_of(const at::Tensor& t) noexcept;

/// The error of a collective that failed or timed out on this process and that no record
/// explains (a peer died, or did not arrive within the timeout): raised as it was before the watch.
using FailureMessage = std::string (*)(const PartialState& state, const char* api, const std::exception& e);

/// Waits for `work`, the collective `ticket` entered for `api`, with the state's timeout. A wait
/// longer than the state's check delay compares records with the other processes: a mismatch
/// (every process waits in a collective, not all in the same one) or a process that ended its
/// program raises on every process, naming what each one does; a process that is not in a
/// collective is warned about, never an error. A failure that the records do not explain raises
/// `failure(state, api, e)`.
void watch_wait(const PartialState& state, const CollectiveTicket& ticket, const c10::intrusive_ptr<c10d::Work>& work,
                const char* api, FailureMessage failure);

/// Watches a collective whose wait is not the library's own (the DDP reducer's bucket
/// allreduces): the future returned completes as `future` does, or fails with the error
/// `watch_wait` would raise (a mismatch, or a process that ended its program) once the wait has
/// lasted longer than the check delay and the records show one. One thread per process compares
/// the records of such waits; the fast path adds a callback and nothing else.
c10::intrusive_ptr<c10::ivalue::Future> watch_future(const PartialState& state, const CollectiveTicket& ticket,
                                                     const c10::intrusive_ptr<c10::ivalue::Future>& future,
                                                     const char* api);

/// Tells the other processes of `impl`'s group that this one has ended its program (its state is
/// destroyed, or its process group): a wait of theirs names it. Never throws.
void publish_ended(PartialStateImpl& impl) noexcept;

}  // namespace accelerate::detail
