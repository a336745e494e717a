// The batches of one pass, loaded in order: on the caller's thread, or ahead of it on
// `num_workers` threads (Note [Ordered prefetching] in workers.cpp).
#pragma once

#include "data/data_loader.h"

#include <functional>
#include <memory>
#include <optional>

namespace accelerate::detail::data {

using Task = std::function<Example()>;
using TaskSource = std::function<std::optional<Task>()>;

// Which batches of a pass are loaded: the first `keep`, then `skip` are passed over without
// loading, then all the others.
struct SkipPlan {
  int64_t keep = 0;
  int64_t skip = 0;
};

/// The batches of one pass, in order.
class BatchStream {
 public:
  virtual ~BatchStream() = default;
  /// The next batch; nothing once the pass is over. Rethrows a batch's loading error in its place.
  virtual std::optional<Example> next() = 0;
};

/// The batches of a pass of `impl` (its sampler's or its iterable dataset's), skipping as `plan` says.
std::unique_ptr<BatchStream> open_stream(const DataLoaderImpl& impl, SkipPlan plan);

}  // namespace accelerate::detail::data
