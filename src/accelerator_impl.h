// The state behind an `Accelerator` handle, shared by the files that implement it.
#pragma once

#include "accelerate/accelerator.h"
#include "accelerate/device_mesh.h"
#include "accelerate/parallelism_config.h"
#include "fsdp/settings.h"

#include <map>
#include <atomic>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

namespace accelerate::detail {

struct AcceleratorImpl {
  AcceleratorOptions options;
  bool standalone = false;
  std::optional<GradScaler> scaler;
  std::optional<FullyShardedDataParallelPlugin> fsdp;  // when prepared models are sharded
  std::optional<fsdp::FsdpSettings> fsdp_settings;     // `fsdp`, resolved when the Accelerator was built
  int dp_shard_size = 0;  // a parallelism_config's shard groups (0: the plugin decides)
  std::optional<ParallelismConfig> parallelism;  // the options' parallelism_config, resolved
  std::optional<DeviceMesh> mesh;  // with a parallelism_config
  int tp_size = 1;  // the mesh's tp size (1 without a mesh)
  std::atomic<int> joining{0};  // join_uneven_inputs in progress: no preemption check (Note [Preemption])
  int preemption_base = 0;       // the signals that had asked to stop before this one's handlers (preemption.cpp)

  std::mutex mutex;  // guards everything below
  ProjectConfiguration project;
  // Whether the program chose the next checkpoint's number (ProjectConfiguration::iteration,
  // set_save_iteration or load_state); else the first save numbers after an earlier run's.
  bool iteration_chosen = false;
  std::set<int64_t> checkpoints_written;  // numbers of the checkpoints this accelerator saved
  // The step boundaries of the prepared data loaders passed with gradients enabled, and how many
  // had passed when the newest checkpoint was saved or loaded (-1: none), and its folder: a stop
  // at the same count finds the state already saved (Note [Preemption]).
  int64_t boundaries_passed = 0;
  int64_t checkpoint_boundary = -1;
  std::string checkpoint_folder;
  std::vector<DistributedDataParallel> models;
  std::vector<AcceleratedOptimizer> optimizers;
  std::vector<AcceleratedScheduler> schedulers;
  std::vector<DataLoader> data_loaders;
  int64_t step = 0;
  std::vector<CheckpointObject> custom_objects;
  std::map<int64_t, SaveStatePreHook> save_hooks;
  std::map<int64_t, LoadStatePreHook> load_hooks;
  int64_t next_hook_id = 0;

  // Experiment tracking (src/accelerator_tracking.cpp).
  std::vector<Tracker> log_with;  // checked and resolved by filter_trackers
  std::vector<std::shared_ptr<GeneralTracker>> trackers;
  bool trackers_running = false;
};

}  // namespace accelerate::detail
