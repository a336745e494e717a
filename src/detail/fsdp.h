// The fully sharded data-parallel engine behind `FullyShardedDataParallelPlugin` (upstream hands
// the model to PyTorch's `fully_shard`; LibTorch has no such engine, so this is our own, on
// c10d's flat all-gather and reduce-scatter). See Note [Fully sharded engine] in fsdp.cpp for how
// a parameter moves between its shard and its full form.
#pragma once

#include "accelerate/checkpointing.h"
#include "accelerate/distributed.h"
#include "accelerate/grad_scaler.h"
#include "accelerate/state.h"
#include "accelerate/utils/dataclasses.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace accelerate::detail {

/// The plugin with every field decided (from the user's struct, the environment, the defaults).
struct FsdpSettings {
  int fsdp_version = 1;
  FsdpShardingStrategy sharding_strategy = FsdpShardingStrategy::kFullShard;
  bool reshard_after_forward = true;
  FsdpBackwardPrefetch backward_prefetch = FsdpBackwardPrefetch::kNoPrefetch;
  c10::optional<at::ScalarType> param_dtype;
  c10::optional<at::ScalarType> reduce_dtype;
  c10::optional<at::ScalarType> buffer_dtype;
  FsdpAutoWrapPolicy auto_wrap_policy = FsdpAutoWrapPolicy::kNoWrap;
  FsdpWrapCallable auto_wrap_callable;
  std::vector<std::string> transformer_cls_names_to_wrap;
  int64_t min_num_params = 100000000;
  bool cpu_offload = false;
  std::vector<std::string> ignored_modules;
  FsdpStateDictType state_dict_type = FsdpStateDictType::kFullStateDict;
  bool sync_module_states = true;
  std::function<void(torch::nn::Module&)> param_init_fn;
  bool cpu_ram_efficient_loading = false;
  bool activation_checkpointing = false;
  bool forward_prefetch = false;
  bool limit_all_gathers = true;
  bool use_orig_params = true;
};

/// Resolves `plugin` against the environment (`FSDP_*`, as upstream's `__post_init__`) and the
/// defaults, and refuses what cannot apply, naming the field.
FsdpSettings resolve_fsdp_plugin(const FullyShardedDataParallelPlugin& plugin, c10::Device device);

struct FsdpEngineImpl;
class FsdpEngine;

/// The fully sharded engine of a prepared model, or null.
FsdpEngine* fsdp_engine(const DistributedDataParallel& model);

/// Makes `scaler`'s overflow checks agree over the processes of `state` (the sharded scaler of
/// upstream's FSDP): with sharded gradients each process sees only its rows' infinities, and a
/// step skipped on one process must be skipped on all.
void share_inf_checks(const GradScaler& scaler, const PartialState& state);

/// The first of the rows (of `rows`) that process `rank` of `world` holds, and how many.
std::pair<int64_t, int64_t> rows_held(int64_t rows, int world, int rank);

/// Writes this process's part of a sharded state into `folder` (Note [Sharded checkpoint
/// layout]): `tensors` by name, `values` (JSON), and for each row-sharded tensor its whole shape
/// in `sharded`. Process 0 also writes the folder's index. Every process must call it.
void save_sharded_state(const PartialState& state, const std::string& folder, const nlohmann::json& values,
                        const std::map<std::string, at::Tensor>& tensors,
                        const std::map<std::string, std::vector<int64_t>>& sharded);
/// What this process holds of a folder written by `save_sharded_state`, at the current number of
/// processes (rows of sharded tensors come from whichever files hold them); with `same_world`,
/// refuses a folder written by another number of processes.
StateDict load_sharded_state(const PartialState& state, const std::string& folder, bool same_world = false);
/// The whole tensors of a folder written by `save_sharded_state` (what `accelerate
/// merge-weights` writes); raises naming a missing file or a tensor of the wrong size.
TensorMap merge_sharded_state(const std::string& folder);

