// `BatchSamplerShard`: each process's batches of a batch sampler, split or whole, with the last
// round completed from the start as upstream does (Note [Completing the last round]).
#include "accelerate/data_loader.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace accelerate {

BatchSamplerShard::BatchSamplerShard(std::shared_ptr<BatchSampler> batch_sampler, int num_processes, int process_index,
                                     BatchSamplerShardOptions options)
    : BatchSampler(batch_sampler ? batch_sampler->batch_size() : std::nullopt,
                   batch_sampler ? batch_sampler->drop_last() : false),
      batch_sampler_(std::move(batch_sampler)),
      num_processes_(num_processes),
      process_index_(process_index),
      options_(options) {
  TORCH_CHECK_VALUE(batch_sampler_ != nullptr, "[BatchSamplerShard] expected a batch sampler, got null");
  TORCH_CHECK_VALUE(num_processes >= 1, "[BatchSamplerShard] num_processes must be >= 1, got ", num_processes);
  TORCH_CHECK_INDEX(process_index >= 0 && process_index < num_processes,
                    "[BatchSamplerShard] process_index must be in [0, ", num_processes, "), got ", process_index);
  if (options.split_batches) {
    const auto bs = batch_size();
    TORCH_CHECK_VALUE(bs.has_value(),
                      "[BatchSamplerShard] split_batches needs a batch sampler with a batch size that is a "
                      "round multiple of the number of processes (",
                      num_processes, "), got one of varying batch sizes");
    TORCH_CHECK_VALUE(*bs % num_processes == 0,
                      "[BatchSamplerShard] split_batches needs a batch size that is a round "
                      "multiple of the number of processes (",
                      num_processes, "), got ", *bs);
  }
}

int64_t BatchSamplerShard::size() const {
  const int64_t total = batch_sampler_->size();
  if (options_.split_batches) return total;  // every process gets a slice of every batch
  if (total % num_processes_ == 0) return total / num_processes_;
  const int64_t length = total / num_processes_;
  if (drop_last()) return length;
  if (options_.even_batches) return length + 1;
  return process_index_ < total % num_processes_ ? length + 1 : length;
}

IndexBatchGenerator BatchSamplerShard::iter() {
  return options_.split_batches ? iter_with_split() : iter_without_split();
}

namespace {

std::vector<int64_t> slice_of(const std::vector<int64_t>& batch, int64_t begin, int64_t end) {
  const auto n = static_cast<int64_t>(batch.size());
  begin = std::min(begin, n);
  end = std::min(end, n);
  return std::vector<int64_t>(batch.begin() + begin, batch.begin() + end);
}

// Note [Completing the last round]
// With even batches, the batches of the last round that are missing or short are completed with
// indices from the start of the sampler order: a short batch is topped up first, then each
// following process takes the next consecutive indices (or, for varying batch sizes, the next of
// the first batches). The start is repeated as often as needed when the dataset is smaller than
// one round. Only the first round is kept for this, so a pass costs O(round) memory.
struct UnsplitShardState {
  IndexBatchGenerator batches;
  int64_t num_processes;
  int64_t process_index;
  std::optional<int64_t> batch_size;
  bool drop_last;
  bool even_batches;

  std::vector<int64_t> first_indices{};               // fixed batch size: the first round, flat
  std::vector<std::vector<int64_t>> first_batches{};  // varying batch sizes: the first round's batches
  std::optional<std::vector<int64_t>> pending{};      // this process's batch of the current round
  std::vector<int64_t> last{};                        // the last batch of the sampler
  int64_t index = -1;                                 // index of the last batch of the sampler
  bool sampler_ended = false;
  bool tail_built = false;
  std::deque<std::vector<int64_t>> tail{};

  bool full(const std::vector<int64_t>& batch) const {
    return !batch_size || static_cast<int64_t>(batch.size()) == *batch_size;
  }

