// The fully sharded data-parallel engine behind `FullyShardedDataParallelPlugin` (upstream hands
// the model to PyTorch's `fully_shard`; LibTorch has no such engine, so this is our own, on
// c10d's flat all-gather and reduce-scatter). See Note [Fully sharded engine] in engine_impl.h
// for how a parameter moves between its shard and its full form.
#pragma once

#include "accelerate/state.h"
#include "fsdp/settings.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accelerate::detail::fsdp {

struct FsdpEngineImpl;

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
  /// The units (not the root) whose hook has not run in the model's current forward pass
  /// (Note [Units called without their hook]).
  std::vector<std::string> units_without_hook() const;
  /// The number of wrapped units, the root included, and each unit's module name ("" for the root).
  std::vector<std::string> unit_names() const;
  /// The whole value of every parameter and buffer, by name (gathered from every process; every
  /// process must call it). With `keep` false nothing is kept: each whole tensor is dropped once
  /// gathered (the processes that write no file under `rank0_only`); `offload_to_cpu` moves each
  /// to the CPU as it is gathered.
  std::vector<std::pair<std::string, at::Tensor>> full_state_dict(bool keep = true, bool offload_to_cpu = false);
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

}  // namespace accelerate::detail::fsdp
