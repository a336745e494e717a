// A c10d process group over MPI, for CPU tensors. Debian's LibTorch is built without its own
// MPI group, so this one is ours. Only compiled when the build found MPI
// (build_config.h: ACCELERATE_HAVE_MPI); callers go through `make_mpi_process_group`, which
// reports the back-end as unavailable otherwise. Its collectives run on MPI's one thread (Note [One
// MPI thread] in mpi_runtime.h).
#pragma once

#include "detail/topology.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace accelerate::detail {

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