  std::optional<std::vector<int64_t>> next() {
    while (!sampler_ended) {
      auto batch = batches();
      if (!batch) {
        sampler_ended = true;
        break;
      }
      ++index;
      if (!drop_last && index < num_processes) {
        if (batch_size) {
          first_indices.insert(first_indices.end(), batch->begin(), batch->end());
        } else {
          first_batches.push_back(*batch);
        }
      }
      if (index % num_processes == process_index) pending = *batch;
      const bool round_complete = index % num_processes == num_processes - 1 && full(*batch);
      last = std::move(*batch);
      // A round is handed out only once every process of it has a full batch.
      if (round_complete && pending) {
        auto out = std::move(pending);
        pending.reset();
        return out;
      }
    }
    if (!tail_built) {
      tail_built = true;
      build_tail();
    }
    if (tail.empty()) return std::nullopt;
    auto out = std::move(tail.front());
    tail.pop_front();
    return out;
  }

  void build_tail() {
    if (drop_last || (first_indices.empty() && first_batches.empty())) return;
    if (!even_batches) {
      if (pending) tail.push_back(*pending);
      return;
    }
    if (pending && full(*pending)) tail.push_back(*pending);
    // See Note [Completing the last round].
    if (batch_size) {
      while (static_cast<int64_t>(first_indices.size()) < num_processes * *batch_size) {
        first_indices.insert(first_indices.end(), first_indices.begin(), first_indices.end());
      }
    } else {
      while (static_cast<int64_t>(first_batches.size()) < num_processes) {
        const auto copy = first_batches;
        first_batches.insert(first_batches.end(), copy.begin(), copy.end());
      }
    }
    std::vector<int64_t> batch = last;
    int64_t i = index;
    if (full(batch)) {  // the last batch was handed out with its round
      batch.clear();
      ++i;
    }
    size_t cursor = 0;
    while (i % num_processes != 0 || !batch.empty()) {
      if (!batch_size) {
        batch = first_batches[cursor++];
      } else {
        const size_t end = std::min(first_indices.size(), cursor + static_cast<size_t>(*batch_size) - batch.size());
        batch.insert(batch.end(), first_indices.begin() + static_cast<std::ptrdiff_t>(cursor),
                     first_indices.begin() + static_cast<std::ptrdiff_t>(end));
        cursor = end;
      }
      if (i % num_processes == process_index) tail.push_back(batch);
      batch.clear();
      ++i;
    }
  }
};

}  // namespace

IndexBatchGenerator BatchSamplerShard::iter_without_split() {
  auto state = std::make_shared<UnsplitShardState>(UnsplitShardState{
      batch_sampler_->iter(), num_processes_, process_index_, batch_size(), drop_last(), options_.even_batches});
  return [state]() { return state->next(); };
}

IndexBatchGenerator BatchSamplerShard::iter_with_split() {
  const int64_t bs = *batch_size();
  const int64_t slice = bs / num_processes_;
  const int64_t begin = slice * process_index_;
  const int64_t end = begin + slice;
  return [batches = batch_sampler_->iter(), bs, begin, end, drop_last = drop_last(), even = options_.even_batches,
          first = std::vector<int64_t>(), last = std::vector<int64_t>(), any = false, sampler_ended = false,
          tail_done = false]() mutable -> std::optional<std::vector<int64_t>> {
    while (!sampler_ended) {
      auto batch = batches();
      if (!batch) {
        sampler_ended = true;
        break;
      }
      if (!any) {
        first = *batch;
        any = true;
      }
      std::optional<std::vector<int64_t>> out;
      if (static_cast<int64_t>(batch->size()) == bs) out = slice_of(*batch, begin, end);
      last = std::move(*batch);
      if (out) return out;
    }
    if (tail_done) return std::nullopt;
    tail_done = true;
    if (drop_last || !any || static_cast<int64_t>(last.size()) >= bs) return std::nullopt;
    if (!even) {
      if (static_cast<int64_t>(last.size()) > begin) return slice_of(last, begin, end);
      return std::nullopt;
    }
    // See Note [Completing the last round].
    while (static_cast<int64_t>(first.size()) < bs) first.insert(first.end(), first.begin(), first.end());
    last.insert(last.end(), first.begin(), first.end());
    return slice_of(last, begin, end);
  };
}

}  // namespace accelerate
