// Batch samplers: indices in batches, a given list of batches, and the first batches skipped
// (upstream's SkipBatchSampler). The per-process shard of a batch sampler is in
// batch_sampler_shard.cpp.
#include "accelerate/data_loader.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace accelerate {

// ---- batch samplers -------------------------------------------------------------------------

BatchSampler::BatchSampler(std::shared_ptr<Sampler> sampler, int64_t batch_size, bool drop_last)
    : sampler_(std::move(sampler)), batch_size_(batch_size), drop_last_(drop_last) {
  TORCH_CHECK_VALUE(sampler_ != nullptr, "[BatchSampler] expected a sampler, got null");
  TORCH_CHECK_VALUE(batch_size >= 1, "[BatchSampler] batch_size must be a positive integer, got ", batch_size);
}

int64_t BatchSampler::size() const {
  TORCH_CHECK(sampler_ != nullptr && batch_size_,
              "[BatchSampler] a batch sampler without a sampler must override size()");
  const int64_t n = sampler_->size();
  const int64_t bs = *batch_size_;
  return drop_last_ ? n / bs : (n + bs - 1) / bs;
}

IndexBatchGenerator BatchSampler::iter() {
  TORCH_CHECK(sampler_ != nullptr && batch_size_,
              "[BatchSampler] a batch sampler without a sampler must override iter()");
  return [indices = sampler_->iter(), bs = *batch_size_, drop_last = drop_last_,
          ended = false]() mutable -> std::optional<std::vector<int64_t>> {
    if (ended) return std::nullopt;
    std::vector<int64_t> batch;
    batch.reserve(static_cast<size_t>(bs));
    while (static_cast<int64_t>(batch.size()) < bs) {
      auto index = indices();
      if (!index) {
        ended = true;
        break;
      }
      batch.push_back(*index);
    }
    if (batch.empty() || (drop_last && static_cast<int64_t>(batch.size()) < bs)) return std::nullopt;
    return batch;
  };
}

void BatchSampler::set_epoch(int64_t epoch) {
  if (sampler_) sampler_->set_epoch(epoch);
}

std::optional<at::Generator> BatchSampler::generator() const { return sampler_ ? sampler_->generator() : std::nullopt; }

ListBatchSampler::ListBatchSampler(std::vector<std::vector<int64_t>> batches, bool drop_last)
    : BatchSampler(std::nullopt, drop_last),
      batches_(std::make_shared<const std::vector<std::vector<int64_t>>>(std::move(batches))) {}

IndexBatchGenerator ListBatchSampler::iter() {
  return [batches = batches_, next = size_t{0}]() mutable -> std::optional<std::vector<int64_t>> {
    if (next >= batches->size()) return std::nullopt;
    return (*batches)[next++];
  };
}

SkipBatchSampler::SkipBatchSampler(std::shared_ptr<BatchSampler> batch_sampler, int64_t skip_batches)
    : BatchSampler(batch_sampler ? batch_sampler->batch_size() : std::nullopt,
                   batch_sampler ? batch_sampler->drop_last() : false),
      batch_sampler_(std::move(batch_sampler)),
      skip_batches_(skip_batches) {
  TORCH_CHECK_VALUE(batch_sampler_ != nullptr, "[SkipBatchSampler] expected a batch sampler, got null");
  TORCH_CHECK_VALUE(skip_batches >= 0, "[SkipBatchSampler] skip_batches must be >= 0, got ", skip_batches);
}

int64_t SkipBatchSampler::size() const { return std::max<int64_t>(0, batch_sampler_->size() - skip_batches_); }

IndexBatchGenerator SkipBatchSampler::iter() {
  return [batches = batch_sampler_->iter(), skip = skip_batches_]() mutable -> std::optional<std::vector<int64_t>> {
    for (; skip > 0; --skip) {
      if (!batches()) return std::nullopt;
    }
    return batches();
  };
}

}  // namespace accelerate
