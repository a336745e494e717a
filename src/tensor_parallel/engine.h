// Tensor parallelism of a prepared model: the layers of a plan split over the tensor-parallel
// group, the communication around their forward and backward passes (Megatron-LM's), and the
// whole tensors of state dicts. See Note [Tensor parallelism] in engine.cpp.
#pragma once

#include "accelerate/state.h"
#include "tensor_parallel/plan.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accelerate::detail::tensor_parallel {

struct TensorParallelEngineImpl;

class TensorParallelEngine {
 public:
  /// Splits the modules of `plan` over `group` (after making every process of the group hold
  /// process 0's values) and attaches their hooks. A collective of the group.
  TensorParallelEngine(std::shared_ptr<torch::nn::Module> module, const PartialState& group,
                       const std::vector<TpAssignment>& plan);
  ~TensorParallelEngine();
  TensorParallelEngine(const TensorParallelEngine&) = delete;
  TensorParallelEngine& operator=(const TensorParallelEngine&) = delete;

  /// The tensor-parallel group.
  const PartialState& group() const;
  /// Whether `param` holds only this process's piece.
  bool is_sharded(const at::Tensor& param) const;
  /// Replaces the sharded entries of `values` (by name in the model, this process's pieces) with
  /// the whole tensors. A collective of the group: every process calls it with the same names.
  void gather_whole(std::vector<std::pair<std::string, at::Tensor>>& values) const;
  /// The dimension `param` (split) is split on.
  int64_t split_dim(const at::Tensor& param) const;
  /// The dimension the parameter or buffer `name` (in the model) is split on; -1 when whole.
  int64_t split_dim_of(const std::string& name) const;
  /// The whole tensor of which `piece` (shaped like this process's piece of split `param`, an
  /// optimizer state say) is this process's part. A collective of the group.
  at::Tensor whole_of(const at::Tensor& param, const at::Tensor& piece) const;
  /// This process's piece of `whole`, a tensor shaped like all of split `param` (a view);
  /// `what` names it in the error raised when tp_size does not divide it.
  at::Tensor piece_of(const at::Tensor& param, const at::Tensor& whole, const std::string& what) const;
  /// Replaces the split entries of `values` (whole tensors, by name in the model) with this
  /// process's pieces (copies). Raises, naming the tensor, when one cannot be split.
  void split_whole(std::map<std::string, at::Tensor>& values) const;
  /// The `norm_type` norm of the gradients of `params` over the whole model: the split ones'
  /// over the group, the others' once. `norm_of` gives the norm of a subset of `params` over the
  /// processes of one tensor-parallel rank (the data-parallel shards', or this process's own);
  /// it is called twice, on every process. A collective.
  double total_grad_norm(const std::vector<at::Tensor>& params, double norm_type,
                         const std::function<double(const std::vector<at::Tensor>&)>& norm_of) const;

  /// The model's forward pass begins (the prepared model's call).
  void begin_pass();
  /// The split modules whose hook has not run in this pass.
  std::vector<std::string> modules_without_hook() const;
  /// After a pass that recorded gradients: refuses it when a split module's parameter was used
  /// without its hook (Note [Split layers called without their hook]).
  void check_pass(const std::vector<at::Tensor>& outputs) const;

 private:
  std::shared_ptr<TensorParallelEngineImpl> impl_;
};

}  // namespace accelerate::detail::tensor_parallel