/// Shards a module's parameters over the processes of a group and runs the gathers and
/// reductions around its forward and backward passes. One per prepared model.
class FsdpEngine {
 public:
  /// Shards over groups of `dp_shard_size` consecutive processes of `state` and replicates over
  /// the groups (0: see `DistributedDataParallel::fully_sharded`).
  FsdpEngine(std::shared_ptr<torch::nn::Module> module, const PartialState& state, FsdpSettings settings,
             int dp_shard_size = 0);
  ~FsdpEngine();
  FsdpEngine(const FsdpEngine&) = delete;
  FsdpEngine& operator=(const FsdpEngine&) = delete;

  /// Before the root module's forward: gathers the root unit's parameters.
  void root_pre_forward();
  /// A floating input of the model's call in the policy's param_dtype (itself without one).
  at::Tensor cast_forward_input(const at::Tensor& input) const;
  /// After it: arms the backward pass (pre-backward hooks on `outputs`), or reshards everything
  /// when no backward pass can follow (gradients off).
  void root_post_forward(const std::vector<at::Tensor>& outputs);

  /// Whether backward passes reduce gradients (false inside `no_sync`: whole gradients
  /// accumulate locally until a synchronising pass), read when the pass reaches each unit.
  void set_require_backward_grad_sync(bool sync);

  /// The settings in force.
  const FsdpSettings& settings() const;
  /// The processes the parameters are sharded over (the whole job unless sharding is hybrid):
  /// ranks, numbers of processes and rows held are this group's.
  const PartialState& shard_group() const;
  /// How many groups hold a replica each (1 unless sharding is hybrid), and which one this
  /// process's group is: the first one writes the shards of sharded checkpoints.
  int num_replicas() const;
  int replica_index() const;
  /// The number of wrapped units, the root included, and each unit's module name ("" for the root).
  std::vector<std::string> unit_names() const;
  /// The whole value of every parameter and buffer, by name (gathered from every process; every
  /// process must call it).
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict();
  /// Writes `values` (whole tensors, by name) into this process's shards; refuses unknown or
  /// missing names and wrong shapes.
  void load_full_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& values, bool strict);
  /// How many gathers forward_prefetch and backward_prefetch started ahead of their units.
  std::pair<int64_t, int64_t> prefetch_counts() const;
  /// Whether `param` is one of the sharded parameters (NO_SHARD shards nothing).
  bool is_sharded(const at::Tensor& param) const;
  /// Whether `param` is one of this engine's parameters (sharded or not).
  bool manages(const at::Tensor& param) const;
  /// The shape `param` stands for (its own shape when it is not sharded).
  std::vector<int64_t> whole_shape(const at::Tensor& param) const;
  /// This process's rows of `whole`, a tensor of `param`'s whole shape (`whole` itself when
  /// `param` is not sharded).
  at::Tensor local_rows(const at::Tensor& param, const at::Tensor& whole) const;
  /// The whole tensor of which `local` holds this process's rows of `param` (a collective when
  /// `param` is sharded: every process must call it for the same parameter).
  at::Tensor whole_rows(const at::Tensor& param, const at::Tensor& local);
  /// This process's parameters and buffers by name, as they are (shards).
  std::vector<std::pair<std::string, at::Tensor>> local_state_dict() const;
  /// Copies this process's rows of a checkpoint into the shards (names and shapes checked).
  void load_local_state_dict(const std::map<std::string, at::Tensor>& values);
  /// The total `norm_type` norm of the gradients of `params` (shards of this engine or ordinary
  /// tensors), over all processes.
  double total_grad_norm(const std::vector<at::Tensor>& params, double norm_type);

  FsdpEngineImpl& impl() { return *impl_; }

 private:
  std::shared_ptr<FsdpEngineImpl> impl_;  // shared with the hooks, which hold it weakly
};

}  // namespace accelerate::detail
