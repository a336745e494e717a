// Local SGD (upstream: accelerate/local_sgd.py): each process trains its own copy of the model
// for a number of optimizer steps without synchronising gradients, then the copies are averaged.
// Upstream's `with LocalSGD(...) as local_sgd:` block becomes `local_sgd(accelerator, model,
// options, fn)`, because leaving it averages the parameters, a collective. Like upstream, this is
// plain data parallelism only: no model parallelism, and buffers are not averaged.
//
// Example:
//   accelerate::local_sgd(accelerator, model, {.local_sgd_steps = 8}, [&](accelerate::LocalSGD& sgd) {
//     for (auto& batch : loader) {
//       accelerator.backward(torch::mse_loss(model(batch.data), batch.target));
//       optimizer.step();
//       optimizer.zero_grad();
//       sgd.step();  // every 8th call averages the parameters over the processes
//     }
//   });
#pragma once

#include "accelerate/accelerator.h"
#include "accelerate/distributed.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

namespace accelerate {

namespace detail {
struct LocalSGDImpl;
}  // namespace detail

/// Settings of `local_sgd` (upstream: the `LocalSGD` constructor's arguments).
struct LocalSGDOptions {
  /// Optimizer steps between two averagings of the parameters; must be at least 1.
  int local_sgd_steps = 0;
  /// Off: `step` only counts, gradients synchronise as usual and nothing is averaged. Local SGD
  /// is also off with a single process.
  bool enabled = true;
};

/// Counts the optimizer steps of a local SGD run and averages the model's parameters over the
/// processes every `local_sgd_steps` of them (upstream: `LocalSGD`). Use it through `local_sgd`,
/// which also keeps the gradients local and averages once more at the end. A cheap handle:
/// copies share the count.
class LocalSGD {
 public:
  /// Local SGD over `model` (a prepared model's engine, `prepared.ddp()`); refuses
  /// `local_sgd_steps` < 1.
  LocalSGD(const Accelerator& accelerator, DistributedDataParallel model, const LocalSGDOptions& options);

  /// Counts one optimizer step; on every `local_sgd_steps`-th one, averages the parameters over
  /// the processes (a collective: every process must step as often).
  void step() const;
  /// Waits for every process, then replaces every parameter with its mean over the processes; a
  /// no-op when disabled.
  void average_parameters() const;

  /// Whether local SGD is on: enabled in the options, and more than one process.
  bool enabled() const;
  /// Steps counted so far.
  int64_t num_steps() const;
  /// Steps between two averagings.
  int local_sgd_steps() const;
  /// The model's engine.
  const DistributedDataParallel& model() const;

 private:
  std::shared_ptr<detail::LocalSGDImpl> impl_;
};

/// Runs `fn(LocalSGD&)` as upstream's `with LocalSGD(...)` block: while it runs, `model`'s
/// backward passes do not synchronise gradients (`no_sync`), and every `local_sgd_steps`-th
/// `step()` averages the parameters; when `fn` returns, the parameters are averaged once more
/// and the result of `fn` is returned. When `fn` throws, the exception propagates without that
/// final averaging (a collective the other processes might never join). When disabled, `fn`
/// just runs with a counting `LocalSGD`.
template <typename M, typename Fn>
auto local_sgd(const Accelerator& accelerator, const PreparedModel<M>& model, const LocalSGDOptions& options,
               Fn&& fn) {
  LocalSGD sgd(accelerator, model.ddp(), options);
  SyncGuard no_sync({model.ddp()}, sgd.enabled() ? std::optional<bool>(false) : std::nullopt);
  if constexpr (std::is_void_v<std::invoke_result_t<Fn, LocalSGD&>>) {
    std::forward<Fn>(fn)(sgd);
    sgd.average_parameters();
  } else {
    auto result = std::forward<Fn>(fn)(sgd);
    sgd.average_parameters();
    return result;
  }
}

}  // namespace accelerate
