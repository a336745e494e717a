// Stand-in for LibTorch's distributed-autograd context header, used only when the LibTorch
// installation lacks it (see Note [Reducer compatibility header] in CMakeLists.txt).
// c10d/reducer.hpp needs just these two names from it.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>

namespace torch::distributed::autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};

using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace torch::distributed::autograd
