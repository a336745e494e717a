// A c10d process group over MPI, for CPU tensors. Debian's LibTorch is built without its own
// MPI group, so this one is ours. Only compiled when the build found MPI
// (build_config.h: ACCELERATE_HAVE_MPI); callers go through `make_mpi_process_group`, which
// reports the back-end as unavailable otherwise.
//
// Note [One MPI thread]
// Every MPI call of the process happens on one thread owned by the MPI runtime (initialised
// with MPI_THREAD_SERIALIZED). Collectives are queued in the order the caller issues them, which
// is the order every rank issues them, started as non-blocking MPI operations and completed by
// polling: a short spin, then yielding, then sleeping with a growing interval, so that a rank
// waiting for a slow peer leaves the cores to compute (two processes on two cores would
// otherwise lose half their speed to a spinning wait). The thread also acts as the watchdog: a
// collective still incomplete after the group's timeout fails with an error naming it, and
// the group is then broken, because an MPI collective cannot be cancelled.
#pragma once

#include "detail/topology.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace accelerate::detail {

/// Whether this process was started by an MPI launcher whose process-management server MPI can
/// reach (Open MPI's `mpirun` through PMIx, or an MPICH-style PMI one).
bool started_by_mpirun();

/// Refuses, naming the launchers to use, when this process was not started by an MPI launcher.
/// Called before any rendezvous, so that it is the error such a job sees, whatever else fails.
void require_started_by_mpirun();

/// The process group over MPI_COMM_WORLD (duplicated). Fails with a clear error when this build
/// has no MPI, when the process was not started by `mpirun`, or when MPI's world does not
/// match `topology`.
/// `store` is the job's store, which LibTorch 2.x process groups keep (a private one if null).
c10::intrusive_ptr<c10d::ProcessGroup> make_mpi_process_group(const Topology& topology,
                                                              std::chrono::milliseconds timeout,
                                                              const c10::intrusive_ptr<c10d::Store>& store = {});

/// The process group of the processes that pass the same `color` (numbered by `rank`, of
/// `size`): a split of MPI's world, so every process of the job calls it at the same point. The
/// job's group must exist already (MPI is started).
c10::intrusive_ptr<c10d::ProcessGroup> make_mpi_subgroup(const Topology& topology, int color, int rank, int size,
                                                         std::chrono::milliseconds timeout);

}  // namespace accelerate::detail
