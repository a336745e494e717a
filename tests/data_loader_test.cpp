// Data loading (data_loader.h): index-exact sharding against upstream's oracles, iterable
// shards, collate, worker threads, GradientState integration, shuffling across ranks,
// dispatching, skipping and mid-epoch resume. Multi-rank cases run ranks as threads.
#include "accelerate/data_loader.h"

#include "accelerate/utils/operations.h"
#include "support/test_support.h"

#include "detail/collectives.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/data/datasets/base.h>
#include <torch/data/datasets/tensor.h>
#include <torch/utils.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace accelerate::testing {
namespace data_loader_test {  // not anonymous: its names must not meet another file's in a unity batch

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Batches = std::vector<std::vector<int64_t>>;

std::shared_ptr<BatchSampler> range_batches(int64_t n, int64_t batch_size, bool drop_last) {
  return std::make_shared<BatchSampler>(std::make_shared<SequentialSampler>(n), batch_size, drop_last);
}

Batches collect(IndexBatchGenerator next) {
  Batches out;
  while (auto batch = next()) out.push_back(*batch);
  return out;
}

Batches collect(BatchSampler& sampler) { return collect(sampler.iter()); }

std::vector<int64_t> values(const at::Tensor& t) {
  const auto c = t.to(at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// Upstream's `range(n)`: sample i is the 0-dim tensor i.
std::shared_ptr<Dataset> range_dataset(int64_t n) { return std::make_shared<TensorDataset>(at::arange(n)); }

Batches batches_of(const DataLoader& loader) {
  Batches out;
  for (auto& batch : loader) out.push_back(values(batch.data));
  return out;
}

std::vector<int64_t> flat(const Batches& batches) {
  std::vector<int64_t> out;
  for (const auto& b : batches) out.insert(out.end(), b.begin(), b.end());
  return out;
}

std::vector<int64_t> iota(int64_t n, int64_t from = 0) {
  std::vector<int64_t> out(static_cast<size_t>(n));
  std::iota(out.begin(), out.end(), from);
  return out;
}

// An iterable dataset of the 0-dim tensors 0..n-1.
std::shared_ptr<IterableDataset> range_stream(int64_t n, bool sized = true) {
  return make_iterable_dataset(
      [n]() -> ExampleGenerator {
        return [n, i = int64_t{0}]() mutable -> std::optional<Example> {
          if (i >= n) return std::nullopt;
          return Example{at::scalar_tensor(i++, at::kLong)};
        };
      },
      sized ? std::optional<int64_t>(n) : std::nullopt);
}

// ---- BatchSamplerShard: upstream's tables, and the same oracle at 1, 3 and 4 processes ----------

struct ShardCase {
  int64_t n;
  int64_t batch_size;
  bool drop_last;
  int num_processes;
  bool split_batches;
  bool even_batches;
  std::vector<Batches> expected;  // per process
  std::vector<int64_t> sizes;     // upstream's len() per process
};

// Generated from upstream's BatchSamplerShard over BatchSampler(range(n), batch_size, drop_last);
// the 2-process rows are upstream's own test tables.
// clang-format off
const ShardCase kShardCases[] = {
    {24, 3, false, 2, false, true, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 22, 23}}}, {4, 4}},
    {24, 3, true, 2, false, true, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 22, 23}}}, {4, 4}},
    {21, 3, false, 2, false, true, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {0, 1, 2}}}, {4, 4}},
    {21, 3, true, 2, false, true, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}}, {3, 3}},
    {22, 3, false, 2, false, true, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 0, 1}}}, {4, 4}},
    {22, 3, true, 2, false, true, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}}, {3, 3}},
    {20, 3, false, 2, false, true, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 0}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {1, 2, 3}}}, {4, 4}},
    {20, 3, true, 2, false, true, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}}, {3, 3}},
    {2, 3, false, 2, false, true, {{{0, 1, 0}}, {{1, 0, 1}}}, {1, 1}},
    {2, 3, true, 2, false, true, {{}, {}}, {0, 0}},
    {24, 3, false, 2, false, false, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 22, 23}}}, {4, 4}},
    {24, 3, true, 2, false, false, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 22, 23}}}, {4, 4}},
    {21, 3, false, 2, false, false, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}}, {4, 3}},
    {21, 3, true, 2, false, false, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}}, {3, 3}},
    {22, 3, false, 2, false, false, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21}}}, {4, 4}},
    {22, 3, true, 2, false, false, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}}, {3, 3}},
    {20, 3, false, 2, false, false, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}}, {4, 3}},
    {20, 3, true, 2, false, false, {{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}}, {{3, 4, 5}, {9, 10, 11}, {15, 16, 17}}}, {3, 3}},
    {2, 3, false, 2, false, false, {{{0, 1}}, {}}, {1, 0}},
    {2, 3, true, 2, false, false, {{}, {}}, {0, 0}},
    {24, 4, false, 2, true, true, {{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}}, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {22, 23}}}, {6, 6}},
    {24, 4, true, 2, true, true, {{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}}, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {22, 23}}}, {6, 6}},
    {22, 4, false, 2, true, true, {{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}}, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {0, 1}}}, {6, 6}},
    {22, 4, true, 2, true, true, {{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}}, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}}}, {5, 5}},
    {21, 4, false, 2, true, true, {{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 0}}, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {1, 2}}}, {6, 6}},
    {21, 4, true, 2, true, true, {{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}}, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}}}, {5, 5}},
    {2, 4, false, 2, true, true, {{{0, 1}}, {{0, 1}}}, {1, 1}},
    {2, 4, true, 2, true, true, {{}, {}}, {0, 0}},
    {24, 4, false, 2, true, false, {{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}}, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {22, 23}}}, {6, 6}},
    {24, 4, true, 2, true, false, {{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}}, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}, {22, 23}}}, {6, 6}},
    {22, 4, false, 2, true, false, {{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20, 21}}, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}}}, {6, 6}},
    {22, 4, true, 2, true, false, {{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}}, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}}}, {5, 5}},
    {21, 4, false, 2, true, false, {{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}, {20}}, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}}}, {6, 6}},
    {21, 4, true, 2, true, false, {{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16, 17}}, {{2, 3}, {6, 7}, {10, 11}, {14, 15}, {18, 19}}}, {5, 5}},
    {2, 4, false, 2, true, false, {{{0, 1}}, {}}, {1, 1}},
    {2, 4, true, 2, true, false, {{}, {}}, {0, 0}},
    {27, 3, false, 3, false, true, {{{0, 1, 2}, {9, 10, 11}, {18, 19, 20}}, {{3, 4, 5}, {12, 13, 14}, {21, 22, 23}}, {{6, 7, 8}, {15, 16, 17}, {24, 25, 26}}}, {3, 3, 3}},
    {27, 3, true, 3, false, true, {{{0, 1, 2}, {9, 10, 11}, {18, 19, 20}}, {{3, 4, 5}, {12, 13, 14}, {21, 22, 23}}, {{6, 7, 8}, {15, 16, 17}, {24, 25, 26}}}, {3, 3, 3}},
    {24, 3, false, 3, false, true, {{{0, 1, 2}, {9, 10, 11}, {18, 19, 20}}, {{3, 4, 5}, {12, 13, 14}, {21, 22, 23}}, {{6, 7, 8}, {15, 16, 17}, {0, 1, 2}}}, {3, 3, 3}},
    {24, 3, true, 3, false, true, {{{0, 1, 2}, {9, 10, 11}}, {{3, 4, 5}, {12, 13, 14}}, {{6, 7, 8}, {15, 16, 17}}}, {2, 2, 2}},
    {25, 3, false, 3, false, true, {{{0, 1, 2}, {9, 10, 11}, {18, 19, 20}}, {{3, 4, 5}, {12, 13, 14}, {21, 22, 23}}, {{6, 7, 8}, {15, 16, 17}, {24, 0, 1}}}, {3, 3, 3}},
    {25, 3, true, 3, false, true, {{{0, 1, 2}, {9, 10, 11}}, {{3, 4, 5}, {12, 13, 14}}, {{6, 7, 8}, {15, 16, 17}}}, {2, 2, 2}},
    {4, 3, false, 3, false, true, {{{0, 1, 2}}, {{3, 0, 1}}, {{2, 3, 0}}}, {1, 1, 1}},
    {4, 3, true, 3, false, true, {{}, {}, {}}, {0, 0, 0}},
    {2, 3, false, 3, false, true, {{{0, 1, 0}}, {{1, 0, 1}}, {{0, 1, 0}}}, {1, 1, 1}},
    {2, 3, true, 3, false, true, {{}, {}, {}}, {0, 0, 0}},
    {27, 3, false, 3, false, false, {{{0, 1, 2}, {9, 10, 11}, {18, 19, 20}}, {{3, 4, 5}, {12, 13, 14}, {21, 22, 23}}, {{6, 7, 8}, {15, 16, 17}, {24, 25, 26}}}, {3, 3, 3}},
    {27, 3, true, 3, false, false, {{{0, 1, 2}, {9, 10, 11}, {18, 19, 20}}, {{3, 4, 5}, {12, 13, 14}, {21, 22, 23}}, {{6, 7, 8}, {15, 16, 17}, {24, 25, 26}}}, {3, 3, 3}},
    {24, 3, false, 3, false, false, {{{0, 1, 2}, {9, 10, 11}, {18, 19, 20}}, {{3, 4, 5}, {12, 13, 14}, {21, 22, 23}}, {{6, 7, 8}, {15, 16, 17}}}, {3, 3, 2}},
    {24, 3, true, 3, false, false, {{{0, 1, 2}, {9, 10, 11}}, {{3, 4, 5}, {12, 13, 14}}, {{6, 7, 8}, {15, 16, 17}}}, {2, 2, 2}},
    {25, 3, false, 3, false, false, {{{0, 1, 2}, {9, 10, 11}, {18, 19, 20}}, {{3, 4, 5}, {12, 13, 14}, {21, 22, 23}}, {{6, 7, 8}, {15, 16, 17}, {24}}}, {3, 3, 3}},
    {25, 3, true, 3, false, false, {{{0, 1, 2}, {9, 10, 11}}, {{3, 4, 5}, {12, 13, 14}}, {{6, 7, 8}, {15, 16, 17}}}, {2, 2, 2}},
    {4, 3, false, 3, false, false, {{{0, 1, 2}}, {{3}}, {}}, {1, 1, 0}},
    {4, 3, true, 3, false, false, {{}, {}, {}}, {0, 0, 0}},
    {2, 3, false, 3, false, false, {{{0, 1}}, {}, {}}, {1, 0, 0}},
    {2, 3, true, 3, false, false, {{}, {}, {}}, {0, 0, 0}},
    {24, 6, false, 3, true, true, {{{0, 1}, {6, 7}, {12, 13}, {18, 19}}, {{2, 3}, {8, 9}, {14, 15}, {20, 21}}, {{4, 5}, {10, 11}, {16, 17}, {22, 23}}}, {4, 4, 4}},
    {24, 6, true, 3, true, true, {{{0, 1}, {6, 7}, {12, 13}, {18, 19}}, {{2, 3}, {8, 9}, {14, 15}, {20, 21}}, {{4, 5}, {10, 11}, {16, 17}, {22, 23}}}, {4, 4, 4}},
    {22, 6, false, 3, true, true, {{{0, 1}, {6, 7}, {12, 13}, {18, 19}}, {{2, 3}, {8, 9}, {14, 15}, {20, 21}}, {{4, 5}, {10, 11}, {16, 17}, {0, 1}}}, {4, 4, 4}},
    {22, 6, true, 3, true, true, {{{0, 1}, {6, 7}, {12, 13}}, {{2, 3}, {8, 9}, {14, 15}}, {{4, 5}, {10, 11}, {16, 17}}}, {3, 3, 3}},
    {21, 6, false, 3, true, true, {{{0, 1}, {6, 7}, {12, 13}, {18, 19}}, {{2, 3}, {8, 9}, {14, 15}, {20, 0}}, {{4, 5}, {10, 11}, {16, 17}, {1, 2}}}, {4, 4, 4}},
    {21, 6, true, 3, true, true, {{{0, 1}, {6, 7}, {12, 13}}, {{2, 3}, {8, 9}, {14, 15}}, {{4, 5}, {10, 11}, {16, 17}}}, {3, 3, 3}},
    {4, 6, false, 3, true, true, {{{0, 1}}, {{2, 3}}, {{0, 1}}}, {1, 1, 1}},
    {4, 6, true, 3, true, true, {{}, {}, {}}, {0, 0, 0}},
    {24, 6, false, 3, true, false, {{{0, 1}, {6, 7}, {12, 13}, {18, 19}}, {{2, 3}, {8, 9}, {14, 15}, {20, 21}}, {{4, 5}, {10, 11}, {16, 17}, {22, 23}}}, {4, 4, 4}},
    {24, 6, true, 3, true, false, {{{0, 1}, {6, 7}, {12, 13}, {18, 19}}, {{2, 3}, {8, 9}, {14, 15}, {20, 21}}, {{4, 5}, {10, 11}, {16, 17}, {22, 23}}}, {4, 4, 4}},
    {22, 6, false, 3, true, false, {{{0, 1}, {6, 7}, {12, 13}, {18, 19}}, {{2, 3}, {8, 9}, {14, 15}, {20, 21}}, {{4, 5}, {10, 11}, {16, 17}}}, {4, 4, 4}},
    {22, 6, true, 3, true, false, {{{0, 1}, {6, 7}, {12, 13}}, {{2, 3}, {8, 9}, {14, 15}}, {{4, 5}, {10, 11}, {16, 17}}}, {3, 3, 3}},
    {21, 6, false, 3, true, false, {{{0, 1}, {6, 7}, {12, 13}, {18, 19}}, {{2, 3}, {8, 9}, {14, 15}, {20}}, {{4, 5}, {10, 11}, {16, 17}}}, {4, 4, 4}},
    {21, 6, true, 3, true, false, {{{0, 1}, {6, 7}, {12, 13}}, {{2, 3}, {8, 9}, {14, 15}}, {{4, 5}, {10, 11}, {16, 17}}}, {3, 3, 3}},
    {4, 6, false, 3, true, false, {{{0, 1}}, {{2, 3}}, {}}, {1, 1, 1}},
    {4, 6, true, 3, true, false, {{}, {}, {}}, {0, 0, 0}},
    {24, 3, false, 4, false, true, {{{0, 1, 2}, {12, 13, 14}}, {{3, 4, 5}, {15, 16, 17}}, {{6, 7, 8}, {18, 19, 20}}, {{9, 10, 11}, {21, 22, 23}}}, {2, 2, 2, 2}},
    {24, 3, true, 4, false, true, {{{0, 1, 2}, {12, 13, 14}}, {{3, 4, 5}, {15, 16, 17}}, {{6, 7, 8}, {18, 19, 20}}, {{9, 10, 11}, {21, 22, 23}}}, {2, 2, 2, 2}},
    {21, 3, false, 4, false, true, {{{0, 1, 2}, {12, 13, 14}}, {{3, 4, 5}, {15, 16, 17}}, {{6, 7, 8}, {18, 19, 20}}, {{9, 10, 11}, {0, 1, 2}}}, {2, 2, 2, 2}},
    {21, 3, true, 4, false, true, {{{0, 1, 2}}, {{3, 4, 5}}, {{6, 7, 8}}, {{9, 10, 11}}}, {1, 1, 1, 1}},
    {22, 3, false, 4, false, true, {{{0, 1, 2}, {12, 13, 14}}, {{3, 4, 5}, {15, 16, 17}}, {{6, 7, 8}, {18, 19, 20}}, {{9, 10, 11}, {21, 0, 1}}}, {2, 2, 2, 2}},
    {22, 3, true, 4, false, true, {{{0, 1, 2}}, {{3, 4, 5}}, {{6, 7, 8}}, {{9, 10, 11}}}, {1, 1, 1, 1}},
    {5, 3, false, 4, false, true, {{{0, 1, 2}}, {{3, 4, 0}}, {{1, 2, 3}}, {{4, 0, 1}}}, {1, 1, 1, 1}},
    {5, 3, true, 4, false, true, {{}, {}, {}, {}}, {0, 0, 0, 0}},
    {24, 3, false, 4, false, false, {{{0, 1, 2}, {12, 13, 14}}, {{3, 4, 5}, {15, 16, 17}}, {{6, 7, 8}, {18, 19, 20}}, {{9, 10, 11}, {21, 22, 23}}}, {2, 2, 2, 2}},
    {24, 3, true, 4, false, false, {{{0, 1, 2}, {12, 13, 14}}, {{3, 4, 5}, {15, 16, 17}}, {{6, 7, 8}, {18, 19, 20}}, {{9, 10, 11}, {21, 22, 23}}}, {2, 2, 2, 2}},
    {21, 3, false, 4, false, false, {{{0, 1, 2}, {12, 13, 14}}, {{3, 4, 5}, {15, 16, 17}}, {{6, 7, 8}, {18, 19, 20}}, {{9, 10, 11}}}, {2, 2, 2, 1}},
    {21, 3, true, 4, false, false, {{{0, 1, 2}}, {{3, 4, 5}}, {{6, 7, 8}}, {{9, 10, 11}}}, {1, 1, 1, 1}},
    {22, 3, false, 4, false, false, {{{0, 1, 2}, {12, 13, 14}}, {{3, 4, 5}, {15, 16, 17}}, {{6, 7, 8}, {18, 19, 20}}, {{9, 10, 11}, {21}}}, {2, 2, 2, 2}},
    {22, 3, true, 4, false, false, {{{0, 1, 2}}, {{3, 4, 5}}, {{6, 7, 8}}, {{9, 10, 11}}}, {1, 1, 1, 1}},
    {5, 3, false, 4, false, false, {{{0, 1, 2}}, {{3, 4}}, {}, {}}, {1, 1, 0, 0}},
    {5, 3, true, 4, false, false, {{}, {}, {}, {}}, {0, 0, 0, 0}},
    {32, 8, false, 4, true, true, {{{0, 1}, {8, 9}, {16, 17}, {24, 25}}, {{2, 3}, {10, 11}, {18, 19}, {26, 27}}, {{4, 5}, {12, 13}, {20, 21}, {28, 29}}, {{6, 7}, {14, 15}, {22, 23}, {30, 31}}}, {4, 4, 4, 4}},
    {32, 8, true, 4, true, true, {{{0, 1}, {8, 9}, {16, 17}, {24, 25}}, {{2, 3}, {10, 11}, {18, 19}, {26, 27}}, {{4, 5}, {12, 13}, {20, 21}, {28, 29}}, {{6, 7}, {14, 15}, {22, 23}, {30, 31}}}, {4, 4, 4, 4}},
    {30, 8, false, 4, true, true, {{{0, 1}, {8, 9}, {16, 17}, {24, 25}}, {{2, 3}, {10, 11}, {18, 19}, {26, 27}}, {{4, 5}, {12, 13}, {20, 21}, {28, 29}}, {{6, 7}, {14, 15}, {22, 23}, {0, 1}}}, {4, 4, 4, 4}},
    {30, 8, true, 4, true, true, {{{0, 1}, {8, 9}, {16, 17}}, {{2, 3}, {10, 11}, {18, 19}}, {{4, 5}, {12, 13}, {20, 21}}, {{6, 7}, {14, 15}, {22, 23}}}, {3, 3, 3, 3}},
    {3, 8, false, 4, true, true, {{{0, 1}}, {{2, 0}}, {{1, 2}}, {{0, 1}}}, {1, 1, 1, 1}},
    {3, 8, true, 4, true, true, {{}, {}, {}, {}}, {0, 0, 0, 0}},
    {32, 8, false, 4, true, false, {{{0, 1}, {8, 9}, {16, 17}, {24, 25}}, {{2, 3}, {10, 11}, {18, 19}, {26, 27}}, {{4, 5}, {12, 13}, {20, 21}, {28, 29}}, {{6, 7}, {14, 15}, {22, 23}, {30, 31}}}, {4, 4, 4, 4}},
    {32, 8, true, 4, true, false, {{{0, 1}, {8, 9}, {16, 17}, {24, 25}}, {{2, 3}, {10, 11}, {18, 19}, {26, 27}}, {{4, 5}, {12, 13}, {20, 21}, {28, 29}}, {{6, 7}, {14, 15}, {22, 23}, {30, 31}}}, {4, 4, 4, 4}},
    {30, 8, false, 4, true, false, {{{0, 1}, {8, 9}, {16, 17}, {24, 25}}, {{2, 3}, {10, 11}, {18, 19}, {26, 27}}, {{4, 5}, {12, 13}, {20, 21}, {28, 29}}, {{6, 7}, {14, 15}, {22, 23}}}, {4, 4, 4, 4}},
    {30, 8, true, 4, true, false, {{{0, 1}, {8, 9}, {16, 17}}, {{2, 3}, {10, 11}, {18, 19}}, {{4, 5}, {12, 13}, {20, 21}}, {{6, 7}, {14, 15}, {22, 23}}}, {3, 3, 3, 3}},
    {3, 8, false, 4, true, false, {{{0, 1}}, {{2}}, {}, {}}, {1, 1, 1, 1}},
    {3, 8, true, 4, true, false, {{}, {}, {}, {}}, {0, 0, 0, 0}},
    {7, 3, false, 1, false, true, {{{0, 1, 2}, {3, 4, 5}, {6, 0, 1}}}, {3}},
    {7, 3, true, 1, false, true, {{{0, 1, 2}, {3, 4, 5}}}, {2}},
    {7, 3, false, 1, false, false, {{{0, 1, 2}, {3, 4, 5}, {6}}}, {3}},
    {7, 3, true, 1, false, false, {{{0, 1, 2}, {3, 4, 5}}}, {2}},
    {7, 4, false, 1, true, true, {{{0, 1, 2, 3}, {4, 5, 6, 0}}}, {2}},
    {7, 4, true, 1, true, true, {{{0, 1, 2, 3}}}, {1}},
    {7, 4, false, 1, true, false, {{{0, 1, 2, 3}, {4, 5, 6}}}, {2}},
    {7, 4, true, 1, true, false, {{{0, 1, 2, 3}}}, {1}},
};
// clang-format on

