// The data behind the `PartialState`, `Store` and `GradientState` handles. Other modules of the
// library reach the process group through here; users never see these types.
#pragma once

#include "accelerate/state.h"
#include "detail/topology.h"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace accelerate::detail {

struct StoreImpl {
  c10::intrusive_ptr<c10d::Store> store;
};

struct PartialStateImpl {
  Topology topology;
  DistributedType distributed_type = DistributedType::kNo;
  c10::Device device{c10::kCPU};
  std::string backend;
  bool cpu = false;
  bool debug = false;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group;
  std::vector<std::string> addresses;  // every process's, by rank (Note [Naming the lost machine])
  std::mutex mutex;  // guards trigger and the destroyed process group
  bool trigger = false;
  std::mutex groups_mutex;
  std::map<std::string, std::shared_ptr<PartialStateImpl>> groups;  // split_state's, by layout
  // A group made by split_state: its members' ranks in the job, and the job's topology (empty
  // and unused for the job's own state; Note [Groups within groups]).
  std::vector<int> world_ranks;
  Topology world_topology;
  // The collective watch (Note [The collective watch]): the collectives entered on this group so
  // far, how long a wait lasts before the processes compare notes (zero: never), and the store
  // keys of this group's records.
  std::atomic<uint64_t> collectives{0};
  std::atomic<const char*> last_operation{""};  // a string literal
  std::chrono::milliseconds check_delay{std::chrono::seconds(5)};
  std::string watch_prefix = "watch/job/";
  // The rings of compressed DDP buckets made on this group so far: each takes the next number for
  // its messages' tag (Note [Ring sums of 16-bit buckets]).
  std::atomic<int> rings_made{0};

  PartialStateImpl() = default;
  PartialStateImpl(const PartialStateImpl&) = delete;
  PartialStateImpl& operator=(const PartialStateImpl&) = delete;
  ~PartialStateImpl();  // tells the others this process has ended (publish_ended)
};

struct GradientStateImpl {
  mutable std::mutex mutex;
  GradientAccumulationPlugin plugin;
  bool sync_gradients = true;
  bool end_of_dataloader = false;
  int64_t remainder = -1;
  std::vector<const void*> dataloaders;
  std::shared_ptr<const std::function<void(const GradientState&)>> step_boundary;  // shared: run without the lock
};

/// The process group of a state; throws when it has none (one process) or was destroyed.
c10::intrusive_ptr<c10d::ProcessGroup> process_group(const PartialState& state, const char* api);

/// A state over the processes of one of `groups` (global ranks; the groups partition the job's
/// processes): the group that holds this process, its ranks numbered in the group's order. Made
/// once per `tag` and layout and kept with `state` (until its process group is destroyed). Every
/// process of the job must ask for it at the same point of the program: making it is a
/// collective. A group of one process has no process group, as a job of one process. `state`
/// may itself be such a group (ranks are then its own): every process of the job splits its own
/// group at the same point (Note [Groups within groups]).
PartialState split_state(const PartialState& state, const std::vector<std::vector<int>>& groups,
                         const std::string& tag);

/// The message of a failed collective `e`, followed by the processes of each machine it names
/// (Note [Naming the lost machine]).
std::string collective_error_text(const PartialState& state, const std::exception& e);

}  // namespace accelerate::detail
