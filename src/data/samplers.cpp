// Samplers of indices: in order, shuffled, and shuffled from a seed and the epoch (upstream's
// SeedableRandomSampler, which every process draws alike).
#include "accelerate/data_loader.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace accelerate {

// ---- samplers -------------------------------------------------------------------------------

namespace {

// The indices of `values` one by one.
IndexGenerator generate_from(std::shared_ptr<const std::vector<int64_t>> values) {
  return [values = std::move(values), next = size_t{0}]() mutable -> std::optional<int64_t> {
    if (next >= values->size()) return std::nullopt;
    return (*values)[next++];
  };
}

// Upstream draws the seed of a sampler without a generator from the default generator.
at::Generator seeded_from_default_generator() {
  auto default_generator = at::detail::getDefaultCPUGenerator();
  uint64_t seed = 0;
  {
    std::lock_guard<std::mutex> lock(default_generator.mutex());
    seed = default_generator.get<at::CPUGeneratorImpl>()->random64();
  }
  return at::make_generator<at::CPUGeneratorImpl>(seed);
}

uint64_t default_initial_seed() { return at::detail::getDefaultCPUGenerator().current_seed(); }

}  // namespace

SequentialSampler::SequentialSampler(int64_t size) : size_(size) {
  TORCH_CHECK_VALUE(size >= 0, "[SequentialSampler] size must be >= 0, got ", size);
}

IndexGenerator SequentialSampler::iter() {
  return [next = int64_t{0}, size = size_]() mutable -> std::optional<int64_t> {
    if (next >= size) return std::nullopt;
    return next++;
  };
}

RandomSampler::RandomSampler(int64_t data_size, RandomSamplerOptions options)
    : data_size_(data_size),
      replacement_(options.replacement),
      num_samples_(options.num_samples.value_or(data_size)),
      generator_(options.generator ? *options.generator : seeded_from_default_generator()) {
  TORCH_CHECK_VALUE(data_size >= 0, "[RandomSampler] data_size must be >= 0, got ", data_size);
  TORCH_CHECK_VALUE(num_samples_ >= 0, "[RandomSampler] num_samples must be >= 0, got ", num_samples_);
  TORCH_CHECK_VALUE(num_samples_ == 0 || data_size > 0, "[RandomSampler] cannot draw ", num_samples_,
                    " samples from an empty dataset");
  TORCH_CHECK_VALUE(generator_.defined(), "[RandomSampler] expected a generator, got an undefined one");
}

std::vector<int64_t> RandomSampler::draw() {
  // The same sequence of draws as PyTorch's RandomSampler, so that a generator state gives the
  // same order in both.
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(num_samples_));
  auto append = [&](const at::Tensor& t) {
    const auto c = t.contiguous();
    const int64_t* p = c.data_ptr<int64_t>();
    out.insert(out.end(), p, p + c.numel());
  };
  if (replacement_) {
    for (int64_t i = 0; i < num_samples_ / 32; ++i) append(at::randint(data_size_, {32}, generator_, at::kLong));
    append(at::randint(data_size_, {num_samples_ % 32}, generator_, at::kLong));
  } else if (data_size_ > 0) {
    for (int64_t i = 0; i < num_samples_ / data_size_; ++i) append(at::randperm(data_size_, generator_, at::kLong));
    append(at::randperm(data_size_, generator_, at::kLong).slice(0, 0, num_samples_ % data_size_));
  }
  return out;
}

IndexGenerator RandomSampler::iter() { return generate_from(std::make_shared<const std::vector<int64_t>>(draw())); }

namespace {
RandomSamplerOptions with_seeded_generator(RandomSamplerOptions options, uint64_t seed) {
  if (!options.generator) options.generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return options;
}
}  // namespace

SeedableRandomSampler::SeedableRandomSampler(int64_t data_size, RandomSamplerOptions options,
                                             std::optional<uint64_t> data_seed)
    : RandomSampler(data_size, with_seeded_generator(std::move(options), data_seed.value_or(default_initial_seed()))),
      initial_seed_(data_seed.value_or(default_initial_seed())),
      epoch_(std::make_shared<std::atomic<int64_t>>(0)) {}

IndexGenerator SeedableRandomSampler::iter() {
  {
    std::lock_guard<std::mutex> lock(generator_.mutex());
    generator_.set_current_seed(initial_seed_ + static_cast<uint64_t>(epoch_->load()));
  }
  auto indices = std::make_shared<const std::vector<int64_t>>(draw());
  // A pass that runs to its end moves to the next epoch, as upstream's does.
  return [indices, epoch = epoch_, next = size_t{0}, ended = false]() mutable -> std::optional<int64_t> {
    if (next < indices->size()) return (*indices)[next++];
    if (!ended) {
      ended = true;
      epoch->fetch_add(1);
    }
    return std::nullopt;
  };
}

void SeedableRandomSampler::set_epoch(int64_t epoch) { epoch_->store(epoch); }

int64_t SeedableRandomSampler::epoch() const { return epoch_->load(); }

}  // namespace accelerate