void PrintTo(const ShardCase& c, std::ostream* os) {
  *os << "range(" << c.n << ") batch_size " << c.batch_size << (c.drop_last ? " drop_last" : "") << " over "
      << c.num_processes << " processes" << (c.split_batches ? " split" : "") << (c.even_batches ? " even" : "");
}

std::string shard_case_name(const ::testing::TestParamInfo<ShardCase>& info) {
  const auto& c = info.param;
  return "n" + std::to_string(c.n) + "_bs" + std::to_string(c.batch_size) + (c.drop_last ? "_droplast" : "_keeplast") +
         "_" + std::to_string(c.num_processes) + "proc" + (c.split_batches ? "_split" : "_nosplit") +
         (c.even_batches ? "_even" : "_uneven");
}

class BatchSamplerShardTable : public ::testing::TestWithParam<ShardCase> {};

TEST_P(BatchSamplerShardTable, EveryProcessGetsUpstreamsBatchesAndLength) {
  const auto& c = GetParam();
  for (int p = 0; p < c.num_processes; ++p) {
    BatchSamplerShard shard(range_batches(c.n, c.batch_size, c.drop_last), c.num_processes, p,
                            {.split_batches = c.split_batches, .even_batches = c.even_batches});
    EXPECT_EQ(collect(shard), c.expected[static_cast<size_t>(p)]) << "process " << p;
    EXPECT_EQ(shard.size(), c.sizes[static_cast<size_t>(p)]) << "process " << p;
    // A second pass gives the same batches.
    EXPECT_EQ(collect(shard), c.expected[static_cast<size_t>(p)]) << "process " << p << ", second pass";
  }
}

INSTANTIATE_TEST_SUITE_P(Upstream, BatchSamplerShardTable, ::testing::ValuesIn(kShardCases), shard_case_name);

TEST(BatchSamplerShard, TheIssueExamplesHoldAtTwoProcesses) {
  auto shards = [](int64_t n) {
    return std::vector<Batches>{collect(*std::make_shared<BatchSamplerShard>(range_batches(n, 3, false), 2, 0)),
                                collect(*std::make_shared<BatchSamplerShard>(range_batches(n, 3, false), 2, 1))};
  };
  auto s24 = shards(24);
  EXPECT_EQ(s24[0], (Batches{{0, 1, 2}, {6, 7, 8}, {12, 13, 14}, {18, 19, 20}}));
  EXPECT_EQ(s24[1], (Batches{{3, 4, 5}, {9, 10, 11}, {15, 16, 17}, {21, 22, 23}}));
  EXPECT_EQ(shards(21)[1].back(), (std::vector<int64_t>{0, 1, 2}));
  auto s20 = shards(20);
  EXPECT_EQ(s20[0].back(), (std::vector<int64_t>{18, 19, 0}));
  EXPECT_EQ(s20[1].back(), (std::vector<int64_t>{1, 2, 3}));
}

TEST(BatchSamplerShard, VaryingBatchSizesWithoutEvenBatchesGiveProcessesDifferentCounts) {
  auto batches = std::make_shared<ListBatchSampler>(Batches{{0, 1, 2}, {3, 4}, {5, 6, 7, 8}, {9, 10, 11}, {12, 13}});
  BatchSamplerShard p0(batches, 2, 0, {.even_batches = false});
  BatchSamplerShard p1(batches, 2, 1, {.even_batches = false});
  EXPECT_EQ(p0.size(), 3);
  EXPECT_EQ(p1.size(), 2);
  EXPECT_EQ(collect(p0), (Batches{{0, 1, 2}, {5, 6, 7, 8}, {12, 13}}));
  EXPECT_EQ(collect(p1), (Batches{{3, 4}, {9, 10, 11}}));
}

TEST(BatchSamplerShard, VaryingBatchSizesWithEvenBatchesReuseTheFirstBatches) {
  auto shard = [](Batches batches, int n, int p, bool drop_last = false) {
    BatchSamplerShard s(std::make_shared<ListBatchSampler>(std::move(batches), drop_last), n, p);
    return collect(s);
  };
  const Batches four = {{0, 1, 2}, {3, 4}, {5, 6, 7, 8}, {9, 10, 11}};
  EXPECT_EQ(shard(four, 2, 0), (Batches{{0, 1, 2}, {5, 6, 7, 8}}));
  EXPECT_EQ(shard(four, 2, 1), (Batches{{3, 4}, {9, 10, 11}}));
  const Batches five = {{0, 1, 2}, {3, 4}, {5, 6, 7, 8}, {9, 10, 11}, {12, 13}};
  EXPECT_EQ(shard(five, 2, 0), (Batches{{0, 1, 2}, {5, 6, 7, 8}, {12, 13}}));
  EXPECT_EQ(shard(five, 2, 1), (Batches{{3, 4}, {9, 10, 11}, {0, 1, 2}}));
  // Fewer batches than processes: the first batch is repeated.
  EXPECT_EQ(shard({{0, 1, 2}}, 2, 1), (Batches{{0, 1, 2}}));
  for (int p = 0; p < 3; ++p) EXPECT_EQ(shard({{0, 1, 2}}, 3, p), (Batches{{0, 1, 2}})) << p;
  // drop_last leaves out the incomplete last round.
  EXPECT_EQ(shard(five, 2, 0, /*drop_last=*/true), (Batches{{0, 1, 2}, {5, 6, 7, 8}}));
  EXPECT_EQ(shard(five, 2, 1, /*drop_last=*/true), (Batches{{3, 4}, {9, 10, 11}}));
}

TEST(BatchSamplerShard, VaryingBatchSizesAtThreeProcesses) {
  auto shard = [](Batches batches, int p) {
    BatchSamplerShard s(std::make_shared<ListBatchSampler>(std::move(batches)), 3, p);
    return collect(s);
  };
  const Batches six = {{0}, {1, 2}, {3, 4, 5}, {6}, {7, 8}, {9, 10, 11}};
  EXPECT_EQ(shard(six, 0), (Batches{{0}, {6}}));
  EXPECT_EQ(shard(six, 1), (Batches{{1, 2}, {7, 8}}));
  EXPECT_EQ(shard(six, 2), (Batches{{3, 4, 5}, {9, 10, 11}}));
  const Batches seven = {{0}, {1, 2}, {3, 4, 5}, {6}, {7, 8}, {9, 10, 11}, {12, 13}};
  EXPECT_EQ(shard(seven, 0), (Batches{{0}, {6}, {12, 13}}));
  EXPECT_EQ(shard(seven, 1), (Batches{{1, 2}, {7, 8}, {0}}));
  EXPECT_EQ(shard(seven, 2), (Batches{{3, 4, 5}, {9, 10, 11}, {1, 2}}));
}

TEST(BatchSamplerShard, SplitBatchesRefusesVaryingBatchSizes) {
  auto batches = std::make_shared<ListBatchSampler>(Batches{{0, 1, 2, 3}, {4, 5, 6, 7}});
  EXPECT_THROWS_WITH(BatchSamplerShard(batches, 2, 0, {.split_batches = true}), "split_batches");
  EXPECT_THROWS_WITH(BatchSamplerShard(batches, 2, 0, {.split_batches = true}), "varying batch sizes");
}

TEST(BatchSamplerShard, SplitBatchesRefusesABatchSizeThatDoesNotDivide) {
  EXPECT_THROWS_WITH(BatchSamplerShard(range_batches(20, 3, false), 2, 0, {.split_batches = true}),
                     "split_batches needs a batch size that is a round multiple of the number of processes (2), got 3");
}

