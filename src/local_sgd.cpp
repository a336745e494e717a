// Local SGD; see include/accelerate/local_sgd.h.
#include "accelerate/local_sgd.h"

#include "detail/collectives.h"

#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <map>
#include <tuple>
#include <vector>

namespace accelerate {
namespace detail {

struct LocalSGDImpl {
  PartialState state;
  DistributedDataParallel model;
  int local_sgd_steps = 1;
  bool enabled = false;
  int64_t num_steps = 0;
};

}  // namespace detail

LocalSGD::LocalSGD(const Accelerator& accelerator, DistributedDataParallel model, const LocalSGDOptions& options) {
  TORCH_CHECK_VALUE(options.local_sgd_steps >= 1, "[LocalSGD] local_sgd_steps must be at least 1, got ",
                    options.local_sgd_steps);
  impl_ = std::make_shared<detail::LocalSGDImpl>(detail::LocalSGDImpl{
      accelerator.state().partial_state(), std::move(model), options.local_sgd_steps,
      options.enabled && accelerator.use_distributed(), 0});
}

void LocalSGD::step() const {
  impl_->num_steps += 1;
  if (impl_->enabled && impl_->num_steps % impl_->local_sgd_steps == 0) average_parameters();
}

void LocalSGD::average_parameters() const {
  if (!impl_->enabled) return;
  const auto& state = impl_->state;
  state.wait_for_everyone();
  // One allreduce per dtype and device instead of one per parameter.
  std::map<std::tuple<c10::ScalarType, c10::DeviceType, c10::DeviceIndex>, std::vector<at::Tensor>> groups;
  for (const auto& p : impl_->model.module()->parameters(/*recurse=*/true)) {
    groups[{p.scalar_type(), p.device().type(), p.device().index()}].push_back(p);
  }
  torch::NoGradGuard no_grad;
  for (auto& [key, params] : groups) {
    std::vector<at::Tensor> flat;
    flat.reserve(params.size());
    for (const auto& p : params) flat.push_back(p.reshape(-1));
    auto mean = detail::all_reduce(state, at::cat(flat), detail::Reduction::kMean, "LocalSGD");
    int64_t offset = 0;
    for (auto& p : params) {
      p.copy_(mean.narrow(0, offset, p.numel()).view_as(p));
      offset += p.numel();
    }
  }
}

bool LocalSGD::enabled() const { return impl_->enabled; }
int64_t LocalSGD::num_steps() const { return impl_->num_steps; }
int LocalSGD::local_sgd_steps() const { return impl_->local_sgd_steps; }
const DistributedDataParallel& LocalSGD::model() const { return impl_->model; }

}  // namespace accelerate
