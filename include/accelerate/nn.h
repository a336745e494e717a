// Module holders whose call runs the module's hooks, so that a model ports to fully sharded data
// parallelism, tensor parallelism and big-model dispatch by changing declarations, not call sites.
//
// LibTorch's `forward` cannot be intercepted: a member declared `torch::nn::Linear fc;` and called
// `fc(x)` runs `LinearImpl::forward` directly, past any hook that gathers its shard, splits its
// input or loads its offloaded weights. The same member declared `accelerate::nn::Linear fc;` is
// registered and used exactly as before, but `fc(x)` goes through `accelerate::forward(fc, x)`.
// `Hooked<H>` does this for any module holder `H`: a LibTorch layer's or a `TORCH_MODULE` type of
// the program's own.
//
// Example:
//   struct BlockImpl : torch::nn::Module {
//     BlockImpl() : fc1(register_module("fc1", accelerate::nn::Linear(64, 256))),
//                   fc2(register_module("fc2", accelerate::nn::Linear(256, 64))) {}
//     torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(fc1(x))) + x; }
//     accelerate::nn::Linear fc1, fc2;
//   };
#pragma once

#include "accelerate/hooks.h"

#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include <memory>
#include <string>
#include <vector>
#include <utility>

namespace accelerate::nn {

/// A module holder `H` (such as `torch::nn::Linear` or a `TORCH_MODULE` type) whose call runs the
/// module's hook, as `accelerate::forward(holder, args...)` does. It is built like `H`, from `H`
/// or from what `register_module` returns, and is an `H` everywhere else.
template <typename H>
class Hooked : public H {
 public:
  using Impl = typename H::ContainedType;
  using H::H;
  Hooked() = default;
  Hooked(H holder) : H(std::move(holder)) {}  // NOLINT(google-explicit-constructor): a holder converts
  Hooked(const torch::nn::ModuleHolder<Impl>& holder) : H(holder.ptr()) {}  // NOLINT(google-explicit-constructor)

  /// Runs the module's `forward` with its hook (if any) around it.
  template <typename... Args>
  auto operator()(Args&&... args) const {
    return accelerate::forward(*this->ptr(), std::forward<Args>(args)...);
  }
};

/// A module class's own tensor-parallel plan (transformers: a model class's `_tp_plan`): `prepare`
/// uses it when the `TorchTensorParallelConfig` gives none. Derive the module's class from it
/// besides `torch::nn::Module`.
class TensorParallelPlanned {
 public:
  virtual ~TensorParallelPlanned() = default;
  /// Styles by module name, as `TorchTensorParallelConfig::tp_plan`.
  virtual std::vector<std::pair<std::string, std::string>> tp_plan() const = 0;
};

using Linear = Hooked<torch::nn::Linear>;
using Bilinear = Hooked<torch::nn::Bilinear>;
using Embedding = Hooked<torch::nn::Embedding>;
using LayerNorm = Hooked<torch::nn::LayerNorm>;
using GroupNorm = Hooked<torch::nn::GroupNorm>;
using Dropout = Hooked<torch::nn::Dropout>;
using Conv1d = Hooked<torch::nn::Conv1d>;
using Conv2d = Hooked<torch::nn::Conv2d>;

}  // namespace accelerate::nn
