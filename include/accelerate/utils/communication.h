// What this process has sent to the others: the collectives it has entered and the bytes it put
// on the wire for them, counted by the library at each collective's entry (beyond upstream, which
// leaves this to profilers). The bytes are those the collective's algorithm sends from this
// process: a ring allreduce of n bytes over p processes sends 2(p-1)/p * n, an all-gather of
// pieces of m bytes (p-1) * m, a reduce-scatter of n bytes (p-1)/p * n (over Gloo, which runs it
// as an allreduce, the allreduce's bytes), a broadcast (p-1) * n from its root and nothing
// elsewhere (the total over the processes; Gloo's tree spreads a broadcast's sends over inner
// processes beyond two). Counted: the library's operations, the DDP reducer's bucket allreduces
// (compressed ones at their 16-bit size) and module-state broadcasts, FSDP's gathers,
// reduce-scatters and broadcasts, tensor parallelism's collectives and the checkpoint code's
// exchanges. Not counted: the DDP reducer's own bookkeeping (the map of used parameters of
// `find_unused_parameters`, sparse gradients' buckets) and collectives a program issues on a
// LibTorch process group of its own.
//
// The counters belong to the process and only grow; measure a stretch as the difference of two
// readings. They are relaxed atomics, read at any time from any thread.
//
// Example
//   const auto before = accelerate::communication_counters();
//   accelerator.backward(loss);
//   const auto after = accelerate::communication_counters();
//   std::cout << "this backward pass sent " << after.bytes_sent - before.bytes_sent << " bytes in "
//             << after.collectives - before.collectives << " collectives\n";
#pragma once

#include <cstdint>

namespace accelerate {

/// The collectives this process has entered and the bytes it has sent in them since it started.
struct CommunicationCounters {
  uint64_t collectives = 0;  ///< collectives entered, over every process group of the library
  uint64_t bytes_sent = 0;   ///< bytes sent by this process, by each collective's algorithm
};

/// The process's counters now (see the header's comment for what is counted).
CommunicationCounters communication_counters() noexcept;

}  // namespace accelerate
