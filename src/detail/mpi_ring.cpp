// The MPI process group's ring algorithms; see mpi_ring.h.
#include "detail/mpi_ring.h"

#include "detail/half_math.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace accelerate::detail::mpi {

// Note [A ring reduce-scatter]
// Open MPI's blocking reduce-scatter algorithms allocate temporaries of the whole input, or
// twice it (a fully sharded unit's gradients: 36 MiB for an 18 MiB unit), on every call; on a
// process that holds little else this is a good part of its peak memory. A sum is reduced
// around a ring instead, with the same bytes on the wire ((N-1)/N of the input per process):
// in step k every process sends the partial sum of one block to the next process and receives
// another block's from the one before, adding its own rows to it; after N-1 steps each holds
// its own block's sum. The output holds the partial sum being passed on. Each step goes segment
// by segment: once a segment has been sent, its place in the output takes the next partial sum's
// segment (the one received plus this process's rows), so the only temporary is one segment,
// whatever the size of the blocks (the MPI thread's own heap would otherwise keep blocks of
// them). The ring runs on a communicator of its own, so its messages never meet users'
// point-to-point messages; groups that never reduce-scatter this way never make it.

namespace {

// `ring` is the group's communicator for it, made from `group` on first use: every process of the
// group runs the same collectives in the same order, and this one only once all have arrived
// (Note [Large collectives block]), so they all make it together.
MPI_Comm ring_comm(MPI_Comm group, MPI_Comm& ring, const char* name) {
  if (ring == MPI_COMM_NULL) {
    check_mpi(MPI_Comm_dup(group, &ring), name, "MPI_Comm_dup");
    MPI_Comm_set_errhandler(ring, MPI_ERRORS_RETURN);
  }
  return ring;
}

constexpr int64_t kRingSegmentBytes = int64_t{1} << 20;

}  // namespace

void ring_reduce_scatter_sum(MPI_Comm group, MPI_Comm& ring, const at::Tensor& in, const at::Tensor& out,
                             MPI_Datatype datatype, const char* name) {
  const MPI_Comm comm = ring_comm(group, ring, name);
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const int64_t n = out.numel();
  const auto block = [&](int b) { return in.narrow(0, ((b % size) + size) % size * n, n); };
  at::NoGradGuard no_grad;
  if (size == 1 || n == 0) {
    out.copy_(block(0));
    return;
  }
  const int64_t segment = std::min<int64_t>(n, std::max<int64_t>(1, kRingSegmentBytes / out.element_size()));
  const at::Tensor received = at::empty({segment}, out.options());
  const int next = (rank + 1) % size, before = (rank + size - 1) % size;
  for (int step = 0; step + 1 < size; ++step) {
    // Step 0 sends this process's own rows of the block before its own; later steps the partial
    // sum that the step before left in `out`.
    const at::Tensor sent = step == 0 ? block(rank - 1) : out;
    const at::Tensor own = block(rank - step - 2);
    for (int64_t first = 0; first < n; first += segment) {
      const int64_t length = std::min(segment, n - first);
      const int count = count_of(length, name);
      check_mpi(MPI_Sendrecv(sent.narrow(0, first, length).data_ptr(), count, datatype, next, 0,
                             received.data_ptr(), count, datatype, before, 0, comm, MPI_STATUS_IGNORE),
                name, "MPI_Sendrecv");
      at::Tensor place = out.narrow(0, first, length);
      add_out(place, received.narrow(0, 0, length), own.narrow(0, first, length));
    }
  }
}

// Note [A ring allreduce]
// Open MPI's allreduce of a large payload allocates temporaries as large as the payload on every
// call (strace of W4 on two processes: a 64 MiB mapping per 64 MiB allreduce); above glibc's
// largest mmap threshold (32 MiB) that is fresh memory from the kernel each time, which on a
// virtual machine costs more than the reduction (Note [One pool for the process's large CPU
// buffers] in buffer_pool.cpp). A large sum goes around the ring of Note [A ring reduce-scatter]
// instead, in place: in step k every process sends block r-k-1 of the buffer, which holds a
// partial sum, and adds the block it receives, segment by segment, into block r-k-2; after N-1
// steps block r holds its whole sum, and an in-place all-gather gives every process every block.
// The only temporary is one segment. Blocks differ by at most one element when N does not
// divide the payload; every process runs the same number of segments (the largest block's), an
// empty message where its block is shorter, so the messages of neighbours always pair up.
void ring_allreduce_sum(MPI_Comm group, MPI_Comm& ring, const at::Tensor& buffer, MPI_Datatype datatype,
                        const char* name) {
  const MPI_Comm comm = ring_comm(group, ring, name);
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  if (size == 1) return;
  at::NoGradGuard no_grad;
  const at::Tensor flat = buffer.view({-1});
  const int64_t total = flat.numel();
  const int64_t base = total / size, extra = total % size;
  const auto begin = [&](int b) { return b * base + std::min<int64_t>(b, extra); };
  const auto length = [&](int b) { return base + (b < extra ? 1 : 0); };
  const auto wrap = [&](int b) { return ((b % size) + size) % size; };
  const int64_t longest = base + (extra > 0 ? 1 : 0);
  const int64_t segment = std::max<int64_t>(1, kRingSegmentBytes / flat.element_size());
  const at::Tensor received = at::empty({std::min(segment, std::max<int64_t>(longest, 1))}, flat.options());
  const int next = (rank + 1) % size, before = (rank + size - 1) % size;
  for (int step = 0; step + 1 < size; ++step) {
    const int sent = wrap(rank - step - 1), added = wrap(rank - step - 2);
    for (int64_t first = 0; first < longest; first += segment) {
      const int64_t send_count = std::clamp<int64_t>(length(sent) - first, 0, segment);
      const int64_t add_count = std::clamp<int64_t>(length(added) - first, 0, segment);
      check_mpi(MPI_Sendrecv(static_cast<char*>(flat.data_ptr()) + (begin(sent) + first) * flat.element_size(),
                             count_of(send_count, name), datatype, next, 0, received.data_ptr(),
                             count_of(add_count, name), datatype, before, 0, comm, MPI_STATUS_IGNORE),
                name, "MPI_Sendrecv");
      if (add_count == 0) continue;
      at::Tensor place = flat.narrow(0, begin(added) + first, add_count);
      add_out(place, place, received.narrow(0, 0, add_count));
    }
  }
  // The same ring passes the sums on: in step k block r-k goes to the next process and block
  // r-k-1 arrives in its place.
  char* data = static_cast<char*>(flat.data_ptr());
  for (int step = 0; step + 1 < size; ++step) {
    const int sent = wrap(rank - step), arrived = wrap(rank - step - 1);
    check_mpi(MPI_Sendrecv(data + begin(sent) * flat.element_size(), count_of(length(sent), name), datatype, next, 1,
                           data + begin(arrived) * flat.element_size(), count_of(length(arrived), name), datatype,
                           before, 1, comm, MPI_STATUS_IGNORE),
              name, "MPI_Sendrecv");
  }
}

}  // namespace accelerate::detail::mpi
