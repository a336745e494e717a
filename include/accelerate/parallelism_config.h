// The parallel dimensions of a job, resolved and checked in one place (upstream:
// `accelerate.ParallelismConfig`, itself after torchtitan's `ParallelDims`): the sizes of data
// parallelism's replicate and shard dimensions, of context parallelism and of tensor parallelism,
// the names of the dimensions each kind of parallelism spans, and the device mesh they make. The
// `Accelerator` resolves its config once (`resolved`) and the mesh, the fully sharded engine,
// tensor parallelism and context parallelism read only that value.
//
// Example:
//   accelerate::ParallelismConfig config{.dp_shard_size = 2, .cp_size = 2};
//   auto sizes = config.resolved(/*num_processes=*/4);
//   // sizes.dp_shard_cp_dim_names() is {"dp_shard", "cp"}: the model is sharded over all 4
//   // processes, while batches are split over the 2 of "dp" and sequences over the 2 of "cp".
//   std::string json = sizes.to_json();
#pragma once

#include "accelerate/device_mesh.h"
#include "accelerate/state.h"
#include "accelerate/utils/dataclasses.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace accelerate {

/// Sizes of the parallel dimensions of a job (upstream: `ParallelismConfig`). Their product must
/// be the number of processes, laid out as a `DeviceMesh` of dp_replicate × dp_shard × cp × tp
/// (tp innermost). Empty sizes take `PARALLELISM_CONFIG_DP_REPLICATE_SIZE`, `..._DP_SHARD_SIZE`,
/// `..._TP_SIZE`, `..._CP_SIZE`, else 1, except the shard size, which takes what is left of the
/// processes (upstream: 1, with the replicate size taking every process when all are 1).
struct ParallelismConfig {
  /// Groups that hold a replica each (with `dp_shard_size` > 1: hybrid sharding).
  std::optional<int> dp_replicate_size{};
  /// Processes one replica is sharded over.
  std::optional<int> dp_shard_size{};
  /// Processes each layer of the plan is split over (tensor parallelism).
  std::optional<int> tp_size{};
  /// Processes the sequence of each batch is split over (context parallelism): they read the
  /// same batches, `Accelerator::maybe_context_parallel` gives each its piece of the sequence and
  /// `accelerate::scaled_dot_product_attention` runs as ring attention over them. The model is
  /// sharded (or its gradients averaged) over dp_shard × cp.
  std::optional<int> cp_size{};
  /// Which implementation runs context parallelism: "torch" (upstream's one choice, PyTorch's
  /// ring attention; here the library's own). Empty: `PARALLELISM_CONFIG_CP_BACKEND`, else "torch".
  std::string cp_backend{};
  /// How keys and values travel within a context-parallel group.
  TorchContextParallelConfig cp_handler{};
  // Upstream's `tp_handler` is `AcceleratorOptions::tp_handler`: a plan inside an optional
  // ParallelismConfig trips GCC 12's -Wmaybe-uninitialized on every copy of the options.

  /// Every size, backend and strategy filled in (from the environment, then the defaults) and
  /// checked against `num_processes`; throws `c10::ValueError` naming what is wrong. The methods
  /// below read a resolved config (an empty size counts as 1).
  ParallelismConfig resolved(int num_processes) const;

  int total_size() const;                 ///< dp_replicate × dp_shard × cp × tp
  int data_parallel_size() const;         ///< dp_replicate × dp_shard: processes reading distinct batches
  int non_data_parallel_size() const;     ///< cp × tp: processes reading the same batch
  bool dp_replicate_enabled() const;      ///< dp_replicate_size > 1
  bool dp_shard_enabled() const;          ///< dp_shard_size > 1
  bool tp_enabled() const;                ///< tp_size > 1
  bool cp_enabled() const;                ///< cp_size > 1
  /// The enabled dimensions data parallelism spans: "dp_replicate", "dp_shard".
  std::vector<std::string> dp_dim_names() const;
  /// The enabled dimensions whose processes read the same batch: "tp", "cp".
  std::vector<std::string> non_dp_dim_names() const;
  /// The enabled dimensions flattened into "dp_shard_cp", over which a model is sharded.
  std::vector<std::string> dp_shard_cp_dim_names() const;
  /// The enabled dimensions flattened into "dp_cp", over which gradients and the loss are averaged.
  std::vector<std::string> dp_cp_dim_names() const;
  /// The dimensions of the fully sharded mesh: "dp_replicate" when enabled, then "dp_shard_cp".
  std::vector<std::string> fsdp_dim_names() const;
  /// `dp_dim_names()` then `non_dp_dim_names()`.
  std::vector<std::string> active_mesh_dims() const;

  /// Lays the processes of `state` out as this config's mesh, making every group (a collective:
  /// every process at the same point), and keeps it for `get_device_mesh`.
  DeviceMesh build_device_mesh(const PartialState& state);
  /// The mesh `build_device_mesh` made; without one, builds it over `state` when given, else
  /// throws `c10::ValueError`.
  DeviceMesh get_device_mesh(const std::optional<PartialState>& state = std::nullopt);

  /// The sizes, backend and strategy as a JSON object (upstream's `to_json`); `from_json` reads it.
  std::string to_json() const;
  static ParallelismConfig from_json(const std::string& json);

  /// The mesh once built (upstream: the config's `device_mesh`).
  std::shared_ptr<DeviceMesh> device_mesh{};
};

}  // namespace accelerate