TEST(BatchSamplerShard, ProcessTopologyIsChecked) {
  EXPECT_THROWS_WITH(BatchSamplerShard(range_batches(8, 2, false), 0, 0), "num_processes must be >= 1, got 0");
  EXPECT_THROWS_WITH(BatchSamplerShard(range_batches(8, 2, false), 2, 2), "process_index must be in [0, 2), got 2");
  EXPECT_THROWS_WITH(BatchSamplerShard(nullptr, 2, 0), "expected a batch sampler, got null");
}

// ---- samplers ------------------------------------------------------------------------------------

TEST(BatchSampler, GroupsIndicesAndDropsAShortLastBatchOnRequest) {
  EXPECT_EQ(collect(*range_batches(7, 3, false)), (Batches{{0, 1, 2}, {3, 4, 5}, {6}}));
  EXPECT_EQ(collect(*range_batches(7, 3, true)), (Batches{{0, 1, 2}, {3, 4, 5}}));
  EXPECT_EQ(range_batches(7, 3, false)->size(), 3);
  EXPECT_EQ(range_batches(7, 3, true)->size(), 2);
  EXPECT_EQ(collect(*range_batches(0, 3, false)), Batches{});
}

TEST(BatchSampler, ASubclassWithoutASamplerMustProduceItsOwnBatches) {
  struct Incomplete final : BatchSampler {
    Incomplete() : BatchSampler(std::nullopt, false) {}
  };
  Incomplete incomplete;
  EXPECT_THROWS_WITH(incomplete.size(), "a batch sampler without a sampler must override size()");
  EXPECT_THROWS_WITH(incomplete.iter(), "a batch sampler without a sampler must override iter()");
  EXPECT_FALSE(incomplete.generator().has_value());
}

TEST(BatchSampler, RefusesABatchSizeOfZero) {
  EXPECT_THROWS_WITH(range_batches(8, 0, false), "[BatchSampler] batch_size must be a positive integer, got 0");
  EXPECT_THROWS_WITH(BatchSampler(nullptr, 2, false), "[BatchSampler] expected a sampler, got null");
}

