// How a tensor's rows are split over processes, for the engine's shards and the sharded
// checkpoint format alike: dimension 0 in pieces of ceil(rows / world) rows, the last ones
// shorter or empty (as PyTorch's `fully_shard` splits them).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

namespace accelerate::detail::fsdp {

/// The first of the rows (of `rows`) that process `rank` of `world` holds, and how many.
inline std::pair<int64_t, int64_t> rows_held(int64_t rows, int world, int rank) {
  const int64_t each = (rows + world - 1) / world;
  const int64_t first = std::min(rows, rank * each);
  return {first, std::clamp<int64_t>(rows - rank * each, 0, each)};
}

}  // namespace accelerate::detail::fsdp
