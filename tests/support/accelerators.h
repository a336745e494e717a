// Ranks as threads, each with its own Accelerator over a standalone state.
#pragma once

#include "accelerate/accelerator.h"
#include "support/test_support.h"

#include <functional>

namespace accelerate::testing {

/// Runs `fn(accelerator, rank)` on `n` threads, each with an Accelerator over its own standalone
/// state joined through one in-memory store. Rethrows the first exception of any rank.
inline void run_accelerators(int n, const std::function<void(const Accelerator&, int)>& fn,
                             AcceleratorOptions base = {}) {
  Store store = Store::in_memory();
  run_threads(n, [&](int rank) {
    AcceleratorOptions options = base;
    options.standalone_state = rank_options(options.standalone_state.value_or(PartialStateOptions{}), rank, n, store);
    fn(Accelerator(options), rank);
  });
}

}  // namespace accelerate::testing