TEST(SkipBatchSampler, SkipsTheFirstBatches) {
  SkipBatchSampler skip(range_batches(16, 4, false), 2);
  EXPECT_EQ(collect(skip), (Batches{{8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(skip.size(), 2);
  EXPECT_EQ(skip.total_length(), 4);
  EXPECT_EQ(SkipBatchSampler(range_batches(16, 4, false), 9).size(), 0);
  EXPECT_THROWS_WITH(SkipBatchSampler(range_batches(16, 4, false), -1), "skip_batches must be >= 0, got -1");
  EXPECT_THROWS_WITH(SkipBatchSampler(nullptr, 1), "[SkipBatchSampler] expected a batch sampler, got null");
}

TEST(RandomSampler, IsAPermutationDrawnFromItsGenerator) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  RandomSampler sampler(10, {.generator = gen});
  std::vector<int64_t> first;
  auto next = sampler.iter();
  while (auto i = next()) first.push_back(*i);
  auto sorted = first;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, iota(10));
  // PyTorch's draw for the same seed: torch.randperm(10, generator=torch.Generator().manual_seed(7)).
  EXPECT_EQ(first, values(at::randperm(10, at::make_generator<at::CPUGeneratorImpl>(7), at::kLong)));
  // The generator moved on: the next pass is another permutation.
  std::vector<int64_t> second;
  next = sampler.iter();
  while (auto i = next()) second.push_back(*i);
  EXPECT_NE(first, second);
}

TEST(RandomSampler, DrawsWithReplacementAndAnyNumberOfSamples) {
  RandomSampler with(
      4, {.replacement = true, .num_samples = 50, .generator = at::make_generator<at::CPUGeneratorImpl>(1)});
  EXPECT_EQ(with.size(), 50);
  int64_t count = 0;
  auto next = with.iter();
  while (auto i = next()) {
    EXPECT_GE(*i, 0);
    EXPECT_LT(*i, 4);
    ++count;
  }
  EXPECT_EQ(count, 50);
  RandomSampler more(3, {.num_samples = 7, .generator = at::make_generator<at::CPUGeneratorImpl>(1)});
  std::multiset<int64_t> seen;
  next = more.iter();
  while (auto i = next()) seen.insert(*i);
  EXPECT_EQ(seen.size(), 7u);
  EXPECT_EQ(seen.count(0) + seen.count(1) + seen.count(2), 7u);
  EXPECT_GE(seen.count(0), 2u);  // two whole permutations, then one more index
}

TEST(RandomSampler, RefusesImpossibleSettings) {
  EXPECT_THROWS_WITH(RandomSampler(-1), "data_size must be >= 0, got -1");
  EXPECT_THROWS_WITH(RandomSampler(4, {.num_samples = -2}), "num_samples must be >= 0, got -2");
  EXPECT_THROWS_WITH(RandomSampler(0, {.num_samples = 3}), "cannot draw 3 samples from an empty dataset");
  EXPECT_THROWS_WITH(RandomSampler(4, {.generator = at::Generator()}), "expected a generator, got an undefined one");
  EXPECT_THROWS_WITH(SequentialSampler(-3), "[SequentialSampler] size must be >= 0, got -3");
}

std::vector<int64_t> one_pass(Sampler& sampler) {
  std::vector<int64_t> out;
  auto next = sampler.iter();
  while (auto i = next()) out.push_back(*i);
  return out;
}

TEST(SeedableRandomSampler, TheOrderIsSeedPlusEpochAndTheEpochAdvancesAfterAPass) {
  SeedableRandomSampler a(12, {}, 42);
  SeedableRandomSampler b(12, {}, 42);
  SeedableRandomSampler other(12, {}, 43);
  const auto a0 = one_pass(a);
  EXPECT_EQ(a.epoch(), 1);
  EXPECT_EQ(a0, one_pass(b));
  EXPECT_NE(a0, one_pass(other));
  EXPECT_EQ(a0, values(at::randperm(12, at::make_generator<at::CPUGeneratorImpl>(42), at::kLong)));
  const auto a1 = one_pass(a);
  EXPECT_NE(a0, a1);
  EXPECT_EQ(a1, values(at::randperm(12, at::make_generator<at::CPUGeneratorImpl>(43), at::kLong)));
  a.set_epoch(0);
  EXPECT_EQ(one_pass(a), a0);
}

TEST(SeedableRandomSampler, DefaultsToTheInitialSeedOfTheDefaultGenerator) {
  torch::manual_seed(1234);
  SeedableRandomSampler sampler(5);
  EXPECT_EQ(sampler.initial_seed(), 1234u);
}

// ---- IterableDatasetShard ------------------------------------------------------------------------

struct StreamCase {
  int64_t n;
  int64_t batch_size;
  bool drop_last;
  int num_processes;
  bool split_batches;
  std::vector<std::vector<int64_t>> expected;  // samples per process
};

// Generated from upstream's IterableDatasetShard over a stream of 0..n-1.
// clang-format off
const StreamCase kStreamCases[] = {
    {0, 4, false, 2, false, {{}, {}}},
    {0, 4, true, 2, false, {{}, {}}},
    {2, 4, false, 2, false, {{0, 1, 0, 1}, {0, 1, 0, 1}}},
    {2, 4, true, 2, false, {{}, {}}},
    {7, 4, false, 2, false, {{0, 1, 2, 3}, {4, 5, 6, 0}}},
    {7, 4, true, 2, false, {{}, {}}},
    {16, 4, false, 2, false, {{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}},
    {16, 4, true, 2, false, {{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}},
    {23, 4, false, 2, false, {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19}, {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 0}}},
    {23, 4, true, 2, false, {{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}},
    {24, 4, false, 2, false, {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19}, {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23}}},
    {24, 4, true, 2, false, {{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19}, {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23}}},
    {0, 4, false, 2, true, {{}, {}}},
    {0, 4, true, 2, true, {{}, {}}},
    {2, 4, false, 2, true, {{0, 1}, {0, 1}}},
    {2, 4, true, 2, true, {{}, {}}},
    {7, 4, false, 2, true, {{0, 1, 4, 5}, {2, 3, 6, 0}}},
    {7, 4, true, 2, true, {{0, 1}, {2, 3}}},
    {16, 4, false, 2, true, {{0, 1, 4, 5, 8, 9, 12, 13}, {2, 3, 6, 7, 10, 11, 14, 15}}},
    {16, 4, true, 2, true, {{0, 1, 4, 5, 8, 9, 12, 13}, {2, 3, 6, 7, 10, 11, 14, 15}}},
    {23, 4, false, 2, true, {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21}, {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 0}}},
    {23, 4, true, 2, true, {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17}, {2, 3, 6, 7, 10, 11, 14, 15, 18, 19}}},
    {24, 4, false, 2, true, {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21}, {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23}}},
    {24, 4, true, 2, true, {{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21}, {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23}}},
    {0, 3, false, 3, false, {{}, {}, {}}},
    {0, 3, true, 3, false, {{}, {}, {}}},
    {2, 3, false, 3, false, {{0, 1, 0}, {1, 0, 1}, {0, 1, 0}}},
    {2, 3, true, 3, false, {{}, {}, {}}},
    {7, 3, false, 3, false, {{0, 1, 2}, {3, 4, 5}, {6, 0, 1}}},
    {7, 3, true, 3, false, {{}, {}, {}}},
    {16, 3, false, 3, false, {{0, 1, 2, 9, 10, 11}, {3, 4, 5, 12, 13, 14}, {6, 7, 8, 15, 0, 1}}},
    {16, 3, true, 3, false, {{0, 1, 2}, {3, 4, 5}, {6, 7, 8}}},
    {23, 3, false, 3, false, {{0, 1, 2, 9, 10, 11, 18, 19, 20}, {3, 4, 5, 12, 13, 14, 21, 22, 0}, {6, 7, 8, 15, 16, 17, 1, 2, 3}}},
    {23, 3, true, 3, false, {{0, 1, 2, 9, 10, 11}, {3, 4, 5, 12, 13, 14}, {6, 7, 8, 15, 16, 17}}},
    {24, 3, false, 3, false, {{0, 1, 2, 9, 10, 11, 18, 19, 20}, {3, 4, 5, 12, 13, 14, 21, 22, 23}, {6, 7, 8, 15, 16, 17, 0, 1, 2}}},
    {24, 3, true, 3, false, {{0, 1, 2, 9, 10, 11}, {3, 4, 5, 12, 13, 14}, {6, 7, 8, 15, 16, 17}}},
    {0, 3, false, 3, true, {{}, {}, {}}},
    {0, 3, true, 3, true, {{}, {}, {}}},
    {2, 3, false, 3, true, {{0}, {1}, {0}}},
    {2, 3, true, 3, true, {{}, {}, {}}},
    {7, 3, false, 3, true, {{0, 3, 6}, {1, 4, 0}, {2, 5, 1}}},
    {7, 3, true, 3, true, {{0, 3}, {1, 4}, {2, 5}}},
    {16, 3, false, 3, true, {{0, 3, 6, 9, 12, 15}, {1, 4, 7, 10, 13, 0}, {2, 5, 8, 11, 14, 1}}},
    {16, 3, true, 3, true, {{0, 3, 6, 9, 12}, {1, 4, 7, 10, 13}, {2, 5, 8, 11, 14}}},
    {23, 3, false, 3, true, {{0, 3, 6, 9, 12, 15, 18, 21}, {1, 4, 7, 10, 13, 16, 19, 22}, {2, 5, 8, 11, 14, 17, 20, 0}}},
    {23, 3, true, 3, true, {{0, 3, 6, 9, 12, 15, 18}, {1, 4, 7, 10, 13, 16, 19}, {2, 5, 8, 11, 14, 17, 20}}},
    {24, 3, false, 3, true, {{0, 3, 6, 9, 12, 15, 18, 21}, {1, 4, 7, 10, 13, 16, 19, 22}, {2, 5, 8, 11, 14, 17, 20, 23}}},
    {24, 3, true, 3, true, {{0, 3, 6, 9, 12, 15, 18, 21}, {1, 4, 7, 10, 13, 16, 19, 22}, {2, 5, 8, 11, 14, 17, 20, 23}}},
    {0, 6, false, 3, false, {{}, {}, {}}},
    {0, 6, true, 3, false, {{}, {}, {}}},
    {2, 6, false, 3, false, {{0, 1, 0, 1, 0, 1}, {0, 1, 0, 1, 0, 1}, {0, 1, 0, 1, 0, 1}}},
    {2, 6, true, 3, false, {{}, {}, {}}},
    {7, 6, false, 3, false, {{0, 1, 2, 3, 4, 5}, {6, 0, 1, 2, 3, 4}, {5, 6, 0, 1, 2, 3}}},
    {7, 6, true, 3, false, {{}, {}, {}}},
    {16, 6, false, 3, false, {{0, 1, 2, 3, 4, 5}, {6, 7, 8, 9, 10, 11}, {12, 13, 14, 15, 0, 1}}},
    {16, 6, true, 3, false, {{}, {}, {}}},
    {23, 6, false, 3, false, {{0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 0}, {6, 7, 8, 9, 10, 11, 1, 2, 3, 4, 5, 6}, {12, 13, 14, 15, 16, 17, 7, 8, 9, 10, 11, 12}}},
    {23, 6, true, 3, false, {{0, 1, 2, 3, 4, 5}, {6, 7, 8, 9, 10, 11}, {12, 13, 14, 15, 16, 17}}},
    {24, 6, false, 3, false, {{0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 23}, {6, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5}, {12, 13, 14, 15, 16, 17, 6, 7, 8, 9, 10, 11}}},
    {24, 6, true, 3, false, {{0, 1, 2, 3, 4, 5}, {6, 7, 8, 9, 10, 11}, {12, 13, 14, 15, 16, 17}}},
    {0, 6, false, 3, true, {{}, {}, {}}},
    {0, 6, true, 3, true, {{}, {}, {}}},
    {2, 6, false, 3, true, {{0, 1}, {0, 1}, {0, 1}}},
    {2, 6, true, 3, true, {{}, {}, {}}},
    {7, 6, false, 3, true, {{0, 1, 6, 0}, {2, 3, 1, 2}, {4, 5, 3, 4}}},
    {7, 6, true, 3, true, {{0, 1}, {2, 3}, {4, 5}}},
    {16, 6, false, 3, true, {{0, 1, 6, 7, 12, 13}, {2, 3, 8, 9, 14, 15}, {4, 5, 10, 11, 0, 1}}},
    {16, 6, true, 3, true, {{0, 1, 6, 7}, {2, 3, 8, 9}, {4, 5, 10, 11}}},
    {23, 6, false, 3, true, {{0, 1, 6, 7, 12, 13, 18, 19}, {2, 3, 8, 9, 14, 15, 20, 21}, {4, 5, 10, 11, 16, 17, 22, 0}}},
    {23, 6, true, 3, true, {{0, 1, 6, 7, 12, 13}, {2, 3, 8, 9, 14, 15}, {4, 5, 10, 11, 16, 17}}},
    {24, 6, false, 3, true, {{0, 1, 6, 7, 12, 13, 18, 19}, {2, 3, 8, 9, 14, 15, 20, 21}, {4, 5, 10, 11, 16, 17, 22, 23}}},
    {24, 6, true, 3, true, {{0, 1, 6, 7, 12, 13, 18, 19}, {2, 3, 8, 9, 14, 15, 20, 21}, {4, 5, 10, 11, 16, 17, 22, 23}}},
    {0, 4, false, 4, false, {{}, {}, {}, {}}},
    {0, 4, true, 4, false, {{}, {}, {}, {}}},
    {2, 4, false, 4, false, {{0, 1, 0, 1}, {0, 1, 0, 1}, {0, 1, 0, 1}, {0, 1, 0, 1}}},
    {2, 4, true, 4, false, {{}, {}, {}, {}}},
    {7, 4, false, 4, false, {{0, 1, 2, 3}, {4, 5, 6, 0}, {1, 2, 3, 4}, {5, 6, 0, 1}}},
    {7, 4, true, 4, false, {{}, {}, {}, {}}},
    {16, 4, false, 4, false, {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}},
    {16, 4, true, 4, false, {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}},
    {23, 4, false, 4, false, {{0, 1, 2, 3, 16, 17, 18, 19}, {4, 5, 6, 7, 20, 21, 22, 0}, {8, 9, 10, 11, 1, 2, 3, 4}, {12, 13, 14, 15, 5, 6, 7, 8}}},
    {23, 4, true, 4, false, {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}},
    {24, 4, false, 4, false, {{0, 1, 2, 3, 16, 17, 18, 19}, {4, 5, 6, 7, 20, 21, 22, 23}, {8, 9, 10, 11, 0, 1, 2, 3}, {12, 13, 14, 15, 4, 5, 6, 7}}},
    {24, 4, true, 4, false, {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}},
    {0, 4, false, 4, true, {{}, {}, {}, {}}},
    {0, 4, true, 4, true, {{}, {}, {}, {}}},
    {2, 4, false, 4, true, {{0}, {1}, {0}, {1}}},
    {2, 4, true, 4, true, {{}, {}, {}, {}}},
    {7, 4, false, 4, true, {{0, 4}, {1, 5}, {2, 6}, {3, 0}}},
    {7, 4, true, 4, true, {{0}, {1}, {2}, {3}}},
    {16, 4, false, 4, true, {{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}},
    {16, 4, true, 4, true, {{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}}},
    {23, 4, false, 4, true, {{0, 4, 8, 12, 16, 20}, {1, 5, 9, 13, 17, 21}, {2, 6, 10, 14, 18, 22}, {3, 7, 11, 15, 19, 0}}},
    {23, 4, true, 4, true, {{0, 4, 8, 12, 16}, {1, 5, 9, 13, 17}, {2, 6, 10, 14, 18}, {3, 7, 11, 15, 19}}},
    {24, 4, false, 4, true, {{0, 4, 8, 12, 16, 20}, {1, 5, 9, 13, 17, 21}, {2, 6, 10, 14, 18, 22}, {3, 7, 11, 15, 19, 23}}},
    {24, 4, true, 4, true, {{0, 4, 8, 12, 16, 20}, {1, 5, 9, 13, 17, 21}, {2, 6, 10, 14, 18, 22}, {3, 7, 11, 15, 19, 23}}},
};
// clang-format on

void PrintTo(const StreamCase& c, std::ostream* os) {
  *os << "stream of " << c.n << " batch_size " << c.batch_size << (c.drop_last ? " drop_last" : "") << " over "
      << c.num_processes << " processes" << (c.split_batches ? " split" : "");
}

std::string stream_case_name(const ::testing::TestParamInfo<StreamCase>& info) {
  const auto& c = info.param;
  return "n" + std::to_string(c.n) + "_bs" + std::to_string(c.batch_size) + (c.drop_last ? "_droplast" : "_keeplast") +
         "_" + std::to_string(c.num_processes) + "proc" + (c.split_batches ? "_split" : "_nosplit");
}

class IterableDatasetShardTable : public ::testing::TestWithParam<StreamCase> {};

TEST_P(IterableDatasetShardTable, EveryProcessGetsUpstreamsSamplesAndItsSizeCountsThem) {
  const auto& c = GetParam();
  for (int p = 0; p < c.num_processes; ++p) {
    IterableDatasetShard shard(range_stream(c.n), {.batch_size = c.batch_size,
                                                   .drop_last = c.drop_last,
                                                   .num_processes = c.num_processes,
                                                   .process_index = p,
                                                   .split_batches = c.split_batches});
    std::vector<int64_t> seen;
    auto next = shard.iter();
    while (auto e = next()) seen.push_back(e->data.item<int64_t>());
    EXPECT_EQ(seen, c.expected[static_cast<size_t>(p)]) << "process " << p;
    EXPECT_EQ(shard.size(), static_cast<int64_t>(seen.size())) << "process " << p;
    EXPECT_EQ(shard.total_length(), c.n);
  }
}

INSTANTIATE_TEST_SUITE_P(Upstream, IterableDatasetShardTable, ::testing::ValuesIn(kStreamCases), stream_case_name);

TEST(IterableDatasetShard, InterleavingTheShardsRebuildsTheStreamWrappedAround) {
  // Upstream's check: reading the shards batch by batch in process order gives the stream,
  // repeated from its start to complete the last round.
  for (bool split : {false, true}) {
    const int n = 3;
    const int64_t bs = split ? 6 : 2;
    const int64_t share = split ? bs / n : bs;
    std::vector<std::vector<int64_t>> shards;
    for (int p = 0; p < n; ++p) {
      IterableDatasetShard shard(range_stream(29),
                                 {.batch_size = bs, .num_processes = n, .process_index = p, .split_batches = split});
      shards.emplace_back();
      auto next = shard.iter();
      while (auto e = next()) shards.back().push_back(e->data.item<int64_t>());
    }
    std::vector<int64_t> observed;
    for (size_t i = 0; i < shards[0].size(); i += static_cast<size_t>(share)) {
      for (const auto& s : shards)
        observed.insert(observed.end(), s.begin() + static_cast<long>(i),
                        s.begin() + static_cast<long>(i + static_cast<size_t>(share)));
    }
    const std::vector<int64_t> stream = iota(29);
    std::vector<int64_t> reference;
    while (reference.size() < observed.size()) reference.insert(reference.end(), stream.begin(), stream.end());
    reference.resize(observed.size());
    EXPECT_EQ(observed, reference) << "split " << split;
    EXPECT_EQ(observed.size() % static_cast<size_t>(split ? bs : bs * n), 0u);
  }
}

TEST(IterableDatasetShard, SizeIsUnknownForAStreamOfUnknownSize) {
  IterableDatasetShard shard(range_stream(10, /*sized=*/false), {.batch_size = 2, .num_processes = 2});
  EXPECT_FALSE(shard.size().has_value());
}

TEST(IterableDatasetShard, SettingsAreChecked) {
  EXPECT_THROWS_WITH(IterableDatasetShard(nullptr), "expected a dataset, got null");
  EXPECT_THROWS_WITH(IterableDatasetShard(range_stream(4), {.batch_size = 0}),
                     "batch_size must be a positive integer, got 0");
  EXPECT_THROWS_WITH(IterableDatasetShard(range_stream(4), {.num_processes = 0}), "num_processes must be >= 1, got 0");
  EXPECT_THROWS_WITH(IterableDatasetShard(range_stream(4), {.num_processes = 2, .process_index = 5}),
                     "process_index must be in [0, 2), got 5");
  EXPECT_THROWS_WITH(
      IterableDatasetShard(range_stream(4), {.batch_size = 3, .num_processes = 2, .split_batches = true}),
      "split_batches needs a batch size that is a round multiple of the number of processes (2), got 3");
}

TEST(IterableDatasetShard, ForwardsTheEpochToTheDataset) {
  struct Recording final : IterableDataset {
    int64_t epoch = -1;
    ExampleGenerator iter() override {
      return [] { return std::optional<Example>(); };
    }
    void set_epoch(int64_t e) override { epoch = e; }
  };
  auto dataset = std::make_shared<Recording>();
  IterableDatasetShard shard(dataset, {.num_processes = 2});
  shard.set_epoch(3);
  EXPECT_EQ(dataset->epoch, 3);
}

// ---- collate -------------------------------------------------------------------------------------

TEST(DefaultCollate, StacksTensorsAndTurnsNumbersIntoTensorsAndOtherFieldsIntoLists) {
  std::vector<Example> samples;
  for (int64_t i = 0; i < 3; ++i) {
    samples.push_back(Example{at::full({2}, static_cast<double>(i)),
                              at::scalar_tensor(i, at::kLong),
                              {{"id", c10::IValue(i)},
                               {"mask", at::ones({4}, at::kBool)},
                               {"name", c10::IValue("s" + std::to_string(i))},
                               {"score", c10::IValue(0.5 * static_cast<double>(i))},
                               {"flag", c10::IValue(i % 2 == 0)}}});
  }
  const auto batch = default_collate(samples);
  EXPECT_EQ(batch.data.sizes(), (std::vector<int64_t>{3, 2}));
  EXPECT_TRUE(batch.data.select(0, 2).eq(2).all().item<bool>());
  EXPECT_EQ(values(batch.target), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(values(batch.fields.at("id").toTensor()), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(batch.fields.at("mask").toTensor().sizes(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(batch.fields.at("score").toTensor().scalar_type(), at::kDouble);
  EXPECT_EQ(batch.fields.at("flag").toTensor().scalar_type(), at::kBool);
  const auto names = batch.fields.at("name").toListRef();
  ASSERT_EQ(names.size(), 3u);
  EXPECT_EQ(names[2].toStringRef(), "s2");
}

TEST(DefaultCollate, LeavesAMissingTargetUndefined) {
  const auto batch = default_collate({Example{at::ones({2})}, Example{at::zeros({2})}});
  EXPECT_EQ(batch.data.sizes(), (std::vector<int64_t>{2, 2}));
  EXPECT_FALSE(batch.target.defined());
}

TEST(DefaultCollate, RefusesSamplesThatDoNotAgree) {
  EXPECT_THROWS_WITH(default_collate({}), "[default_collate] expected at least one sample, got an empty batch");
  EXPECT_THROWS_WITH(
      default_collate({Example{at::ones({2})}, Example{at::ones({3})}}),
      "cannot stack data: every sample must have the same shape, but sample 0 has [2] and sample 1 has [3]");
  EXPECT_THROWS_WITH(default_collate({Example{at::ones({2}), at::ones({1})}, Example{at::ones({2})}}),
                     "every sample must have target or none must: sample 0 has, sample 1 has none");
  EXPECT_THROWS_WITH(default_collate({Example{at::ones({2}), {}, {{"a", 1}}}, Example{at::ones({2}), {}, {{"b", 1}}}}),
                     "every sample must have the same fields: sample 0 has {a}, sample 1 has {b}");
  EXPECT_THROWS_WITH(
      default_collate({Example{{}, {}, {{"m", at::ones({2})}}}, Example{{}, {}, {{"m", at::ones({5})}}}}),
      "cannot stack field 'm'");
}

// ---- datasets ------------------------------------------------------------------------------------

TEST(TensorDataset, SamplesAreRows) {
  TensorDataset dataset(at::arange(12).reshape({6, 2}), at::arange(6) * 10);
  EXPECT_EQ(dataset.size(), 6);
  const auto e = dataset.get(4);
  EXPECT_EQ(values(e.data), (std::vector<int64_t>{8, 9}));
  EXPECT_EQ(e.target.item<int64_t>(), 40);
  EXPECT_THROWS_WITH(dataset.get(6), "[TensorDataset] index 6 is outside [0, 6)");
  EXPECT_THROWS_WITH(TensorDataset(at::ones({3}), at::ones({4})),
                     "data and target must have the same first dimension, got 3 and 4");
  EXPECT_THROWS_WITH(TensorDataset(at::scalar_tensor(1)),
                     "expected a data tensor with a first dimension, got a 0-dim tensor");
}

TEST(TensorDataset, ABatchedReadEqualsCollatingTheSamples) {
  TensorDataset dataset(at::randn({10, 3}), at::arange(10) * 2);
  const auto batch = dataset.get_batch({3, 1, 7});
  ASSERT_TRUE(batch.has_value());
  const auto collated = default_collate({dataset.get(3), dataset.get(1), dataset.get(7)});
  EXPECT_TRUE(batch->data.equal(collated.data));
  EXPECT_TRUE(batch->target.equal(collated.target));
  EXPECT_FALSE(TensorDataset(at::ones({2, 2})).get_batch({1})->target.defined());
}

// Counts how it is read; reads batches at once unless `batched` is false.
struct CountingDataset final : Dataset {
  explicit CountingDataset(bool batched) : batched(batched) {}
  int64_t size() const override { return 6; }
  Example get(int64_t i) override {
    ++singles;
    return Example{at::scalar_tensor(i, at::kLong)};
  }
  std::optional<Example> get_batch(const std::vector<int64_t>& indices) override {
    ++batches;
    if (!batched) return std::nullopt;
    if (indices.front() == 4) throw std::runtime_error("disk full");
    return Example{at::tensor(indices, at::kLong)};
  }
  bool batched;
  std::atomic<int> singles{0};
  std::atomic<int> batches{0};
};

TEST(DataLoader, ADatasetsBatchedReadIsUsedOnlyWithTheDefaultCollate) {
  auto fast = std::make_shared<CountingDataset>(true);
  DataLoader loader(fast, {.batch_size = 2});
  EXPECT_THROWS_WITH(
      batches_of(loader),
      "[DataLoader] loading a batch of 2 samples from index 4 failed: dataset.get_batch threw: disk full");
  EXPECT_EQ(fast->batches.load(), 3);
  EXPECT_EQ(fast->singles.load(), 0);
  // A custom collate function gets the samples one by one.
  DataLoader custom(fast, {.batch_size = 2, .collate_fn = [](std::vector<Example> s) { return default_collate(s); }});
  EXPECT_EQ(flat(batches_of(custom)), iota(6));
  EXPECT_EQ(fast->batches.load(), 3);
  EXPECT_EQ(fast->singles.load(), 6);
  // A dataset that declines reads sample by sample.
  auto slow = std::make_shared<CountingDataset>(false);
  DataLoader fallback(slow, {.batch_size = 4});
  EXPECT_EQ(flat(batches_of(fallback)), iota(6));
  EXPECT_EQ(slow->batches.load(), 2);
  EXPECT_EQ(slow->singles.load(), 6);
}

TEST(MakeDataset, LibTorchsTensorDatasetWorksDirectly) {
  DataLoader loader(torch::data::datasets::TensorDataset(at::arange(10).reshape({5, 2})), {.batch_size = 2});
  const auto batches = batches_of(loader);
  EXPECT_EQ(batches, (Batches{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}}));
}

// A user dataset written against LibTorch's own interface.
class Squares : public torch::data::datasets::Dataset<Squares> {
 public:
  torch::data::Example<> get(size_t index) override {
    const auto i = static_cast<int64_t>(index);
    return {at::scalar_tensor(i, at::kLong), at::scalar_tensor(i * i, at::kLong)};
  }
  torch::optional<size_t> size() const override { return 6; }
};

TEST(MakeDataset, ALibTorchUserDatasetWorksDirectly) {
  DataLoader loader(Squares(), {.batch_size = 4});
  std::vector<int64_t> targets;
  for (auto& batch : loader) {
    const auto t = values(batch.target);
    targets.insert(targets.end(), t.begin(), t.end());
  }
  EXPECT_EQ(targets, (std::vector<int64_t>{0, 1, 4, 9, 16, 25}));
}

class Endless : public torch::data::datasets::Dataset<Endless> {
 public:
  torch::data::Example<> get(size_t index) override { return {at::ones({1}), at::ones({1})}; }
  torch::optional<size_t> size() const override { return torch::nullopt; }
};

TEST(MakeDataset, ALibTorchDatasetWithoutASizeIsRefused) {
  EXPECT_THROWS_WITH(make_dataset(Endless()), "[make_dataset] expected a LibTorch dataset with a known size");
}

TEST(MakeDataset, RefusesEmptyFunctionsAndNegativeSizes) {
  EXPECT_THROWS_WITH(make_dataset(-1, [](int64_t) { return Example{}; }), "[make_dataset] size must be >= 0, got -1");
  EXPECT_THROWS_WITH(make_dataset(3, nullptr), "expected a function returning sample i, got an empty one");
  EXPECT_THROWS_WITH(make_iterable_dataset(nullptr), "expected a function starting a pass, got an empty one");
  EXPECT_THROWS_WITH(make_iterable_dataset([] { return ExampleGenerator(); }, -5),
                     "[make_iterable_dataset] size must be >= 0, got -5");
}

// ---- the plain loader ----------------------------------------------------------------------------

TEST(DataLoader, BatchesARangeInOrderAndKnowsItsSize) {
  DataLoader loader(range_dataset(10), {.batch_size = 4});
  EXPECT_EQ(batches_of(loader), (Batches{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9}}));
  EXPECT_EQ(loader.size(), 3);
  EXPECT_EQ(loader.batch_size(), 4);
  DataLoader dropping(range_dataset(10), {.batch_size = 4, .drop_last = true});
  EXPECT_EQ(batches_of(dropping), (Batches{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(dropping.size(), 2);
}

TEST(DataLoader, AnEmptyDatasetGivesNoBatches) {
  DataLoader loader(range_dataset(0), {.batch_size = 4});
  EXPECT_EQ(batches_of(loader), Batches{});
  EXPECT_EQ(loader.size(), 0);
}

TEST(DataLoader, ShufflesWithItsGeneratorLikePyTorch) {
  DataLoader loader(range_dataset(10),
                    {.batch_size = 10, .shuffle = true, .generator = at::make_generator<at::CPUGeneratorImpl>(5)});
  EXPECT_EQ(flat(batches_of(loader)), values(at::randperm(10, at::make_generator<at::CPUGeneratorImpl>(5), at::kLong)));
}

TEST(DataLoader, UsesACustomSamplerAndCollate) {
  struct Reverse final : Sampler {
    int64_t size() const override { return 5; }
    IndexGenerator iter() override {
      return [i = int64_t{5}]() mutable -> std::optional<int64_t> {
        if (i == 0) return std::nullopt;
        return --i;
      };
    }
  };
  DataLoader loader(
      range_dataset(5),
      {.batch_size = 2, .sampler = std::make_shared<Reverse>(), .collate_fn = [](std::vector<Example> samples) {
         auto batch = default_collate(std::move(samples));
         batch.data = batch.data * 10;
         return batch;
       }});
  EXPECT_EQ(batches_of(loader), (Batches{{40, 30}, {20, 10}, {0}}));
}

TEST(DataLoader, RefusesABatchSizeOfZero) {
  EXPECT_THROWS_WITH(DataLoader(range_dataset(4), {.batch_size = 0}),
                     "[DataLoader] batch_size must be a positive integer, got 0");
  EXPECT_THROWS_WITH(DataLoader(range_stream(4), {.batch_size = 0}),
                     "[DataLoader] batch_size must be a positive integer, got 0");
}

TEST(DataLoader, RefusesConflictingOptions) {
  EXPECT_THROWS_WITH(
      DataLoader(range_dataset(4), {.batch_size = 2, .batch_sampler = range_batches(4, 2, false)}),
      "batch_sampler is mutually exclusive with batch_size, shuffle, sampler and drop_last, got batch_size=2");
  EXPECT_THROWS_WITH(DataLoader(range_dataset(4), {.shuffle = true, .sampler = std::make_shared<SequentialSampler>(4)}),
                     "sampler is mutually exclusive with shuffle");
  EXPECT_THROWS_WITH(
      DataLoader(range_stream(4), {.shuffle = true}),
      "an iterable dataset decides its own order: expected no shuffle, sampler or batch_sampler, got shuffle=1");
  EXPECT_THROWS_WITH(DataLoader(range_dataset(4), {.num_workers = -1}), "num_workers must be >= 0, got -1");
  EXPECT_THROWS_WITH(DataLoader(range_dataset(4), {.prefetch_factor = 0}), "prefetch_factor must be >= 1, got 0");
  EXPECT_THROWS_WITH(DataLoader(std::shared_ptr<Dataset>()), "[DataLoader] expected a dataset, got null");
}

TEST(DataLoader, ReadsAnIterableDatasetInBatches) {
  DataLoader loader(range_stream(7), {.batch_size = 3});
  EXPECT_EQ(batches_of(loader), (Batches{{0, 1, 2}, {3, 4, 5}, {6}}));
  EXPECT_EQ(loader.size(), 3);
  DataLoader unsized(range_stream(7, /*sized=*/false), {.batch_size = 3, .drop_last = true});
  EXPECT_EQ(batches_of(unsized), (Batches{{0, 1, 2}, {3, 4, 5}}));
  EXPECT_THROWS_WITH(unsized.size(), "size() needs an iterable dataset of known size");
  EXPECT_THROWS_WITH(unsized.total_dataset_length(), "the length of an iterable dataset of unknown size was asked for");
  EXPECT_THROWS_WITH(unsized.set_epoch(-1), "[DataLoader] set_epoch expects an epoch >= 0, got -1");
}

// A dataset that takes a random short time per sample, so that workers finish out of order.
std::shared_ptr<Dataset> jittery_range(int64_t n) {
  return make_dataset(n, [](int64_t i) {
    thread_local std::mt19937 rng(static_cast<unsigned>(std::hash<std::thread::id>()(std::this_thread::get_id())));
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 400));
    return Example{at::scalar_tensor(i, at::kLong)};
  });
}

TEST(DataLoader, WorkersDeliverBatchesInOrder) {
  for (int workers : {1, 2, 4}) {
    DataLoader loader(jittery_range(40), {.batch_size = 3, .num_workers = workers, .prefetch_factor = 3});
    EXPECT_EQ(flat(batches_of(loader)), iota(40)) << workers << " workers";
    EXPECT_EQ(flat(batches_of(loader)), iota(40)) << workers << " workers, second pass";
  }
  DataLoader stream(range_stream(11), {.batch_size = 2, .num_workers = 2});
  EXPECT_EQ(batches_of(stream), (Batches{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10}}));
}

TEST(DataLoader, LeavingALoopEarlyStopsTheWorkersAndAnotherPassStartsOver) {
  DataLoader loader(jittery_range(100), {.batch_size = 2, .num_workers = 2});
  for (auto& batch : loader) {
    EXPECT_EQ(values(batch.data), (std::vector<int64_t>{0, 1}));
    break;
  }
  EXPECT_EQ(flat(batches_of(loader)), iota(100));
}

TEST(DataLoader, WorkersPrefetchAtMostTheirShareAhead) {
  std::atomic<int64_t> loaded{0};
  auto dataset = make_dataset(100, [&](int64_t i) {
    loaded.fetch_add(1);
    return Example{at::scalar_tensor(i, at::kLong)};
  });
  DataLoader loader(dataset, {.batch_size = 1, .num_workers = 2, .prefetch_factor = 2});
  auto it = loader.begin();  // delivers batch 0 and looks ahead at batch 1
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  // Two batches consumed by the loader, four more in flight at most.
  EXPECT_LE(loaded.load(), 2 + 4);
  EXPECT_GE(loaded.load(), 2);
}

class DataLoaderErrors : public ::testing::TestWithParam<int> {};

TEST_P(DataLoaderErrors, ADatasetErrorReachesTheLoopWithTheIndex) {
  auto dataset = make_dataset(10, [](int64_t i) -> Example {
    if (i == 7) throw std::runtime_error("corrupt record");
    return Example{at::scalar_tensor(i, at::kLong)};
  });
  DataLoader loader(dataset, {.batch_size = 2, .num_workers = GetParam()});
  std::vector<int64_t> seen;
  const auto message = error_of([&] {
    for (auto& batch : loader) {
      const auto v = values(batch.data);
      seen.insert(seen.end(), v.begin(), v.end());
    }
  });
  EXPECT_THAT(message, HasSubstr("[DataLoader] loading sample 7 failed: dataset.get(7) threw: corrupt record"));
  // The batches before the failing one arrived, minus the one the look-ahead was about to hand over.
  EXPECT_EQ(seen, (std::vector<int64_t>{0, 1, 2, 3}));
}

TEST_P(DataLoaderErrors, ASamplerIndexOutOfRangeIsAnError) {
  struct Beyond final : Sampler {
    int64_t size() const override { return 3; }
    IndexGenerator iter() override {
      return [i = int64_t{0}]() mutable -> std::optional<int64_t> {
        if (i == 3) return std::nullopt;
        return i++ == 2 ? 12 : i - 1;
      };
    }
  };
  DataLoader loader(range_dataset(5), {.sampler = std::make_shared<Beyond>(), .num_workers = GetParam()});
  EXPECT_THROWS_WITH(batches_of(loader),
                     "[DataLoader] the sampler yielded index 12, outside the dataset's 5 samples [0, 5)");
}

TEST_P(DataLoaderErrors, AnIterableDatasetErrorReachesTheLoop) {
  auto stream = make_iterable_dataset([]() -> ExampleGenerator {
    return [i = int64_t{0}]() mutable -> std::optional<Example> {
      if (i == 5) throw std::runtime_error("connection reset");
      return Example{at::scalar_tensor(i++, at::kLong)};
    };
  });
  DataLoader loader(stream, {.batch_size = 2, .num_workers = GetParam()});
  EXPECT_THROWS_WITH(batches_of(loader),
                     "[DataLoader] reading sample 5 of the iterable dataset failed: connection reset");
}

INSTANTIATE_TEST_SUITE_P(Workers, DataLoaderErrors, ::testing::Values(0, 2));

TEST(DataLoader, AnEndIteratorCannotBeDereferencedOrAdvanced) {
  DataLoader loader(range_dataset(2), {.batch_size = 2});
  auto end = loader.end();
  EXPECT_THROWS_WITH(*end, "cannot dereference an iterator at the end of its pass");
  EXPECT_THROWS_WITH(++end, "cannot advance an end iterator");
  auto it = loader.begin();
  ++it;
  EXPECT_TRUE(it == loader.end());
  EXPECT_THROWS_WITH(++it, "cannot advance an iterator that reached the end of its pass");
}

// ---- prepared loaders and GradientState ----------------------------------------------------------

PartialState single_state() {
  PartialStateOptions options;
  options.process_index = 0;
  options.num_processes = 1;
  return PartialState::standalone(options);
}

TEST(PrepareDataLoader, EndOfDataloaderIsTrueDuringTheLastBatchOnEveryPass) {
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  auto loader = prepare_data_loader(DataLoader(range_dataset(16), {.batch_size = 4}), state, gs);
  EXPECT_TRUE(loader.prepared());
  for (int pass = 0; pass < 2; ++pass) {
    int idx = 0;
    for (auto& batch : loader) {
      (void)batch;
      EXPECT_EQ(loader.end_of_dataloader(), idx == 3) << "pass " << pass << " batch " << idx;
      EXPECT_EQ(gs.end_of_dataloader(), idx == 3) << "pass " << pass << " batch " << idx;
      EXPECT_TRUE(gs.in_dataloader());
      EXPECT_EQ(gs.active_dataloader(), loader.impl().get());
      ++idx;
    }
    EXPECT_EQ(idx, 4);
    EXPECT_FALSE(gs.in_dataloader());
    EXPECT_EQ(loader.iteration(), pass + 1);
  }
}

TEST(PrepareDataLoader, TheWorkersDoNotChangeWhenTheLastBatchIsSeen) {
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  auto loader = prepare_data_loader(DataLoader(jittery_range(9), {.batch_size = 2, .num_workers = 2}), state, gs);
  std::vector<bool> ends;
  for (auto& batch : loader) {
    (void)batch;
    ends.push_back(gs.end_of_dataloader());
  }
  EXPECT_EQ(ends, (std::vector<bool>{false, false, false, false, true}));
}

TEST(PrepareDataLoader, NestedLoadersAreTrackedAsAStack) {
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  auto outer = prepare_data_loader(DataLoader(range_dataset(4), {.batch_size = 2}), state, gs);
  auto inner = prepare_data_loader(DataLoader(range_dataset(7), {.batch_size = 2}), state, gs,
                                   {.num_processes = 2, .process_index = 0});
  int outer_index = 0;
  for (auto& o : outer) {
    (void)o;
    EXPECT_EQ(gs.dataloader_references().size(), 1u);
    int inner_index = 0;
    for (auto& i : inner) {
      (void)i;
      EXPECT_EQ(gs.active_dataloader(), inner.impl().get());
      EXPECT_EQ(gs.dataloader_references().size(), 2u);
      EXPECT_EQ(gs.end_of_dataloader(), inner_index == 1);
      EXPECT_EQ(gs.remainder(), 7 % 4);
      ++inner_index;
    }
    // Back in the outer loop, its own end and remainder are in force again.
    EXPECT_EQ(gs.active_dataloader(), outer.impl().get());
    EXPECT_EQ(gs.end_of_dataloader(), outer_index == 1);
    EXPECT_EQ(gs.remainder(), 4 % 2);
    ++outer_index;
  }
  EXPECT_FALSE(gs.in_dataloader());
  EXPECT_EQ(gs.remainder(), -1);
}

TEST(PrepareDataLoader, RemainderFollowsUpstream) {
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  auto remainder_of = [&](DataLoader loader, PrepareDataLoaderOptions options) {
    auto prepared = prepare_data_loader(loader, state, gs, options);
    int64_t seen = -2;
    for (auto& batch : prepared) {
      (void)batch;
      seen = gs.remainder();
    }
    EXPECT_EQ(seen, prepared.remainder());
    return seen;
  };
  // length % (batch size × processes); with split_batches the batch size is the total one.
  EXPECT_EQ(remainder_of(DataLoader(range_dataset(22), {.batch_size = 3}), {.num_processes = 2}), 22 % 6);
  EXPECT_EQ(remainder_of(DataLoader(range_dataset(22), {.batch_size = 4}), {.num_processes = 2, .split_batches = true}),
            22 % 4);
  EXPECT_EQ(remainder_of(DataLoader(range_dataset(22), {.batch_size = 3, .drop_last = true}), {.num_processes = 2}),
            -1);
  // Unknown for a stream of unknown size and for varying batch sizes.
  EXPECT_EQ(remainder_of(DataLoader(range_stream(9, /*sized=*/false), {.batch_size = 2}), {}), -1);
  EXPECT_EQ(
      remainder_of(DataLoader(range_dataset(5),
                              {.batch_sampler = std::make_shared<ListBatchSampler>(Batches{{0, 1, 2}, {3}, {4}})}),
                   {}),
      -1);
}

TEST(PrepareDataLoader, ExplicitProcessesShardWithoutAProcessGroup) {
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  for (int p = 0; p < 3; ++p) {
    auto loader = prepare_data_loader(DataLoader(range_dataset(25), {.batch_size = 3}), state, gs,
                                      {.num_processes = 3, .process_index = p});
    auto shard = std::dynamic_pointer_cast<BatchSamplerShard>(loader.batch_sampler());
    ASSERT_NE(shard, nullptr);
    EXPECT_EQ(batches_of(loader), collect(*std::make_shared<BatchSamplerShard>(range_batches(25, 3, false), 3, p)));
    EXPECT_EQ(loader.size(), 3);
    EXPECT_EQ(loader.total_batch_size(), 9);
    EXPECT_EQ(loader.total_dataset_length(), 25);
  }
}

TEST(PrepareDataLoader, SplitBatchesCutsEachBatch) {
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  auto loader = prepare_data_loader(DataLoader(range_dataset(12), {.batch_size = 4}), state, gs,
                                    {.num_processes = 2, .process_index = 1, .split_batches = true});
  EXPECT_EQ(batches_of(loader), (Batches{{2, 3}, {6, 7}, {10, 11}}));
  EXPECT_EQ(loader.batch_size(), 2);
  EXPECT_EQ(loader.total_batch_size(), 4);
  EXPECT_TRUE(loader.split_batches());
}

TEST(PrepareDataLoader, RefusesBadSettings) {
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  DataLoader loader(range_dataset(12), {.batch_size = 3});
  EXPECT_THROWS_WITH(prepare_data_loader(loader, state, gs, {.num_processes = 2, .split_batches = true}),
                     "[prepare_data_loader] split_batches needs a batch size that is a round multiple of the number of "
                     "processes (2), got 3");
  DataLoader varying(range_dataset(5), {.batch_sampler = std::make_shared<ListBatchSampler>(Batches{{0, 1}, {2}})});
  EXPECT_THROWS_WITH(
      prepare_data_loader(varying, state, gs, {.split_batches = true}),
      "split_batches needs a batch size, but the loader's batch sampler yields batches of varying sizes");
  EXPECT_THROWS_WITH(prepare_data_loader(loader, state, gs, {.dispatch_batches = true}),
                     "[prepare_data_loader] dispatch_batches=true requires put_on_device=true");
  EXPECT_THROWS_WITH(prepare_data_loader(loader, state, gs, {.num_processes = 2, .process_index = 2}),
                     "process_index must be in [0, 2), got 2");
  EXPECT_THROWS_WITH(prepare_data_loader(loader, state, gs, {.num_processes = 0}), "num_processes must be >= 1, got 0");
  auto prepared = prepare_data_loader(loader, state, gs);
  EXPECT_THROWS_WITH(prepare_data_loader(prepared, state, gs), "expected a data loader that is not prepared yet");
}

TEST(PrepareDataLoader, PutOnDeviceMovesBatchesAndAConfigurationMapsToOptions) {
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  auto loader = prepare_data_loader(DataLoader(range_dataset(4), {.batch_size = 2}), state, gs,
                                    {.put_on_device = true, .non_blocking = true});
  for (auto& batch : loader) EXPECT_EQ(batch.data.device(), state.device());
  const auto options = PrepareDataLoaderOptions::from_config({.split_batches = true,
                                                              .dispatch_batches = false,
                                                              .even_batches = false,
                                                              .use_seedable_sampler = true,
                                                              .data_seed = 9,
                                                              .non_blocking = true,
                                                              .use_stateful_dataloader = true});
  EXPECT_TRUE(options.split_batches);
  EXPECT_EQ(options.dispatch_batches, false);
  EXPECT_FALSE(options.even_batches);
  EXPECT_TRUE(options.use_seedable_sampler);
  EXPECT_EQ(options.data_seed, 9u);
  EXPECT_TRUE(options.non_blocking);
  EXPECT_TRUE(options.use_stateful_dataloader);
  EXPECT_TRUE(prepare_data_loader(DataLoader(range_dataset(4)), state, gs, options).use_stateful_dataloader());
}

// A custom batch sampler whose order depends on the epoch (upstream's SimpleBatchSampler).
class EpochBatchSampler final : public BatchSampler {
 public:
  EpochBatchSampler(int64_t n, int64_t batch_size)
      : BatchSampler(std::make_shared<SequentialSampler>(n), batch_size, false) {}
  IndexBatchGenerator iter() override {
    auto batches = std::make_shared<Batches>(collect(BatchSampler::iter()));
    std::rotate(batches->begin(), batches->begin() + (epoch % static_cast<int64_t>(batches->size())), batches->end());
    return [batches, i = size_t{0}]() mutable -> std::optional<std::vector<int64_t>> {
      if (i >= batches->size()) return std::nullopt;
      return (*batches)[i++];
    };
  }
  void set_epoch(int64_t e) override { epoch = e; }
  int64_t epoch = 0;
};

TEST(PrepareDataLoader, SetEpochReachesACustomBatchSampler) {
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  auto custom = std::make_shared<EpochBatchSampler>(16, 4);
  auto loader = prepare_data_loader(DataLoader(range_dataset(16), {.batch_sampler = custom}), state, gs,
                                    {.num_processes = 2, .process_index = 0});
  EXPECT_EQ(std::dynamic_pointer_cast<BatchSamplerShard>(loader.batch_sampler())->batch_sampler(), custom);
  EXPECT_EQ(custom->epoch, 0);
  loader.set_epoch(1);
  EXPECT_EQ(custom->epoch, 1);
  EXPECT_EQ(loader.iteration(), 1);
  EXPECT_EQ(batches_of(loader), (Batches{{4, 5, 6, 7}, {12, 13, 14, 15}}));
  // Each pass sets the sampler's epoch to the loader's iteration.
  EXPECT_EQ(batches_of(loader), (Batches{{8, 9, 10, 11}, {0, 1, 2, 3}}));
  EXPECT_EQ(custom->epoch, 2);
}

TEST(PrepareDataLoader, SetEpochReachesTheDataset) {
  struct Recording final : Dataset {
    std::vector<int64_t> epochs;
    int64_t size() const override { return 4; }
    Example get(int64_t i) override { return Example{at::scalar_tensor(i, at::kLong)}; }
    void set_epoch(int64_t e) override { epochs.push_back(e); }
  };
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  auto dataset = std::make_shared<Recording>();
  auto loader = prepare_data_loader(DataLoader(dataset, {.batch_size = 2}), state, gs);
  batches_of(loader);
  batches_of(loader);
  EXPECT_EQ(dataset->epochs, (std::vector<int64_t>{0, 1}));
}

// ---- shuffling across ranks ----------------------------------------------------------------------

// Each rank's batches over `passes` passes of a prepared, shuffled loader over range(n).
std::vector<std::vector<Batches>> shuffled_passes(int ranks, int64_t n, int64_t batch_size, int passes,
                                                  PrepareDataLoaderOptions options, std::optional<uint64_t> seed) {
  std::vector<std::vector<Batches>> out(static_cast<size_t>(ranks));
  run_ranks(ranks, [&](const PartialState& state) {
    const auto gs = GradientState::standalone();
    // Without a seed every rank's generator starts from a different draw: only the
    // synchronisation from rank 0 makes them agree.
    DataLoaderOptions loader_options{.batch_size = batch_size, .shuffle = true};
    if (seed) loader_options.generator = at::make_generator<at::CPUGeneratorImpl>(*seed);
    auto loader = prepare_data_loader(DataLoader(range_dataset(n), loader_options), state, gs, options);
    auto& mine = out[static_cast<size_t>(state.process_index())];
    for (int pass = 0; pass < passes; ++pass) mine.push_back(batches_of(loader));
  });
  return out;
}

// The samples of one pass in sampler order, rebuilt from the ranks' batches (no split).
std::vector<int64_t> interleave(const std::vector<std::vector<Batches>>& ranks, int pass) {
  std::vector<int64_t> order;
  for (size_t b = 0; b < ranks[0][static_cast<size_t>(pass)].size(); ++b) {
    for (const auto& rank : ranks) {
      const auto& batch = rank[static_cast<size_t>(pass)][b];
      order.insert(order.end(), batch.begin(), batch.end());
    }
  }
  return order;
}

TEST(Shuffling, EveryRankShufflesAlikeEachEpochAndTheEpochsDiffer) {
  for (int ranks : {2, 3}) {
    const auto passes = shuffled_passes(ranks, 12 * ranks, 2, 3, {}, std::nullopt);
    std::vector<std::vector<int64_t>> orders;
    for (int pass = 0; pass < 3; ++pass) {
      auto order = interleave(passes, pass);
      auto sorted = order;
      std::sort(sorted.begin(), sorted.end());
      // Each sample exactly once over the ranks: they used the same permutation.
      EXPECT_EQ(sorted, iota(12 * ranks)) << ranks << " ranks, pass " << pass;
      orders.push_back(order);
    }
    EXPECT_NE(orders[0], orders[1]);
    EXPECT_NE(orders[1], orders[2]);
  }
}

TEST(Shuffling, TheSameSeedGivesTheSameOrderAcrossRunsAndAnotherSeedAnother) {
  const auto a = shuffled_passes(2, 20, 2, 2, {}, 21);
  const auto b = shuffled_passes(2, 20, 2, 2, {}, 21);
  const auto c = shuffled_passes(2, 20, 2, 2, {}, 42);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  // The order is PyTorch's for that generator: rank 0 holds its even positions.
  EXPECT_EQ(interleave(a, 0), values(at::randperm(20, at::make_generator<at::CPUGeneratorImpl>(21), at::kLong)));
}

TEST(Shuffling, SeedableSamplersDependOnTheSeedAndTheEpochOnly) {
  const auto seeded = [](uint64_t data_seed) {
    return shuffled_passes(3, 18, 3, 2, {.use_seedable_sampler = true, .data_seed = data_seed}, std::nullopt);
  };
  const auto a = seeded(42);
  const auto b = seeded(42);
  const auto c = seeded(43);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  // Epoch e is a permutation seeded with data_seed + e.
  EXPECT_EQ(interleave(a, 0), values(at::randperm(18, at::make_generator<at::CPUGeneratorImpl>(42), at::kLong)));
  EXPECT_EQ(interleave(a, 1), values(at::randperm(18, at::make_generator<at::CPUGeneratorImpl>(43), at::kLong)));
}

TEST(Shuffling, SetEpochReplaysAnEpochOfASeedableSampler) {
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  auto loader = prepare_data_loader(DataLoader(range_dataset(10), {.batch_size = 2, .shuffle = true}), state, gs,
                                    {.use_seedable_sampler = true, .data_seed = 7});
  ASSERT_NE(std::dynamic_pointer_cast<SeedableRandomSampler>(loader.sampler()), nullptr);
  std::vector<Batches> first;
  for (int e = 0; e < 3; ++e) first.push_back(batches_of(loader));
  loader.set_epoch(0);
  for (int e = 0; e < 3; ++e) EXPECT_EQ(batches_of(loader), first[static_cast<size_t>(e)]) << "epoch " << e;
  loader.set_epoch(1);
  EXPECT_EQ(batches_of(loader), first[1]);
}

TEST(Shuffling, ReproducibleFromTheGlobalSeedLikeUpstream) {
  // upstream's test_reproducibility, on one process with one and with two shards.
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  for (int shards : {1, 2}) {
    auto run = [&](uint64_t seed) {
      torch::manual_seed(seed);
      auto loader = prepare_data_loader(DataLoader(range_dataset(6), {.shuffle = true}), state, gs,
                                        {.num_processes = shards, .process_index = 0});
      return batches_of(loader);
    };
    EXPECT_EQ(run(21), run(21)) << shards;
    EXPECT_NE(run(21), run(42)) << shards;
  }
}

// ---- through the ranks: sharding, gather_for_metrics ---------------------------------------------

TEST(PrepareDataLoader, RanksGetTheIssueExamplesAndGatherForMetricsDropsThePadding) {
  for (const int64_t n : {24, 21, 20}) {
    std::vector<Batches> seen(2);
    std::vector<std::vector<int64_t>> metrics(2);
    run_ranks(2, [&](const PartialState& state) {
      const auto gs = GradientState::standalone();
      auto loader = prepare_data_loader(DataLoader(range_dataset(n), {.batch_size = 3}), state, gs);
      auto& mine = seen[static_cast<size_t>(state.process_index())];
      for (auto& batch : loader) {
        mine.push_back(values(batch.data));
        const auto all = values(gather_for_metrics(state, gs, batch.data));
        auto& m = metrics[static_cast<size_t>(state.process_index())];
        m.insert(m.end(), all.begin(), all.end());
      }
    });
    const auto expected0 = collect(*std::make_shared<BatchSamplerShard>(range_batches(n, 3, false), 2, 0));
    const auto expected1 = collect(*std::make_shared<BatchSamplerShard>(range_batches(n, 3, false), 2, 1));
    EXPECT_EQ(seen[0], expected0) << n;
    EXPECT_EQ(seen[1], expected1) << n;
    // Every sample once, in order, without the duplicates of the last round.
    EXPECT_EQ(metrics[0], iota(n)) << n;
    EXPECT_EQ(metrics[1], iota(n)) << n;
  }
}

TEST(PrepareDataLoader, IterableDatasetsAreShardedAcrossRanks) {
  for (int ranks : {2, 3}) {
    std::vector<Batches> seen(static_cast<size_t>(ranks));
    run_ranks(ranks, [&](const PartialState& state) {
      const auto gs = GradientState::standalone();
      auto loader = prepare_data_loader(DataLoader(range_stream(10), {.batch_size = 2}), state, gs);
      EXPECT_NE(std::dynamic_pointer_cast<IterableDatasetShard>(loader.iterable_dataset()), nullptr);
      std::vector<bool> ends;
      for (auto& batch : loader) {
        seen[static_cast<size_t>(state.process_index())].push_back(values(batch.data));
        ends.push_back(gs.end_of_dataloader());
      }
      EXPECT_EQ(static_cast<int64_t>(ends.size()), loader.size());
      EXPECT_TRUE(ends.back());
    });
    if (ranks == 2) {
      EXPECT_EQ(seen[0], (Batches{{0, 1}, {4, 5}, {8, 9}}));
      EXPECT_EQ(seen[1], (Batches{{2, 3}, {6, 7}, {0, 1}}));
    } else {
      EXPECT_EQ(seen[0], (Batches{{0, 1}, {6, 7}}));
      EXPECT_EQ(seen[1], (Batches{{2, 3}, {8, 9}}));
      EXPECT_EQ(seen[2], (Batches{{4, 5}, {0, 1}}));
    }
  }
}

// ---- dispatching ---------------------------------------------------------------------------------

struct Dispatched {
  std::vector<Batches> batches;         // per rank
  std::vector<std::vector<bool>> ends;  // per rank: end_of_dataloader at each batch
  std::vector<int64_t> remainders;      // per rank: remainder on the last batch
  std::vector<int64_t> sizes;           // per rank: size()
};

Dispatched dispatch(int ranks, const std::function<DataLoader()>& make, PrepareDataLoaderOptions options) {
  Dispatched out;
  out.batches.resize(static_cast<size_t>(ranks));
  out.ends.resize(static_cast<size_t>(ranks));
  out.remainders.resize(static_cast<size_t>(ranks));
  out.sizes.resize(static_cast<size_t>(ranks));
  options.put_on_device = true;
  options.dispatch_batches = true;
  run_ranks(ranks, [&](const PartialState& state) {
    const auto r = static_cast<size_t>(state.process_index());
    const auto gs = GradientState::standalone();
    auto loader = prepare_data_loader(make(), state, gs, options);
    EXPECT_TRUE(loader.dispatch_batches());
    out.sizes[r] = loader.size();
    for (auto& batch : loader) {
      out.batches[r].push_back(values(batch.data));
      out.ends[r].push_back(gs.end_of_dataloader());
      out.remainders[r] = gs.remainder();
    }
  });
  return out;
}

TEST(DataLoaderDispatcher, ConcatenatesOneBatchPerProcessAndSendsEachItsSlice) {
  const auto d = dispatch(2, [] { return DataLoader(range_dataset(16), {.batch_size = 4}); }, {});
  EXPECT_EQ(d.batches[0], (Batches{{0, 1, 2, 3}, {8, 9, 10, 11}}));
  EXPECT_EQ(d.batches[1], (Batches{{4, 5, 6, 7}, {12, 13, 14, 15}}));
  EXPECT_EQ(d.ends[0], (std::vector<bool>{false, true}));
  EXPECT_EQ(d.ends[1], (std::vector<bool>{false, true}));
  EXPECT_EQ(d.remainders[1], 8);
  EXPECT_EQ(d.sizes[0], 2);
}

TEST(DataLoaderDispatcher, AShortLastGroupIsSplitOrCompletedFromTheFirstBatch) {
  // 18 samples: the last group is one batch of 2, one sample each.
  auto d = dispatch(2, [] { return DataLoader(range_dataset(18), {.batch_size = 4}); }, {});
  EXPECT_EQ(d.batches[0], (Batches{{0, 1, 2, 3}, {8, 9, 10, 11}, {16}}));
  EXPECT_EQ(d.batches[1], (Batches{{4, 5, 6, 7}, {12, 13, 14, 15}, {17}}));
  EXPECT_EQ(d.remainders[0], 2);
  EXPECT_EQ(d.sizes[1], 3);
  // 19 samples: 3 left, completed with the first samples of the first batch.
  d = dispatch(2, [] { return DataLoader(range_dataset(19), {.batch_size = 4}); }, {});
  EXPECT_EQ(d.batches[0].back(), (std::vector<int64_t>{16, 17}));
  EXPECT_EQ(d.batches[1].back(), (std::vector<int64_t>{18, 0}));
  EXPECT_EQ(d.remainders[1], 3);
  // With drop_last the short batch is left out.
  d = dispatch(2, [] { return DataLoader(range_dataset(19), {.batch_size = 4, .drop_last = true}); }, {});
  EXPECT_EQ(d.batches[0], (Batches{{0, 1, 2, 3}, {8, 9, 10, 11}}));
  EXPECT_EQ(d.batches[1], (Batches{{4, 5, 6, 7}, {12, 13, 14, 15}}));
  EXPECT_EQ(d.sizes[0], 2);
}

TEST(DataLoaderDispatcher, SplitBatchesCutsEachBatchOfTheMainProcess) {
  auto d = dispatch(2, [] { return DataLoader(range_dataset(18), {.batch_size = 4}); }, {.split_batches = true});
  EXPECT_EQ(d.batches[0], (Batches{{0, 1}, {4, 5}, {8, 9}, {12, 13}, {16}}));
  EXPECT_EQ(d.batches[1], (Batches{{2, 3}, {6, 7}, {10, 11}, {14, 15}, {17}}));
  EXPECT_EQ(d.sizes[0], 5);
  d = dispatch(2, [] { return DataLoader(range_dataset(17), {.batch_size = 4}); }, {.split_batches = true});
  EXPECT_EQ(d.batches[0].back(), (std::vector<int64_t>{16}));
  EXPECT_EQ(d.batches[1].back(), (std::vector<int64_t>{0}));
  EXPECT_EQ(d.remainders[0], 1);
}

TEST(DataLoaderDispatcher, ThreeProcesses) {
  const auto d = dispatch(3, [] { return DataLoader(range_dataset(20), {.batch_size = 2}); }, {});
  EXPECT_EQ(d.batches[0], (Batches{{0, 1}, {6, 7}, {12, 13}, {18}}));
  EXPECT_EQ(d.batches[1], (Batches{{2, 3}, {8, 9}, {14, 15}, {19}}));
  EXPECT_EQ(d.batches[2], (Batches{{4, 5}, {10, 11}, {16, 17}, {0}}));
  EXPECT_EQ(d.ends[2], (std::vector<bool>{false, false, false, true}));
  EXPECT_EQ(d.remainders[2], 2);
  EXPECT_EQ(d.sizes[2], 4);
}

TEST(DataLoaderDispatcher, VariableBatchSizesAreDispatched) {
  auto make = [] {
    return DataLoader(range_dataset(15), {.batch_sampler = std::make_shared<ListBatchSampler>(
                                              Batches{{0, 1, 2, 3}, {4, 5}, {6, 7, 8, 9, 10, 11}, {12, 13, 14}})});
  };
  auto d = dispatch(2, make, {.split_batches = false});
  // Groups {0..5} and {6..14} (9 samples, odd: completed with samples 0 and 1).
  EXPECT_EQ(d.batches[0], (Batches{{0, 1, 2}, {6, 7, 8, 9, 10}}));
  EXPECT_EQ(d.batches[1], (Batches{{3, 4, 5}, {11, 12, 13, 14, 0}}));
  EXPECT_EQ(d.remainders[0], 9);
}

TEST(DataLoaderDispatcher, DispatchesTheStreamOfAnIterableDatasetByDefault) {
  std::vector<Batches> seen(2);
  run_ranks(2, [&](const PartialState& state) {
    const auto gs = GradientState::standalone();
    auto loader =
        prepare_data_loader(DataLoader(range_stream(10), {.batch_size = 2}), state, gs, {.put_on_device = true});
    EXPECT_TRUE(loader.dispatch_batches());
    for (auto& batch : loader) seen[static_cast<size_t>(state.process_index())].push_back(values(batch.data));
  });
  EXPECT_EQ(seen[0], (Batches{{0, 1}, {4, 5}, {8}}));
  EXPECT_EQ(seen[1], (Batches{{2, 3}, {6, 7}, {9}}));
}

TEST(DataLoaderDispatcher, NonTensorFieldsAndTargetsTravelToo) {
  std::vector<std::vector<std::string>> names(2);
  std::vector<std::vector<int64_t>> targets(2);
  run_ranks(2, [&](const PartialState& state) {
    const auto gs = GradientState::standalone();
    auto dataset = make_dataset(8, [](int64_t i) {
      return Example{at::full({3}, static_cast<double>(i)),
                     at::scalar_tensor(100 + i, at::kLong),
                     {{"name", c10::IValue("n" + std::to_string(i))}, {"tokens", at::ones({2}, at::kLong) * i}}};
    });
    auto loader = prepare_data_loader(DataLoader(dataset, {.batch_size = 4}), state, gs,
                                      {.split_batches = true, .put_on_device = true, .dispatch_batches = true});
    const auto r = static_cast<size_t>(state.process_index());
    for (auto& batch : loader) {
      EXPECT_EQ(batch.data.sizes(), (std::vector<int64_t>{2, 3}));
      EXPECT_EQ(batch.fields.at("tokens").toTensor().sizes(), (std::vector<int64_t>{2, 2}));
      for (const auto& n : batch.fields.at("name").toListRef()) names[r].push_back(n.toStringRef());
      const auto t = values(batch.target);
      targets[r].insert(targets[r].end(), t.begin(), t.end());
    }
  });
  EXPECT_EQ(names[0], (std::vector<std::string>{"n0", "n1", "n4", "n5"}));
  EXPECT_EQ(names[1], (std::vector<std::string>{"n2", "n3", "n6", "n7"}));
  EXPECT_EQ(targets[1], (std::vector<int64_t>{102, 103, 106, 107}));
}

TEST(DataLoaderDispatcher, BatchesOfDifferentShapesCannotBeConcatenatedWithoutSplitBatches) {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](const PartialState& state) {
    const auto gs = GradientState::standalone();
    // Sequences whose length grows with the batch: batches 0 and 1 have different widths.
    auto dataset = make_dataset(8, [](int64_t i) { return Example{at::zeros({1 + i / 2})}; });
    auto loader = prepare_data_loader(DataLoader(dataset, {.batch_size = 2}), state, gs,
                                      {.put_on_device = true, .dispatch_batches = true});
    if (state.is_main_process()) {
      errors[0] = error_of([&] { batches_of(loader); });
      // Tell the other process that nothing more comes.
      detail::broadcast_ivalue(state, c10::ivalue::Tuple::create(std::vector<c10::IValue>{false}), 0, "test");
    } else {
      EXPECT_EQ(batches_of(loader), Batches{});
    }
  });
  EXPECT_THAT(errors[0], HasSubstr("[DataLoaderDispatcher] cannot concatenate 2 batches into one to dispatch"));
  EXPECT_THAT(errors[0], HasSubstr("pass split_batches=true"));
}

TEST(DataLoaderDispatcher, BatchesThatHoldDifferentTensorsCannotBeConcatenated) {
  std::vector<std::string> errors(2);
  run_ranks(2, [&](const PartialState& state) {
    const auto gs = GradientState::standalone();
    auto dataset = make_dataset(8, [](int64_t i) {
      return i < 2 ? Example{at::ones({2})} : Example{at::ones({2}), at::scalar_tensor(i)};
    });
    auto loader = prepare_data_loader(DataLoader(dataset, {.batch_size = 2}), state, gs,
                                      {.put_on_device = true, .dispatch_batches = true});
    if (state.is_main_process()) {
      errors[0] = error_of([&] { batches_of(loader); });
      detail::broadcast_ivalue(state, c10::ivalue::Tuple::create(std::vector<c10::IValue>{false}), 0, "test");
    } else {
      EXPECT_EQ(batches_of(loader), Batches{});
    }
  });
  EXPECT_THAT(errors[0], HasSubstr("[DataLoaderDispatcher] every batch must hold the same tensors"));
}

TEST(DataLoaderDispatcher, ABatchWithoutRowsHasNoBatchSizeToSplit) {
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  auto loader = prepare_data_loader(
      DataLoader(range_dataset(4), {.batch_size = 2,
                                    .collate_fn =
                                        [](std::vector<Example>) {
                                          return Example{{}, {}, {{"note", c10::IValue("no tensors")}}};
                                        }}),
      state, gs, {.put_on_device = true, .dispatch_batches = true});
  EXPECT_THROWS_WITH(batches_of(loader),
                     "[DataLoaderDispatcher] cannot tell the batch size: the batch holds no tensor");
}

TEST(DataLoaderDispatcher, EndOfDataloaderOnTheFirstAndSecondPass) {
  std::vector<std::vector<bool>> ends(2);
  run_ranks(2, [&](const PartialState& state) {
    const auto gs = GradientState::standalone();
    auto loader = prepare_data_loader(DataLoader(range_dataset(16), {.batch_size = 2}), state, gs,
                                      {.put_on_device = true, .dispatch_batches = true});
    for (int pass = 0; pass < 2; ++pass) {
      for (auto& batch : loader) {
        (void)batch;
        ends[static_cast<size_t>(state.process_index())].push_back(loader.end_of_dataloader());
      }
    }
    EXPECT_EQ(loader.iteration(), 2);
  });
  const std::vector<bool> expected = {false, false, false, true, false, false, false, true};
  EXPECT_EQ(ends[0], expected);
  EXPECT_EQ(ends[1], expected);
}

TEST(DataLoaderDispatcher, ShuffledBatchesCoverTheDatasetOnce) {
  std::vector<std::vector<int64_t>> gathered(2);
  run_ranks(2, [&](const PartialState& state) {
    const auto gs = GradientState::standalone();
    auto loader = prepare_data_loader(DataLoader(range_dataset(32), {.batch_size = 4, .shuffle = true}), state, gs,
                                      {.put_on_device = true, .dispatch_batches = true});
    for (auto& batch : loader) {
      const auto all = values(gather(state, batch.data));
      auto& g = gathered[static_cast<size_t>(state.process_index())];
      g.insert(g.end(), all.begin(), all.end());
    }
  });
  for (auto& g : gathered) {
    std::sort(g.begin(), g.end());
    EXPECT_EQ(g, iota(32));
  }
}

TEST(DataLoaderDispatcher, ACustomSliceFunctionChoosesEachProcessesPart) {
  std::vector<Batches> seen(2);
  run_ranks(2, [&](const PartialState& state) {
    const auto gs = GradientState::standalone();
    SliceFn every_other = [](const Example& batch, int64_t, int64_t, int process_index, int num_processes) {
      Example out;
      out.data = batch.data.slice(0, process_index, batch.data.size(0), num_processes);
      return out;
    };
    auto loader = prepare_data_loader(
        DataLoader(range_dataset(8), {.batch_size = 4}), state, gs,
        {.split_batches = true, .put_on_device = true, .dispatch_batches = true, .slice_fn_for_dispatch = every_other});
    for (auto& batch : loader) seen[static_cast<size_t>(state.process_index())].push_back(values(batch.data));
  });
  EXPECT_EQ(seen[0], (Batches{{0, 2}, {4, 6}}));
  EXPECT_EQ(seen[1], (Batches{{1, 3}, {5, 7}}));
}

// ---- skipping ------------------------------------------------------------------------------------

TEST(SkipFirstBatches, SkipsWithoutLoadingTheSkippedSamples) {
  std::atomic<int64_t> loads{0};
  auto dataset = make_dataset(16, [&](int64_t i) {
    loads.fetch_add(1);
    return Example{at::scalar_tensor(i, at::kLong)};
  });
  auto skipped = skip_first_batches(DataLoader(dataset, {.batch_size = 4}), 2);
  EXPECT_EQ(batches_of(skipped), (Batches{{8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(loads.load(), 8);
  EXPECT_EQ(skipped.size(), 2);
  // Every pass skips.
  EXPECT_EQ(batches_of(skipped), (Batches{{8, 9, 10, 11}, {12, 13, 14, 15}}));
  EXPECT_EQ(skip_first_batches(DataLoader(dataset, {.batch_size = 4}), 9).size(), 0);
  EXPECT_EQ(batches_of(skip_first_batches(DataLoader(dataset, {.batch_size = 4}), 9)), Batches{});
}

TEST(SkipFirstBatches, WorksOnPreparedIterableAndDispatchingLoaders) {
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  auto shard = prepare_data_loader(DataLoader(range_dataset(24), {.batch_size = 3}), state, gs,
                                   {.num_processes = 2, .process_index = 1});
  auto skipped = skip_first_batches(shard, 2);
  std::vector<bool> ends;
  Batches batches;
  for (auto& batch : skipped) {
    batches.push_back(values(batch.data));
    ends.push_back(gs.end_of_dataloader());
  }
  EXPECT_EQ(batches, (Batches{{15, 16, 17}, {21, 22, 23}}));
  EXPECT_EQ(ends, (std::vector<bool>{false, true}));
  EXPECT_EQ(skipped.size(), 2);
  EXPECT_EQ(batches_of(skip_first_batches(DataLoader(range_stream(9), {.batch_size = 2}), 3)), (Batches{{6, 7}, {8}}));
  EXPECT_THROWS_WITH(skip_first_batches(shard, -1), "[skip_first_batches] num_batches must be >= 0, got -1");

  std::vector<Batches> seen(2);
  run_ranks(2, [&](const PartialState& rank_state) {
    const auto rank_gs = GradientState::standalone();
    auto loader = prepare_data_loader(DataLoader(range_dataset(19), {.batch_size = 4}), rank_state, rank_gs,
                                      {.put_on_device = true, .dispatch_batches = true});
    auto rest = skip_first_batches(loader, 1);
    EXPECT_EQ(rest.size(), 2);
    for (auto& batch : rest) seen[static_cast<size_t>(rank_state.process_index())].push_back(values(batch.data));
  });
  // The short last group is still completed from the first batch of the pass.
  EXPECT_EQ(seen[0], (Batches{{8, 9, 10, 11}, {16, 17}}));
  EXPECT_EQ(seen[1], (Batches{{12, 13, 14, 15}, {18, 0}}));
}

TEST(SkipFirstBatches, KeepsTheEpochOfTheLoader) {
  const auto state = single_state();
  const auto gs = GradientState::standalone();
  auto custom = std::make_shared<EpochBatchSampler>(16, 4);
  auto loader = prepare_data_loader(DataLoader(range_dataset(16), {.batch_sampler = custom}), state, gs);
  loader.set_epoch(1);
  auto skipped = skip_first_batches(loader, 2);
  EXPECT_EQ(skipped.iteration(), 1);
  EXPECT_EQ(batches_of(skipped), (Batches{{12, 13, 14, 15}, {0, 1, 2, 3}}));
  EXPECT_EQ(custom->epoch, 1);
}

// ---- resuming ------------------------------------------------------------------------------------

class Resume : public ::testing::TestWithParam<int> {};

TEST_P(Resume, AStateSavedMidEpochResumesAtTheNextBatch) {
  const int workers = GetParam();
  auto make = [&] {
    return DataLoader(jittery_range(40), {.batch_size = 4,
                                          .shuffle = true,
                                          .num_workers = workers,
                                          .generator = at::make_generator<at::CPUGeneratorImpl>(3)});
  };
  auto loader = make();
  batches_of(loader);  // one whole epoch first, so the generator has moved on
  Batches reference;
  std::string saved;
  int idx = 0;
  for (auto& batch : loader) {
    reference.push_back(values(batch.data));
    if (idx++ == 1) saved = loader.state_dict().to_json();
  }
  const auto state = DataLoaderState::from_json(saved);
  EXPECT_EQ(state.epoch, 1);
  EXPECT_EQ(state.batches_yielded, 2);
  EXPECT_FALSE(state.iterator_finished);
  auto resumed = make();
  resumed.load_state_dict(state);
  EXPECT_EQ(resumed.state_dict(), state);
  EXPECT_EQ(batches_of(resumed), Batches(reference.begin() + 2, reference.end()));
  EXPECT_EQ(resumed.iteration(), 2);
  // The epoch after continues as the uninterrupted run would.
  EXPECT_EQ(batches_of(resumed), batches_of(loader));
}

TEST_P(Resume, AStateSavedOnTheLastBatchResumesAtTheNextEpoch) {
  const int workers = GetParam();
  auto make = [&] {
    return DataLoader(range_dataset(12), {.batch_size = 4,
                                          .shuffle = true,
                                          .num_workers = workers,
                                          .generator = at::make_generator<at::CPUGeneratorImpl>(8)});
  };
  auto loader = make();
  DataLoaderState state;
  for (auto& batch : loader) {
    (void)batch;
    if (loader.end_of_dataloader()) state = loader.state_dict();
  }
  EXPECT_EQ(state.epoch, 1);
  EXPECT_EQ(state.batches_yielded, 0);
  EXPECT_TRUE(state.iterator_finished);
  EXPECT_EQ(loader.state_dict(), state);  // after the loop: the same place
  auto resumed = make();
  resumed.load_state_dict(state);
  EXPECT_EQ(batches_of(resumed), batches_of(loader));
}

TEST_P(Resume, ALoopLeftEarlyKeepsItsPosition) {
  const int workers = GetParam();
  auto loader = DataLoader(range_dataset(20), {.batch_size = 2, .num_workers = workers});
  int idx = 0;
  for (auto& batch : loader) {
    (void)batch;
    if (++idx == 3) break;
  }
  const auto state = loader.state_dict();
  EXPECT_EQ(state.batches_yielded, 3);
  auto resumed = DataLoader(range_dataset(20), {.batch_size = 2, .num_workers = workers});
  resumed.load_state_dict(state);
  EXPECT_EQ(flat(batches_of(resumed)), iota(14, 6));
}

TEST_P(Resume, ShardedShuffledRanksResumeTogether) {
  const int workers = GetParam();
  std::vector<Batches> reference(2);
  std::vector<Batches> resumed(2);
  std::vector<std::string> states(2);
  run_ranks(2, [&](const PartialState& state) {
    const auto r = static_cast<size_t>(state.process_index());
    const auto gs = GradientState::standalone();
    auto make = [&] {
      return prepare_data_loader(
          DataLoader(range_dataset(30), {.batch_size = 3, .shuffle = true, .num_workers = workers}), state, gs);
    };
    auto loader = make();
    batches_of(loader);
    int idx = 0;
    for (auto& batch : loader) {
      reference[r].push_back(values(batch.data));
      if (idx++ == 2) states[r] = loader.state_dict().to_json();
    }
    auto again = make();
    again.load_state_dict(DataLoaderState::from_json(states[r]));
    resumed[r] = batches_of(again);
  });
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(resumed[r], Batches(reference[r].begin() + 3, reference[r].end())) << "rank " << r;
  }
}

// A job that changes size: the position of 4 processes, each 3 batches in, is batch 12 of the
// whole order, where 2 processes go on (6 batches each) and 5 cannot (12 is no multiple of 5).
TEST(DataLoaderState, APositionOfFourProcessesResumesAtTheSamePlaceOfTheWholeOrderOnTwo) {
  std::vector<std::string> saved(4);
  run_ranks(4, [&](const PartialState& state) {
    auto loader =
        prepare_data_loader(DataLoader(range_dataset(48), {.batch_size = 2}), state, GradientState::standalone());
    int taken = 0;
    for (auto& batch : loader) {
      (void)batch;
      if (++taken == 3) saved[static_cast<size_t>(state.process_index())] = loader.state_dict().to_json();
    }
  });
  const auto four = DataLoaderState::from_json(saved[0]);
  EXPECT_EQ(four.num_processes, 4);
  EXPECT_EQ(four.batches_yielded, 3);
  std::vector<Batches> resumed(2);
  run_ranks(2, [&](const PartialState& state) {
    auto loader =
        prepare_data_loader(DataLoader(range_dataset(48), {.batch_size = 2}), state, GradientState::standalone());
    loader.load_state_dict(four);
    resumed[static_cast<size_t>(state.process_index())] = batches_of(loader);
  });
  // Batches 12, 14, ... to process 0 and 13, 15, ... to process 1: samples 24 on.
  ASSERT_EQ(resumed[0].size(), 6u);
  EXPECT_EQ(resumed[0].front(), (std::vector<int64_t>{24, 25}));
  EXPECT_EQ(resumed[1].front(), (std::vector<int64_t>{26, 27}));
  EXPECT_EQ(resumed[1].back(), (std::vector<int64_t>{46, 47}));
  run_ranks(5, [&](const PartialState& state) {
    auto loader =
        prepare_data_loader(DataLoader(range_dataset(48), {.batch_size = 2}), state, GradientState::standalone());
    EXPECT_THROWS_WITH(loader.load_state_dict(four),
                       "stands at batch 3 of each of 4 processes (batch 12 of the whole order), which does not "
                       "divide among this loader's 5 processes");
  });
}

TEST_P(Resume, ADispatchingLoaderResumesAtTheNextBatch) {
  const int workers = GetParam();
  std::vector<Batches> reference(2);
  std::vector<Batches> resumed(2);
  run_ranks(2, [&](const PartialState& state) {
    const auto r = static_cast<size_t>(state.process_index());
    const auto gs = GradientState::standalone();
    auto make = [&] {
      return prepare_data_loader(
          DataLoader(range_dataset(27), {.batch_size = 3,
                                         .shuffle = true,
                                         .num_workers = workers,
                                         .generator = at::make_generator<at::CPUGeneratorImpl>(11)}),
          state, gs, {.put_on_device = true, .dispatch_batches = true});
    };
    auto loader = make();
    DataLoaderState saved;
    int idx = 0;
    for (auto& batch : loader) {
      reference[r].push_back(values(batch.data));
      if (idx++ == 1) saved = loader.state_dict();
    }
    auto again = make();
    again.load_state_dict(saved);
    resumed[r] = batches_of(again);
  });
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(resumed[r], Batches(reference[r].begin() + 2, reference[r].end())) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Workers, Resume, ::testing::Values(0, 2));

TEST(Resume, AStateThatDoesNotFitTheLoaderIsRefused) {
  DataLoader shuffled(range_dataset(8), {.batch_size = 2, .shuffle = true});
  DataLoader sequential(range_dataset(8), {.batch_size = 2});
  EXPECT_THROWS_WITH(sequential.load_state_dict(shuffled.state_dict()),
                     "the state holds a generator state, but this loader's sampler has no generator");
  EXPECT_THROWS_WITH(shuffled.load_state_dict(sequential.state_dict()),
                     "this loader's sampler draws from a generator, but the state holds no generator state");
  EXPECT_THROWS_WITH(sequential.load_state_dict({.epoch = -1}),
                     "expected a non-negative epoch and batch count, got epoch -1 and batches_yielded 0");
  auto truncated = shuffled.state_dict();
  truncated.generator_state.resize(20);
  EXPECT_THROWS_WITH(shuffled.load_state_dict(truncated), "the generator refused the saved state (10 bytes)");
  truncated.generator_state = "zz";
  EXPECT_THROWS_WITH(shuffled.load_state_dict(truncated),
                     "expected the generator state as an even number of hex digits");
}

TEST(DataLoaderState, RoundTripsThroughJson) {
  const DataLoaderState state{
      .epoch = 3, .batches_yielded = 7, .iterator_finished = false, .generator_state = "0aff", .num_processes = 2};
  EXPECT_EQ(DataLoaderState::from_json(state.to_json()), state);
  EXPECT_THAT(state.to_json(), HasSubstr("\"batches_yielded\":7"));
}

TEST(DataLoaderState, RefusesHostileJson) {
  const std::string good = R"("iterator_finished": false, "generator_state": "")";
  EXPECT_THROWS_WITH(DataLoaderState::from_json("{"), "got text that does not parse");
  EXPECT_THROWS_WITH(DataLoaderState::from_json("[1, 2]"), "expected a JSON object, got array");
  EXPECT_THROWS_WITH(DataLoaderState::from_json(R"({"batches_yielded": 1, )" + good + "}"),
                     "expected the key \"epoch\", it is missing");
  EXPECT_THROWS_WITH(DataLoaderState::from_json(R"({"epoch": -4, "batches_yielded": 1, )" + good + "}"),
                     "expected \"epoch\" to be an integer >= 0, got -4");
  EXPECT_THROWS_WITH(DataLoaderState::from_json(R"({"epoch": 1, "batches_yielded": "2", )" + good + "}"),
                     "expected \"batches_yielded\" to be an integer >= 0, got \"2\"");
  EXPECT_THROWS_WITH(DataLoaderState::from_json(R"({"epoch": 1.5, "batches_yielded": 2, )" + good + "}"),
                     "expected \"epoch\" to be an integer >= 0, got 1.5");
  EXPECT_THROWS_WITH(DataLoaderState::from_json(
                         R"({"epoch": 1, "batches_yielded": 2, "iterator_finished": 1, "generator_state": ""})"),
                     "expected \"iterator_finished\" to be true or false, got 1");
  EXPECT_THROWS_WITH(DataLoaderState::from_json(R"({"epoch": 1, "batches_yielded": 2, "iterator_finished": true})"),
                     "expected \"generator_state\" to be a string, got nothing");
  EXPECT_THROWS_WITH(DataLoaderState::from_json(
                         R"({"epoch": 1, "batches_yielded": 2, "iterator_finished": true, "generator_state": "abc"})"),
                     "expected \"generator_state\" to be an even number of hex digits, got 3 characters");
}

}  // namespace data_loader_test
}  // namespace accelerate::testing
