// `IterableDatasetShard`: each process's samples of an iterable dataset.
#include "accelerate/data_loader.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace accelerate {

// ---- iterable shards ------------------------------------------------------------------------

IterableDatasetShard::IterableDatasetShard(std::shared_ptr<IterableDataset> dataset,
                                           IterableDatasetShardOptions options)
    : dataset_(std::move(dataset)), options_(options) {
  TORCH_CHECK_VALUE(dataset_ != nullptr, "[IterableDatasetShard] expected a dataset, got null");
  TORCH_CHECK_VALUE(options.batch_size >= 1, "[IterableDatasetShard] batch_size must be a positive integer, got ",
                    options.batch_size);
  TORCH_CHECK_VALUE(options.num_processes >= 1, "[IterableDatasetShard] num_processes must be >= 1, got ",
                    options.num_processes);
  TORCH_CHECK_INDEX(options.process_index >= 0 && options.process_index < options.num_processes,
                    "[IterableDatasetShard] process_index must be in [0, ", options.num_processes, "), got ",
                    options.process_index);
  TORCH_CHECK_VALUE(!options.split_batches || options.batch_size % options.num_processes == 0,
                    "[IterableDatasetShard] split_batches needs a batch size that is a round multiple of the number "
                    "of processes (",
                    options.num_processes, "), got ", options.batch_size);
}

int64_t IterableDatasetShard::round_size() const {
  return options_.split_batches ? options_.batch_size : options_.batch_size * options_.num_processes;
}

int64_t IterableDatasetShard::process_batch_size() const {
  return options_.split_batches ? options_.batch_size / options_.num_processes : options_.batch_size;
}

std::optional<int64_t> IterableDatasetShard::size() const {
  const auto total = dataset_->size();
  if (!total) return std::nullopt;
  // Whole rounds (a short last one completed unless drop_last), each giving this process its
  // share. Without split_batches this is upstream's formula; with it, upstream counts rounds of
  // batch_size × num_processes samples, which is not what a pass yields.
  const int64_t round = round_size();
  const int64_t rounds = options_.drop_last ? *total / round : (*total + round - 1) / round;
  return rounds * process_batch_size();
}

void IterableDatasetShard::set_epoch(int64_t epoch) { dataset_->set_epoch(epoch); }

ExampleGenerator IterableDatasetShard::iter() {
  struct State {
    ExampleGenerator samples;
    int64_t round;
    int64_t begin;
    int64_t end;
    bool drop_last;
    std::vector<Example> current{};
    std::vector<Example> first{};
    std::deque<Example> ready{};
    bool ended = false;

    void emit() {
      for (int64_t i = begin; i < end; ++i) ready.push_back(current[static_cast<size_t>(i)]);
    }
    std::optional<Example> next() {
      while (ready.empty()) {
        if (ended) return std::nullopt;
        auto sample = samples();
        if (sample) {
          current.push_back(std::move(*sample));
          if (static_cast<int64_t>(current.size()) == round) {
            emit();
            if (first.empty()) first = current;
            current.clear();
          }
          continue;
        }
        ended = true;
        if (drop_last || current.empty()) continue;
        // Complete the short last round with the first samples of the stream.
        if (first.empty()) first = current;
        while (static_cast<int64_t>(current.size()) < round) current.insert(current.end(), first.begin(), first.end());
        emit();
      }
      auto out = std::move(ready.front());
      ready.pop_front();
      return out;
    }
  };
  const int64_t share = process_batch_size();
  auto state = std::make_shared<State>(State{dataset_->iter(), round_size(), share * options_.process_index,
                                             share * (options_.process_index + 1), options_.drop_last});
  return [state]() { return state->next(); };
}

}  // namespace accelerate
