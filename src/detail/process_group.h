// Rendezvous and process-group creation over c10d: a TCP store (or a given one), a bounded
// "everyone joined" barrier with a clear error, then Gloo (CPU) or NCCL (CUDA).
#pragma once

#include "detail/topology.h"
#include "detail/store_server.h"  // is_loopback_address

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace accelerate::detail {

/// What the process group needs to know.
struct RendezvousConfig {
  Topology topology;
  std::string backend;  // "gloo" or "nccl"
  std::chrono::milliseconds collective_timeout{std::chrono::minutes(30)};
  std::chrono::milliseconds rdzv_timeout{std::chrono::seconds(900)};
  /// A store given by the caller; else the job's store at the topology's master address.
  c10::intrusive_ptr<c10d::Store> store;
  /// The launcher already serves the store, so rank 0 connects as a client too.
  bool store_hosted = false;
  /// The job's secret for the store (Note [The job's store]); empty when the job has none.
  std::string secret;
  /// Keys of each restart of the job are kept apart.
  int restart_count = 0;
};

struct Rendezvous {
  c10::intrusive_ptr<c10d::Store> store;  // prefixed for this job attempt
  c10::intrusive_ptr<c10d::ProcessGroup> process_group;
  /// The address of every process (by rank) as the others reach it, for jobs of several machines
  /// on Gloo or NCCL (Note [Naming the lost machine]); empty otherwise.
  std::vector<std::string> addresses;
};

/// The process group of some processes of a job: `ranks` (global ranks, in the group's order)
/// of the job `topology`, which must include this process; `color` numbers the group among the
/// groups made together, `tag` keeps its store keys apart from every other group's. Its members
/// connect through `store`; on MPI every process of the job must call it at the same point (a
/// split of MPI's world), with one-process groups too.
c10::intrusive_ptr<c10d::ProcessGroup> make_subgroup(const std::string& backend,
                                                     const c10::intrusive_ptr<c10d::Store>& store,
                                                     const Topology& topology, const std::vector<int>& ranks,
                                                     int color, const std::string& tag,
                                                     std::chrono::milliseconds timeout);

/// For an error that names the addresses of peers ("[10.0.0.2]:port", as Gloo writes them), the
/// processes that ran at each one: "; 10.0.0.2 is the machine of processes 2 and 3". Empty when
/// the error names none of `addresses` (by rank).
std::string name_lost_machines(const std::vector<std::string>& addresses, const std::string& error);

/// Connects to (or serves) the store, waits until every process joined, builds the process group.
/// Every failure names what went wrong: the port in use, the unreachable address, how many of
/// the processes joined before the timeout.
Rendezvous rendezvous(const RendezvousConfig& config);

/// Whether this process was started by an MPI launcher whose process-management server MPI can
/// reach (Open MPI's `mpirun` through PMIx, or an MPICH-style PMI one).
bool started_by_mpirun();

/// Refuses, naming the launchers to use, when this process was not started by an MPI launcher.
/// Called before any rendezvous, so that it is the error such a job sees, whatever else fails.
void require_started_by_mpirun();

}  // namespace accelerate::detail
