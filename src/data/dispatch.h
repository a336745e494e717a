// The batches of a pass as the loader delivers them, each knowing whether it is the last: read
// one ahead from this process's own stream, or dispatched from the main process's (upstream's
// DataLoaderDispatcher; Note [Dispatching] in dispatch.cpp).
#pragma once

#include "data/workers.h"

#include <memory>
#include <optional>

namespace accelerate::detail::data {

struct Step {
  Example batch;
  bool last = false;
  int64_t remainder = -1;  // set by the dispatcher on the last batch
};

class StepSource {
 public:
  virtual ~StepSource() = default;
  virtual std::optional<Step> next() = 0;
};

/// The batches of `stream`, read one ahead to know the last.
std::unique_ptr<StepSource> look_ahead(std::unique_ptr<BatchStream> stream);
/// This process's part of the batches the main process reads from `impl`'s base loader,
/// after `skip` batches.
std::unique_ptr<StepSource> dispatch_from_main(const DataLoaderImpl& impl, int64_t skip);

}  // namespace accelerate::detail::data
