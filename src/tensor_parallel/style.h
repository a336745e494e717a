// The tensor-parallel styles, one type per style (PyTorch's tensor/parallel/style.py, one
// ParallelStyle each; the names are transformers'): what a style splits of its module (which
// parameter, along which dimension), the hooks around its module's forward, and how a whole
// tensor of a split parameter is cut into, and joined from, pieces for state dicts. One table in
// style.cpp names them; a new style is a type there and a row of the table. The engine
// (tensor_parallel/engine.h) applies them; their communication is tensor_parallel/communication.h.
#pragma once

#include "accelerate/state.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace accelerate::detail::tensor_parallel {

/// What a style's hooks are given besides their module: its name and the tensor-parallel group.
struct StyleCall {
  const std::string& module_name;  ///< in the model
  const PartialState& group;
  int64_t group_id;  ///< the group's number for the communication functions (`register_group`)
};

/// A parameter a style splits: its name in its module and the dimension it is cut along.
struct ParamSplit {
  const char* name;
  int64_t dim;
};

/// How one module is split over the tensor-parallel group. Each module of a plan has an instance
/// of its own, which holds the module's calls in flight.
class ParallelStyle {
 public:
  explicit ParallelStyle(const char* name) : name_(name) {}
  virtual ~ParallelStyle() = default;
  ParallelStyle(const ParallelStyle&) = delete;
  ParallelStyle& operator=(const ParallelStyle&) = delete;

  /// The style's name in a plan ("colwise").
  const char* name() const { return name_; }
  /// Whether the style applies to modules of any class; otherwise to torch::nn::Linear and
  /// torch::nn::Embedding only.
  virtual bool any_module() const { return false; }
  /// Whether the style leaves its module as it is ("replicate"): its hook need not run, and the
  /// module may sit inside or around any other module of the plan.
  virtual bool inert() const { return false; }
  /// Whether the module computes whole on this process's piece of the sequence
  /// ("sequence_parallel"): no module of the plan that is not inert may sit inside it or around
  /// it, it may share no parameter with a module outside it, and its parameters' gradients are
  /// summed over the group.
  virtual bool runs_on_sequence_piece() const { return false; }

  /// Binds this instance to `module` (`name` in the model), before its parameters are split;
  /// throws `c10::ValueError` for a module this style cannot split.
  virtual void attach(torch::nn::Module& module, const std::string& name) {}
  /// The parameters of the attached `module` that the style splits, each with its dimension.
  virtual std::vector<ParamSplit> splits(torch::nn::Module& module) const { return {}; }

  /// Runs before the module's forward, on its first input `x` (defined).
  virtual void pre_forward(const StyleCall& call, torch::nn::Module& module, at::Tensor& x) {}
  /// Runs after the module's forward, on its first output `y` (defined).
  virtual void post_forward(const StyleCall& call, torch::nn::Module& module, at::Tensor& y) {}
  /// Forgets the calls still in flight, those of a forward pass that threw, putting back what
  /// they set aside.
  virtual void drop_calls() {}

  // Note [Checkpoint shape of a split parameter]
  // A state dict holds whole tensors; a process holds its piece of each split parameter (and of
  // its optimizer states). Every style so far cuts a whole tensor into tp_size equal pieces along
  // the split dimension, process i holding the i-th; a style whose pieces differ (a packed
  // projection, say) overrides these three.

  /// Whether a whole tensor of `size` along the split dimension can be cut into `n` pieces.
  virtual bool divides(int64_t size, int n) const { return size % n == 0; }
  /// The piece of process `rank` of `n` of `whole`, cut along `dim` (a view).
  virtual at::Tensor piece_of(const at::Tensor& whole, int64_t dim, int rank, int n) const;
  /// The whole tensor joined along `dim` from every process's piece, in the group's order.
  virtual at::Tensor join(const std::vector<at::Tensor>& pieces, int64_t dim) const;

 private:
  const char* name_;
};

/// Makes an instance of the style it was found for.
using StyleFactory = std::unique_ptr<ParallelStyle> (*)(const char* name);

/// A style found by name in the table.
struct StyleEntry {
  const char* name;
  StyleFactory make;

  /// A new instance of the style.
  std::shared_ptr<ParallelStyle> instance() const { return make(name); }
};

/// The style named `name` (in the plan entry `pattern`); throws `c10::ValueError` naming the known
/// ones.
const StyleEntry& find_style(const std::string& name, const std::string& pattern);

}  // namespace accelerate::detail::tensor_parallel
