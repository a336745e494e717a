// The sums the MPI process group reduces around a ring of point-to-point exchanges instead of
// Open MPI's own large-payload algorithms, whose temporaries are as large as the payload (Note [A
// ring reduce-scatter], Note [A ring allreduce] in mpi_ring.cpp). Both are blocking and run on the
// MPI thread (mpi_runtime.h), once every process of the group has arrived (Note [Large
// collectives block]); they move the same bytes as Open MPI's algorithms and hold one segment of
// 1 MiB as their only temporary. Other reductions, and the collectives that allocate nothing
// large, stay Open MPI's. Compiled only when the build found MPI, like everything that includes
// <mpi.h>.
#pragma once

#include "detail/mpi_runtime.h"

#include <ATen/core/Tensor.h>

namespace accelerate::detail::mpi {

/// Sums `in` (the group's size times `out`'s elements, flat) over the processes of `group` and
/// leaves in `out` this process's block of the sum (Note [A ring reduce-scatter]). `ring` is the
/// group's communicator for the ring, made from `group` on first use (MPI_COMM_NULL until then).
void ring_reduce_scatter_sum(MPI_Comm group, MPI_Comm& ring, const at::Tensor& in, const at::Tensor& out,
                             MPI_Datatype datatype, const char* name);

/// Sums `buffer` in place over the processes of `group` (Note [A ring allreduce]); `ring` as for
/// ring_reduce_scatter_sum.
void ring_allreduce_sum(MPI_Comm group, MPI_Comm& ring, const at::Tensor& buffer, MPI_Datatype datatype,
                        const char* name);

}  // namespace accelerate::detail::mpi
