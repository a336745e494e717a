// Data loaders, samplers, sharding and dispatching; see include/accelerate/data_loader.h.
#include "accelerate/data_loader.h"
#include "accelerate/utils/random.h"

#include "accelerate/utils/operations.h"
#include "detail/collectives.h"
#include "detail/errors.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <typeinfo>

namespace accelerate {

// ---- collate --------------------------------------------------------------------------------

namespace {

std::string join_keys(const std::map<std::string, c10::IValue>& fields) {
  std::string out = "{";
  const char* sep = "";
  for (const auto& [key, value] : fields) {
    out += sep + key;
    sep = ", ";
  }
  return out + "}";
}

at::Tensor stack_tensors(const std::vector<at::Tensor>& column, const std::string& what) {
  const auto& first = column.front();
  for (size_t i = 1; i < column.size(); ++i) {
    TORCH_CHECK_VALUE(column[i].sizes() == first.sizes(), "[default_collate] cannot stack ", what,
                      ": every sample must have the same shape, but sample 0 has ", first.sizes(), " and sample ", i,
                      " has ", column[i].sizes());
  }
  return at::stack(column);
}

// One collated field: tensors stacked, numbers and booleans as a 1-dim tensor, anything else as
// the list of the samples' values.
c10::IValue collate_field(const std::vector<c10::IValue>& values, const std::string& key) {
  auto all = [&](auto pred) { return std::all_of(values.begin(), values.end(), pred); };
  if (all([](const c10::IValue& v) { return v.isTensor(); })) {
    std::vector<at::Tensor> column;
    column.reserve(values.size());
    for (const auto& v : values) column.push_back(v.toTensor());
    return stack_tensors(column, "field '" + key + "'");
  }
  if (all([](const c10::IValue& v) { return v.isBool(); })) {
    auto out = at::empty({static_cast<int64_t>(values.size())}, at::kBool);
    auto* p = out.data_ptr<bool>();
    for (size_t i = 0; i < values.size(); ++i) p[i] = values[i].toBool();
    return out;
  }
  if (all([](const c10::IValue& v) { return v.isInt(); })) {
    std::vector<int64_t> column;
    for (const auto& v : values) column.push_back(v.toInt());
    return at::tensor(column, at::kLong);
  }
  if (all([](const c10::IValue& v) { return v.isInt() || v.isDouble(); })) {
    std::vector<double> column;
    for (const auto& v : values) column.push_back(v.isInt() ? static_cast<double>(v.toInt()) : v.toDouble());
    return at::tensor(column, at::kDouble);
  }
  const auto type = values.front().type();
  const bool same_type = all([&](const c10::IValue& v) { return *v.type() == *type; });
  c10::impl::GenericList list(same_type ? type : c10::AnyType::get());
  list.reserve(values.size());
  for (const auto& v : values) list.push_back(v);
  return list;
}

}  // namespace

Example default_collate(std::vector<Example> samples) {
  TORCH_CHECK_VALUE(!samples.empty(), "[default_collate] expected at least one sample, got an empty batch");
  const size_t n = samples.size();
  auto tensor_column = [&](at::Tensor Example::*member, const char* name) -> at::Tensor {
    const bool defined = (samples[0].*member).defined();
    std::vector<at::Tensor> column;
    column.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& t = samples[i].*member;
      TORCH_CHECK_VALUE(t.defined() == defined, "[default_collate] every sample must have ", name,
                        " or none must: sample 0 ", defined ? "has" : "has none", ", sample ", i,
                        t.defined() ? " has" : " has none");
      if (defined) column.push_back(t);
    }
    return defined ? stack_tensors(column, name) : at::Tensor();
  };
  Example out;
  out.data = tensor_column(&Example::data, "data");
  out.target = tensor_column(&Example::target, "target");
  const auto& first = samples[0].fields;
  for (size_t i = 1; i < n; ++i) {
    const auto& fields = samples[i].fields;
    const bool same =
        fields.size() == first.size() && std::equal(fields.begin(), fields.end(), first.begin(),
                                                    [](const auto& a, const auto& b) { return a.first == b.first; });
    TORCH_CHECK_VALUE(same, "[default_collate] every sample must have the same fields: sample 0 has ", join_keys(first),
                      ", sample ", i, " has ", join_keys(fields));
  }
  for (const auto& [key, unused] : first) {
    std::vector<c10::IValue> values;
    values.reserve(n);
    for (auto& sample : samples) values.push_back(std::move(sample.fields.at(key)));
    out.fields.emplace(key, collate_field(values, key));
  }
  return out;
}

// ---- datasets -------------------------------------------------------------------------------

TensorDataset::TensorDataset(at::Tensor data, at::Tensor target) : data_(std::move(data)), target_(std::move(target)) {
  TORCH_CHECK_VALUE(data_.defined() && data_.dim() >= 1,
                    "[TensorDataset] expected a data tensor with a first dimension, got ",
                    data_.defined() ? "a 0-dim tensor" : "an undefined tensor");
  if (target_.defined()) {
    TORCH_CHECK_VALUE(target_.dim() >= 1 && target_.size(0) == data_.size(0),
                      "[TensorDataset] data and target must have the same first dimension, got ", data_.size(0),
                      " and ", target_.dim() >= 1 ? std::to_string(target_.size(0)) : std::string("a 0-dim target"));
  }
}

int64_t TensorDataset::size() const { return data_.size(0); }

Example TensorDataset::get(int64_t index) {
  TORCH_CHECK_INDEX(index >= 0 && index < size(), "[TensorDataset] index ", index, " is outside [0, ", size(), ")");
  return Example{data_.select(0, index), target_.defined() ? target_.select(0, index) : at::Tensor(), {}};
}

std::optional<Example> TensorDataset::get_batch(const std::vector<int64_t>& indices) {
  const auto index = at::tensor(indices, at::kLong);
  return Example{data_.index_select(0, index), target_.defined() ? target_.index_select(0, index) : at::Tensor(), {}};
}

namespace {

class FunctionDataset final : public Dataset {
 public:
  FunctionDataset(int64_t size, std::function<Example(int64_t)> get) : size_(size), get_(std::move(get)) {}
  int64_t size() const override { return size_; }
  Example get(int64_t index) override { return get_(index); }

 private:
  int64_t size_;
  std::function<Example(int64_t)> get_;
};

class FunctionIterableDataset final : public IterableDataset {
 public:
  FunctionIterableDataset(std::function<ExampleGenerator()> iter, std::optional<int64_t> size)
      : iter_(std::move(iter)), size_(size) {}
  ExampleGenerator iter() override { return iter_(); }
  std::optional<int64_t> size() const override { return size_; }

 private:
  std::function<ExampleGenerator()> iter_;
  std::optional<int64_t> size_;
};

}  // namespace

std::shared_ptr<Dataset> make_dataset(int64_t size, std::function<Example(int64_t)> get) {
  TORCH_CHECK_VALUE(size >= 0, "[make_dataset] size must be >= 0, got ", size);
  TORCH_CHECK_VALUE(static_cast<bool>(get), "[make_dataset] expected a function returning sample i, got an empty one");
  return std::make_shared<FunctionDataset>(size, std::move(get));
}

std::shared_ptr<IterableDataset> make_iterable_dataset(std::function<ExampleGenerator()> iter,
                                                       std::optional<int64_t> size) {
  TORCH_CHECK_VALUE(static_cast<bool>(iter),
                    "[make_iterable_dataset] expected a function starting a pass, got an empty one");
  TORCH_CHECK_VALUE(!size || *size >= 0, "[make_iterable_dataset] size must be >= 0, got ", size.value_or(0));
  return std::make_shared<FunctionIterableDataset>(std::move(iter), size);
}

void data_detail::throw_unsized_torch_dataset() {
  C10_THROW_ERROR(ValueError, c10::str("[make_dataset] expected a LibTorch dataset with a known size, got one whose size() is "
                    "empty; read it through an IterableDataset instead"));
  TORCH_INTERNAL_ASSERT(false);
}

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

// ---- the loader's machinery -----------------------------------------------------------------

namespace detail {

enum class LoaderKind { kPlain, kShard, kDispatcher };

struct DataLoaderImpl {
  // What is read and how.
  std::shared_ptr<Dataset> dataset;
  std::shared_ptr<IterableDataset> iterable;
  std::shared_ptr<BatchSampler> batch_sampler;  // map-style only
  std::optional<int64_t> batch_size;            // of the batches this loader yields
  std::optional<int64_t> total_batch_size;
  bool drop_last = false;
  CollateFn collate;
  bool default_collate = true;  // then a dataset's get_batch may replace get + collate
  int num_workers = 0;
  int prefetch_factor = 2;

  // Preparation.
  LoaderKind kind = LoaderKind::kPlain;
  std::optional<PartialState> state;
  std::optional<GradientState> gradient_state;
  std::optional<c10::Device> device;
  bool non_blocking = false;
  int num_processes = 1;
  int process_index = 0;
  bool split_batches = false;
  bool use_stateful = false;
  bool synchronize_generator = false;
  std::vector<std::string> rng_types;  // global generators synchronised at each pass ("torch", "cuda")
  std::shared_ptr<DataLoaderImpl> base;  // dispatcher: the unsharded loader the main process reads
  SliceFn slice_fn;
  int64_t skip_batches = 0;

  // Progress, touched by the thread that iterates.
  int64_t iteration = 0;
  int64_t position = 0;  // batches of the current pass consumed, skipped ones included
  bool in_pass = false;
  bool last_pass_finished = false;
  bool end_of_dataloader = false;
  int64_t remainder = -1;
  std::string pass_generator_state;
  std::optional<int64_t> resume_position;
};

namespace {

void reset_progress(DataLoaderImpl& impl) {
  impl.position = 0;
  impl.in_pass = false;
  impl.last_pass_finished = false;
  impl.end_of_dataloader = false;
  impl.remainder = -1;
  impl.pass_generator_state.clear();
  impl.resume_position.reset();
}

std::optional<at::Generator> generator_of(const DataLoaderImpl& impl) {
  if (impl.kind == LoaderKind::kDispatcher) return generator_of(*impl.base);
  return impl.batch_sampler ? impl.batch_sampler->generator() : std::nullopt;
}

std::string generator_state_hex(at::Generator generator) {
  at::Tensor state;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    state = generator.get_state();
  }
  static const char* digits = "0123456789abcdef";
  const auto* bytes = state.contiguous().data_ptr<uint8_t>();
  std::string out;
  out.reserve(static_cast<size_t>(state.numel()) * 2);
  for (int64_t i = 0; i < state.numel(); ++i) {
    out.push_back(digits[bytes[i] >> 4]);
    out.push_back(digits[bytes[i] & 0xF]);
  }
  return out;
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool is_hex(const std::string& text) {
  return text.size() % 2 == 0 && std::all_of(text.begin(), text.end(), [](char c) { return hex_digit(c) >= 0; });
}

void set_generator_state_hex(at::Generator generator, const std::string& hex, const char* api) {
  TORCH_CHECK_VALUE(is_hex(hex), "[", api, "] expected the generator state as an even number of hex digits, got ",
                    hex.size(), " characters");
  auto state = at::empty({static_cast<int64_t>(hex.size() / 2)}, at::kByte);
  auto* bytes = state.data_ptr<uint8_t>();
  for (size_t i = 0; i < hex.size() / 2; ++i) {
    bytes[i] = static_cast<uint8_t>(hex_digit(hex[2 * i]) * 16 + hex_digit(hex[2 * i + 1]));
  }
  std::lock_guard<std::mutex> lock(generator.mutex());
  try {
    generator.set_state(state);
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(ValueError, c10::str("[", api, "] the generator refused the saved state (", state.numel(),
                      " bytes): ", e.what_without_backtrace()));
  }
}

// Copies process 0's generator state to every process (upstream: synchronize_rng_states with
// "generator").
void synchronize_generator(const PartialState& state, at::Generator generator) {
  std::vector<char> bytes;
  if (state.is_main_process()) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    const auto s = generator.get_state().contiguous();
    const auto* p = reinterpret_cast<const char*>(s.data_ptr<uint8_t>());
    bytes.assign(p, p + s.numel());
  }
  bytes = detail::broadcast_bytes(state, bytes, 0, "DataLoader");
  if (state.is_main_process()) return;
  auto s = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  std::memcpy(s.data_ptr<uint8_t>(), bytes.data(), bytes.size());
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(s);
}

void set_epoch_everywhere(const DataLoaderImpl& impl, int64_t epoch) {
  if (impl.base) return set_epoch_everywhere(*impl.base, epoch);  // the dispatcher's reader
  if (impl.batch_sampler) impl.batch_sampler->set_epoch(epoch);
  if (impl.dataset) impl.dataset->set_epoch(epoch);
  if (impl.iterable) impl.iterable->set_epoch(epoch);
}

int64_t dataset_length(const DataLoaderImpl& impl) {
  if (impl.kind == LoaderKind::kDispatcher) return dataset_length(*impl.base);
  if (impl.dataset) return impl.dataset->size();
  const auto shard = std::dynamic_pointer_cast<IterableDatasetShard>(impl.iterable);
  const auto length = shard ? shard->total_length() : impl.iterable->size();
  TORCH_CHECK_VALUE(length.has_value(), "[DataLoader] the length of an iterable dataset of unknown size was asked for");
  return *length;
}

int64_t loader_size(const DataLoaderImpl& impl) {
  int64_t size = 0;
  if (impl.kind == LoaderKind::kDispatcher) {
    const int64_t whole = loader_size(*impl.base);
    const int64_t n = impl.state->num_processes();
    size = impl.split_batches ? whole : impl.drop_last ? whole / n : (whole + n - 1) / n;
  } else if (impl.iterable) {
    const auto samples = impl.iterable->size();
    TORCH_CHECK_VALUE(samples.has_value(),
                      "[DataLoader] size() needs an iterable dataset of known size, got one whose "
                      "size() is empty");
    const int64_t bs = *impl.batch_size;
    size = impl.drop_last ? *samples / bs : (*samples + bs - 1) / bs;
  } else {
    size = impl.batch_sampler->size();
  }
  return std::max<int64_t>(0, size - impl.skip_batches);
}

// ---- batches loaded in order, on the caller's thread or on workers ----

using Task = std::function<Example()>;
using TaskSource = std::function<std::optional<Task>()>;

// Which batches of a pass are loaded: the first `keep`, then `skip` are passed over without
// loading, then all the others.
struct SkipPlan {
  int64_t keep = 0;
  int64_t skip = 0;
};

// Note [Ordered prefetching]
// Workers take tasks in order under one lock (pulling the next batch of indices or samples is
// sequential and cheap), then load and collate outside it. Results are delivered strictly in
// task order; at most num_workers × prefetch_factor tasks run ahead of the consumer. A task's
// error is stored in its place and rethrown when the consumer reaches it.
class BatchStream {
 public:
  BatchStream(TaskSource source, int num_workers, int prefetch_factor)
      : source_(std::move(source)), max_ahead_(static_cast<int64_t>(num_workers) * prefetch_factor) {
    try {
      for (int i = 0; i < num_workers; ++i) workers_.emplace_back([this] { work(); });
    } catch (...) {
      stop();
      throw;
    }
  }
  ~BatchStream() { stop(); }
  BatchStream(const BatchStream&) = delete;
  BatchStream& operator=(const BatchStream&) = delete;

  std::optional<Example> next() {
    if (workers_.empty()) {
      if (exhausted_) return std::nullopt;
      auto task = source_();
      if (!task) {
        exhausted_ = true;
        return std::nullopt;
      }
      return (*task)();
    }
    std::unique_lock<std::mutex> lock(mutex_);
    result_ready_.wait(lock, [&] { return results_.count(delivered_) > 0 || (exhausted_ && delivered_ >= issued_); });
    auto it = results_.find(delivered_);
    if (it == results_.end()) return std::nullopt;
    Result result = std::move(it->second);
    results_.erase(it);
    ++delivered_;
    lock.unlock();
    room_.notify_all();
    if (result.error) std::rethrow_exception(result.error);
    return std::move(result.batch);
  }

 private:
  struct Result {
    Example batch;
    std::exception_ptr error;
  };

  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      room_.wait(lock, [&] { return stop_ || exhausted_ || issued_ < delivered_ + max_ahead_; });
      if (stop_ || exhausted_) return;
      const int64_t seq = issued_;
      std::optional<Task> task;
      std::exception_ptr error;
      try {
        task = source_();
      } catch (...) {
        error = std::current_exception();
      }
      if (!task) {
        exhausted_ = true;
        if (error) {
          results_.emplace(seq, Result{{}, error});
          issued_ = seq + 1;
        }
        result_ready_.notify_all();
        room_.notify_all();
        return;
      }
      issued_ = seq + 1;
      lock.unlock();
      Result result;
      try {
        result.batch = (*task)();
      } catch (...) {
        result.error = std::current_exception();
      }
      task.reset();
      lock.lock();
      results_.emplace(seq, std::move(result));
      result_ready_.notify_all();
    }
  }

  void stop() noexcept {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    room_.notify_all();
    result_ready_.notify_all();
    for (auto& worker : workers_) {
      if (worker.joinable()) worker.join();
    }
  }

  TaskSource source_;
  const int64_t max_ahead_;
  std::mutex mutex_;
  std::condition_variable room_;
  std::condition_variable result_ready_;
  int64_t issued_ = 0;
  int64_t delivered_ = 0;
  bool exhausted_ = false;
  bool stop_ = false;
  std::map<int64_t, Result> results_;
  std::vector<std::thread> workers_;
};

Example load_batch(Dataset& dataset, const std::vector<int64_t>& indices, const CollateFn& collate, bool batched_read) {
  const int64_t size = dataset.size();
  for (const int64_t index : indices) {
    TORCH_CHECK_INDEX(index >= 0 && index < size, "[DataLoader] the sampler yielded index ", index,
                      ", outside the dataset's ", size, " samples [0, ", size, ")");
  }
  if (batched_read && !indices.empty()) {
    std::optional<Example> batch;
    try {
      batch = dataset.get_batch(indices);
    } catch (const std::exception& e) {
      C10_THROW_ERROR(Error, c10::str("[DataLoader] loading a batch of ", indices.size(), " samples from index ",
                  indices.empty() ? -1 : indices.front(), " failed: dataset.get_batch threw: ", error_message(e)));
    }
    if (batch) return std::move(*batch);
  }
  std::vector<Example> samples;
  samples.reserve(indices.size());
  for (const int64_t index : indices) {
    try {
      samples.push_back(dataset.get(index));
    } catch (const std::exception& e) {
      C10_THROW_ERROR(Error, c10::str("[DataLoader] loading sample ", index, " failed: dataset.get(", index,
                  ") threw: ", error_message(e)));
    }
  }
  return collate(std::move(samples));
}

TaskSource map_tasks(std::shared_ptr<Dataset> dataset, IndexBatchGenerator batches, CollateFn collate,
                     bool batched_read, SkipPlan plan) {
  return [dataset = std::move(dataset), batches = std::move(batches), collate = std::move(collate), batched_read, plan,
          emitted = int64_t{0}]() mutable -> std::optional<Task> {
    if (emitted >= plan.keep) {
      for (; plan.skip > 0; --plan.skip) {
        if (!batches()) return std::nullopt;
      }
    }
    auto indices = batches();
    if (!indices) return std::nullopt;
    ++emitted;
    return Task([dataset, collate, batched_read, indices = std::move(*indices)] {
      return load_batch(*dataset, indices, collate, batched_read);
    });
  };
}

TaskSource iterable_tasks(ExampleGenerator samples, int64_t batch_size, bool drop_last, CollateFn collate,
                          SkipPlan plan) {
  return [samples = std::move(samples), batch_size, drop_last, collate = std::move(collate), plan, read = int64_t{0},
          emitted = int64_t{0}]() mutable -> std::optional<Task> {
    auto take = [&]() -> std::optional<std::vector<Example>> {
      std::vector<Example> batch;
      batch.reserve(static_cast<size_t>(batch_size));
      while (static_cast<int64_t>(batch.size()) < batch_size) {
        std::optional<Example> sample;
        try {
          sample = samples();
        } catch (const std::exception& e) {
          C10_THROW_ERROR(Error, c10::str("[DataLoader] reading sample ", read,
                      " of the iterable dataset failed: ", error_message(e)));
        }
        if (!sample) break;
        ++read;
        batch.push_back(std::move(*sample));
      }
      if (batch.empty() || (drop_last && static_cast<int64_t>(batch.size()) < batch_size)) return std::nullopt;
      return batch;
    };
    if (emitted >= plan.keep) {
      for (; plan.skip > 0; --plan.skip) {
        if (!take()) return std::nullopt;
      }
    }
    auto batch = take();
    if (!batch) return std::nullopt;
    ++emitted;
    return Task([collate, batch = std::move(*batch)]() mutable { return collate(std::move(batch)); });
  };
}

std::unique_ptr<BatchStream> open_stream(const DataLoaderImpl& impl, SkipPlan plan) {
  TaskSource source =
      impl.iterable ? iterable_tasks(impl.iterable->iter(), *impl.batch_size, impl.drop_last, impl.collate, plan)
                    : map_tasks(impl.dataset, impl.batch_sampler->iter(), impl.collate, impl.default_collate, plan);
  return std::make_unique<BatchStream>(std::move(source), impl.num_workers, impl.prefetch_factor);
}

// ---- batches as delivered: with the knowledge of whether each is the last ----

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

// Reads one batch ahead, to know when the current one is the last.
class LookAheadSource final : public StepSource {
 public:
  explicit LookAheadSource(std::unique_ptr<BatchStream> stream) : stream_(std::move(stream)) {}
  std::optional<Step> next() override {
    if (!primed_) {
      primed_ = true;
      pending_ = stream_->next();
    }
    if (!pending_) return std::nullopt;
    Step step{std::move(*pending_)};
    pending_.reset();
    pending_ = stream_->next();
    step.last = !pending_;
    return step;
  }

 private:
  std::unique_ptr<BatchStream> stream_;
  std::optional<Example> pending_;
  bool primed_ = false;
};

int64_t rows_of(const Example& batch) {
  if (batch.data.defined() && batch.data.dim() >= 1) return batch.data.size(0);
  if (batch.target.defined() && batch.target.dim() >= 1) return batch.target.size(0);
  for (const auto& [key, value] : batch.fields) {
    if (value.isTensor() && value.toTensor().dim() >= 1) return value.toTensor().size(0);
  }
  for (const auto& [key, value] : batch.fields) {
    if (value.isList()) return static_cast<int64_t>(value.toListRef().size());
  }
  C10_THROW_ERROR(ValueError, c10::str("[DataLoaderDispatcher] cannot tell the batch size: the batch holds no tensor with a first "
                    "dimension and no list"));
}

c10::IValue slice_value(const c10::IValue& value, int64_t start, int64_t end) {
  if (value.isTensor() && value.toTensor().dim() >= 1) return value.toTensor().slice(0, start, end);
  if (value.isList()) {
    auto list = value.toList();
    c10::impl::GenericList out(list.elementType());
    const auto n = static_cast<int64_t>(list.size());
    for (int64_t i = std::min(start, n); i < std::min(end, n); ++i) out.push_back(list.get(static_cast<size_t>(i)));
    return out;
  }
  return value;
}

Example slice_example(const Example& batch, int64_t start, int64_t end) {
  Example out;
  if (batch.data.defined()) out.data = batch.data.slice(0, start, end);
  if (batch.target.defined()) out.target = batch.target.slice(0, start, end);
  for (const auto& [key, value] : batch.fields) out.fields.emplace(key, slice_value(value, start, end));
  return out;
}

Example concatenate_examples(const std::vector<Example>& parts) {
  auto column = [&](at::Tensor Example::*member) -> at::Tensor {
    std::vector<at::Tensor> tensors;
    for (const auto& part : parts) {
      if ((part.*member).defined()) tensors.push_back(part.*member);
    }
    TORCH_CHECK_VALUE(tensors.empty() || tensors.size() == parts.size(),
                      "[DataLoaderDispatcher] every batch must hold the same tensors");
    return tensors.empty() ? at::Tensor() : at::cat(tensors);
  };
  Example out;
  out.data = column(&Example::data);
  out.target = column(&Example::target);
  for (const auto& [key, first] : parts.front().fields) {
    if (first.isTensor()) {
      std::vector<at::Tensor> tensors;
      for (const auto& part : parts) tensors.push_back(part.fields.at(key).toTensor());
      out.fields.emplace(key, at::cat(tensors));
    } else if (first.isList()) {
      c10::impl::GenericList list(first.toList().elementType());
      for (const auto& part : parts) {
        for (const auto& v : part.fields.at(key).toListRef()) list.push_back(v);
      }
      out.fields.emplace(key, list);
    } else {
      out.fields.emplace(key, first);
    }
  }
  return out;
}

// Note [Dispatching]
// The main process reads groups of batches from the unsharded loader (num_processes batches
// concatenated, or one batch with split_batches), one group ahead so it knows which is the last.
// A short last group is completed with the first num_processes samples of the first group, as
// upstream does after broadcasting. Each group travels to the other processes as one pickled
// value (flags, the per-process slice size, the tensors), and every process keeps its slice.
class DispatchSource final : public StepSource {
 public:
  DispatchSource(const DataLoaderImpl& impl, int64_t skip)
      : state_(*impl.state),
        num_processes_(state_.num_processes()),
        process_index_(state_.process_index()),
        group_(impl.split_batches ? 1 : num_processes_),
        drop_last_(impl.drop_last),
        slice_(impl.slice_fn) {
    if (!state_.is_main_process()) return;
    // Skipped groups are passed over without loading, except the first one, whose samples may
    // complete the last group.
    const bool keep_head = skip > 0 && !drop_last_;
    stream_ = open_stream(*impl.base, keep_head ? SkipPlan{group_, (skip - 1) * group_} : SkipPlan{0, skip * group_});
    if (keep_head) {
      if (auto head = next_group()) first_ = slice_example(*head, 0, num_processes_);
    }
  }

  std::optional<Step> next() override { return state_.is_main_process() ? send() : receive(); }

 private:
  std::optional<Example> next_group() {
    std::vector<Example> parts;
    for (int64_t i = 0; i < group_; ++i) {
      auto batch = stream_->next();
      if (!batch) break;
      parts.push_back(std::move(*batch));
    }
    if (parts.empty() || (drop_last_ && static_cast<int64_t>(parts.size()) < group_)) return std::nullopt;
    if (parts.size() == 1) return std::move(parts.front());
    try {
      return concatenate_examples(parts);
    } catch (const std::exception& e) {
      C10_THROW_ERROR(ValueError, c10::str("[DataLoaderDispatcher] cannot concatenate ", parts.size(),
                        " batches into one to "
                        "dispatch: without split_batches, dispatch_batches needs batches of the same shape beyond the "
                        "first dimension (",
                        error_message(e),
                        "); pass split_batches=true to split one batch "
                        "instead, or dispatch_batches=false to let every process read its own batches"));
    }
  }

  std::optional<Step> send() {
    if (!primed_) {
      primed_ = true;
      pending_ = next_group();
    }
    if (!pending_) {
      detail::broadcast_ivalue(state_, c10::ivalue::Tuple::create(std::vector<c10::IValue>{false}), 0,
                               "DataLoaderDispatcher");
      return std::nullopt;
    }
    Example group = std::move(*pending_);
    pending_.reset();
    if (!drop_last_ && !first_) first_ = slice_example(group, 0, num_processes_);
    pending_ = next_group();
    const bool last = !pending_;
    const int64_t observed = rows_of(group);
    int64_t share = observed / num_processes_;
    if (!drop_last_ && last && observed % num_processes_ != 0) {
      group = concatenate_examples({group, *first_});
      share += 1;
    }
    std::vector<c10::IValue> keys;
    std::vector<c10::IValue> values;
    for (const auto& [key, value] : group.fields) {
      keys.emplace_back(key);
      values.push_back(value);
    }
    std::vector<c10::IValue> items{true, last, share, observed};
    items.push_back(group.data.defined() ? c10::IValue(group.data) : c10::IValue());
    items.push_back(group.target.defined() ? c10::IValue(group.target) : c10::IValue());
    items.push_back(c10::ivalue::Tuple::create(std::move(keys)));
    items.push_back(c10::ivalue::Tuple::create(std::move(values)));
    const auto message = c10::ivalue::Tuple::create(std::move(items));
    detail::broadcast_ivalue(state_, message, 0, "DataLoaderDispatcher");
    return mine(group, share, last, observed);
  }

  std::optional<Step> receive() {
    const auto message = detail::broadcast_ivalue(state_, c10::IValue(), 0, "DataLoaderDispatcher");
    const auto items = message.toTupleRef().elements().vec();
    if (!items[0].toBool()) return std::nullopt;
    Example group;
    if (!items[4].isNone()) group.data = items[4].toTensor();
    if (!items[5].isNone()) group.target = items[5].toTensor();
    const auto keys = items[6].toTupleRef().elements().vec();
    const auto values = items[7].toTupleRef().elements().vec();
    for (size_t i = 0; i < keys.size(); ++i) group.fields.emplace(keys[i].toStringRef(), values[i]);
    return mine(group, items[2].toInt(), items[1].toBool(), items[3].toInt());
  }

  Step mine(const Example& group, int64_t share, bool last, int64_t observed) const {
    const int64_t start = share * process_index_;
    Example batch = slice_ ? slice_(group, start, start + share, process_index_, num_processes_)
                           : slice_example(group, start, start + share);
    return Step{std::move(batch), last, last ? observed : -1};
  }

  PartialState state_;
  int num_processes_;
  int process_index_;
  int64_t group_;
  bool drop_last_;
  SliceFn slice_;
  std::unique_ptr<BatchStream> stream_;
  std::optional<Example> first_;
  std::optional<Example> pending_;
  bool primed_ = false;
};

// Loaders being iterated, so that when an inner loader ends the outer one's end and remainder
// can be put back into its GradientState (upstream reads them from the active loader).
std::mutex g_active_mutex;
std::map<const void*, const DataLoaderImpl*> g_active;

}  // namespace

// ---- one pass ----

struct DataLoaderIteration {
  std::shared_ptr<DataLoaderImpl> impl;
  std::unique_ptr<StepSource> source;
  Step current;
  bool done = false;
  bool registered = false;

  ~DataLoaderIteration() { release(); }

  void start() {
    auto& L = *impl;
    const bool prepared = L.kind != LoaderKind::kPlain;
    L.end_of_dataloader = false;
    L.remainder = -1;
    L.last_pass_finished = false;
    if (prepared && !L.drop_last && L.total_batch_size && *L.total_batch_size > 0) {
      try {
        L.remainder = dataset_length(L) % *L.total_batch_size;
      } catch (const c10::Error&) {
        // An iterable dataset of unknown size: the remainder stays unknown, as upstream.
      }
    }
    if (prepared) set_epoch_everywhere(L, L.iteration);
    const auto generator = generator_of(L);
    if (L.synchronize_generator && generator && L.state && L.state->num_processes() > 1) {
      synchronize_generator(*L.state, *generator);
    }
    if (!L.rng_types.empty() && L.state && L.state->num_processes() > 1) {
      synchronize_rng_states(*L.state, L.rng_types);
    }
    L.pass_generator_state = generator ? generator_state_hex(*generator) : std::string();
    if (prepared && L.gradient_state) {
      L.gradient_state->add_dataloader(impl.get());
      registered = true;
      std::lock_guard<std::mutex> lock(g_active_mutex);
      g_active[impl.get()] = impl.get();
    }
    const int64_t start = std::max(L.skip_batches, L.resume_position.value_or(0));
    L.resume_position.reset();
    L.position = start;
    L.in_pass = true;
    if (L.kind == LoaderKind::kDispatcher) {
      source = std::make_unique<DispatchSource>(L, start);
    } else {
      source = std::make_unique<LookAheadSource>(open_stream(L, SkipPlan{0, start}));
    }
    auto step = source->next();
    if (!step) {
      // Nothing to read: like upstream, the pass does not count as an epoch.
      L.in_pass = false;
      done = true;
      source.reset();
      release();
      return;
    }
    deliver(std::move(*step));
  }

  void deliver(Step step) {
    auto& L = *impl;
    current = std::move(step);
    if (L.device) current.batch = send_to_device(current.batch, *L.device, L.non_blocking);
    L.position += 1;
    if (current.last) {
      L.end_of_dataloader = true;
      if (current.remainder >= 0) L.remainder = current.remainder;
    }
    if (registered) {
      L.gradient_state->set_end_of_dataloader(L.end_of_dataloader);
      L.gradient_state->set_remainder(L.remainder);
    }
  }

  void advance() {
    TORCH_CHECK(!done, "[DataLoader] cannot advance an iterator that reached the end of its pass");
    if (!current.last) {
      if (auto step = source->next()) {
        deliver(std::move(*step));
        return;
      }
    }
    auto& L = *impl;
    done = true;
    current = Step{};
    source.reset();
    L.iteration += 1;
    L.in_pass = false;
    L.position = 0;
    L.last_pass_finished = true;
    release();
  }

  void release() noexcept {
    if (!registered) return;
    registered = false;
    try {
      const auto& gradient_state = *impl->gradient_state;
      gradient_state.remove_dataloader(impl.get());
      std::lock_guard<std::mutex> lock(g_active_mutex);
      g_active.erase(impl.get());
      const void* outer = gradient_state.active_dataloader();
      const auto it = outer != nullptr ? g_active.find(outer) : g_active.end();
      if (it != g_active.end()) {
        gradient_state.set_end_of_dataloader(it->second->end_of_dataloader);
        gradient_state.set_remainder(it->second->remainder);
      } else if (outer == nullptr) {
        gradient_state.set_remainder(-1);
      }
    } catch (...) {
      // Leaving a loop must not throw; the gradient state only loses track of this loader.
    }
  }
};

}  // namespace detail

// ---- DataLoader -----------------------------------------------------------------------------

namespace {

void check_common_options(const DataLoaderOptions& options) {
  TORCH_CHECK_VALUE(options.num_workers >= 0, "[DataLoader] num_workers must be >= 0, got ", options.num_workers);
  TORCH_CHECK_VALUE(options.prefetch_factor >= 1, "[DataLoader] prefetch_factor must be >= 1, got ",
                    options.prefetch_factor);
}

}  // namespace

DataLoader::DataLoader(std::shared_ptr<detail::DataLoaderImpl> impl) : impl_(std::move(impl)) {
  TORCH_INTERNAL_ASSERT(impl_ != nullptr);
}

DataLoader::DataLoader(std::shared_ptr<Dataset> dataset, DataLoaderOptions options)
    : impl_(std::make_shared<detail::DataLoaderImpl>()) {
  TORCH_CHECK_VALUE(dataset != nullptr, "[DataLoader] expected a dataset, got null");
  check_common_options(options);
  auto& L = *impl_;
  if (options.batch_sampler) {
    TORCH_CHECK_VALUE(options.batch_size == 1 && !options.shuffle && !options.sampler && !options.drop_last,
                      "[DataLoader] batch_sampler is mutually exclusive with batch_size, shuffle, sampler and "
                      "drop_last, got batch_size=",
                      options.batch_size, ", shuffle=", options.shuffle, ", a sampler: ", options.sampler != nullptr,
                      ", drop_last=", options.drop_last);
    L.batch_sampler = std::move(options.batch_sampler);
    L.batch_size = L.batch_sampler->batch_size();
  } else {
    TORCH_CHECK_VALUE(options.batch_size >= 1, "[DataLoader] batch_size must be a positive integer, got ",
                      options.batch_size);
    TORCH_CHECK_VALUE(!(options.sampler && options.shuffle),
                      "[DataLoader] sampler is mutually exclusive with shuffle: the sampler decides the order");
    std::shared_ptr<Sampler> sampler = options.sampler;
    if (!sampler && options.shuffle) {
      sampler = std::make_shared<RandomSampler>(dataset->size(), RandomSamplerOptions{.generator = options.generator});
    } else if (!sampler) {
      sampler = std::make_shared<SequentialSampler>(dataset->size());
    }
    L.batch_sampler = std::make_shared<BatchSampler>(std::move(sampler), options.batch_size, options.drop_last);
    L.batch_size = options.batch_size;
    L.drop_last = options.drop_last;
  }
  L.dataset = std::move(dataset);
  L.total_batch_size = L.batch_size;
  L.default_collate = !options.collate_fn;
  L.collate = options.collate_fn ? std::move(options.collate_fn) : CollateFn(default_collate);
  L.num_workers = options.num_workers;
  L.prefetch_factor = options.prefetch_factor;
}

DataLoader::DataLoader(std::shared_ptr<IterableDataset> dataset, DataLoaderOptions options)
    : impl_(std::make_shared<detail::DataLoaderImpl>()) {
  TORCH_CHECK_VALUE(dataset != nullptr, "[DataLoader] expected a dataset, got null");
  check_common_options(options);
  TORCH_CHECK_VALUE(!options.shuffle && !options.sampler && !options.batch_sampler,
                    "[DataLoader] an iterable dataset decides its own order: expected no shuffle, sampler or "
                    "batch_sampler, got shuffle=",
                    options.shuffle, ", a sampler: ", options.sampler != nullptr,
                    ", a batch_sampler: ", options.batch_sampler != nullptr);
  TORCH_CHECK_VALUE(options.batch_size >= 1, "[DataLoader] batch_size must be a positive integer, got ",
                    options.batch_size);
  auto& L = *impl_;
  L.iterable = std::move(dataset);
  L.batch_size = options.batch_size;
  L.total_batch_size = options.batch_size;
  L.drop_last = options.drop_last;
  L.default_collate = !options.collate_fn;
  L.collate = options.collate_fn ? std::move(options.collate_fn) : CollateFn(default_collate);
  L.num_workers = options.num_workers;
  L.prefetch_factor = options.prefetch_factor;
}

DataLoader::Iterator DataLoader::begin() const {
  auto iteration = std::make_shared<detail::DataLoaderIteration>();
  iteration->impl = impl_;
  iteration->start();
  return Iterator(std::move(iteration));
}

DataLoader::Iterator DataLoader::end() const { return Iterator(); }

bool DataLoader::Iterator::done() const { return !it_ || it_->done; }

Example& DataLoader::Iterator::operator*() const {
  TORCH_CHECK(!done(), "[DataLoader] cannot dereference an iterator at the end of its pass");
  return it_->current.batch;
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  TORCH_CHECK(it_ != nullptr, "[DataLoader] cannot advance an end iterator");
  it_->advance();
  return *this;
}

int64_t DataLoader::size() const { return detail::loader_size(*impl_); }
std::optional<int64_t> DataLoader::batch_size() const { return impl_->batch_size; }
std::optional<int64_t> DataLoader::total_batch_size() const { return impl_->total_batch_size; }
int64_t DataLoader::total_dataset_length() const { return detail::dataset_length(*impl_); }
bool DataLoader::drop_last() const { return impl_->drop_last; }
int DataLoader::num_workers() const { return impl_->num_workers; }

void DataLoader::set_epoch(int64_t epoch) const {
  TORCH_CHECK_VALUE(epoch >= 0, "[DataLoader] set_epoch expects an epoch >= 0, got ", epoch);
  impl_->iteration = epoch;
  detail::set_epoch_everywhere(*impl_, epoch);
}

int64_t DataLoader::iteration() const { return impl_->iteration; }
bool DataLoader::end_of_dataloader() const { return impl_->end_of_dataloader; }
int64_t DataLoader::remainder() const { return impl_->remainder; }

DataLoaderState DataLoader::state_dict() const {
  const auto& L = *impl_;
  const auto generator = detail::generator_of(L);
  const auto current_generator = [&] { return generator ? detail::generator_state_hex(*generator) : std::string(); };
  DataLoaderState state;
  if (L.in_pass && !L.end_of_dataloader) {
    // Mid-pass: the order is replayed from the generator as it was when the pass started.
    state.epoch = L.iteration;
    state.batches_yielded = L.position;
    state.generator_state = L.pass_generator_state;
  } else if (L.in_pass) {
    // On the last batch: resuming starts the next pass, from the generator as it is now.
    state.epoch = L.iteration + 1;
    state.iterator_finished = true;
    state.generator_state = current_generator();
  } else {
    state.epoch = L.iteration;
    state.batches_yielded = L.resume_position.value_or(0);
    state.iterator_finished = L.last_pass_finished;
    state.generator_state = current_generator();
  }
  return state;
}

void DataLoader::load_state_dict(const DataLoaderState& state) const {
  auto& L = *impl_;
  TORCH_CHECK_VALUE(state.epoch >= 0 && state.batches_yielded >= 0,
                    "[DataLoader::load_state_dict] expected a non-negative epoch and batch count, got epoch ",
                    state.epoch, " and batches_yielded ", state.batches_yielded);
  const auto generator = detail::generator_of(L);
  TORCH_CHECK_VALUE(state.generator_state.empty() || generator.has_value(),
                    "[DataLoader::load_state_dict] the state holds a generator state, but this loader's sampler has "
                    "no generator (was the state saved from a loader that shuffles?)");
  TORCH_CHECK_VALUE(!state.generator_state.empty() || !generator.has_value(),
                    "[DataLoader::load_state_dict] this loader's sampler draws from a generator, but the state holds "
                    "no generator state (was the state saved from a loader that does not shuffle?)");
  if (generator) detail::set_generator_state_hex(*generator, state.generator_state, "DataLoader::load_state_dict");
  L.iteration = state.epoch;
  L.resume_position = state.batches_yielded > 0 ? std::optional<int64_t>(state.batches_yielded) : std::nullopt;
  L.in_pass = false;
  L.end_of_dataloader = false;
  L.last_pass_finished = state.iterator_finished;
}

std::shared_ptr<Dataset> DataLoader::dataset() const { return impl_->dataset; }
std::shared_ptr<IterableDataset> DataLoader::iterable_dataset() const { return impl_->iterable; }
std::shared_ptr<BatchSampler> DataLoader::batch_sampler() const { return impl_->batch_sampler; }
std::shared_ptr<Sampler> DataLoader::sampler() const {
  return impl_->batch_sampler ? impl_->batch_sampler->sampler() : nullptr;
}
bool DataLoader::prepared() const { return impl_->kind != detail::LoaderKind::kPlain; }
bool DataLoader::dispatch_batches() const { return impl_->kind == detail::LoaderKind::kDispatcher; }
bool DataLoader::split_batches() const { return impl_->split_batches; }
bool DataLoader::use_stateful_dataloader() const { return impl_->use_stateful; }

// ---- DataLoaderState as JSON ----------------------------------------------------------------

std::string DataLoaderState::to_json() const {
  nlohmann::json j = {{"epoch", epoch},
                      {"batches_yielded", batches_yielded},
                      {"iterator_finished", iterator_finished},
                      {"generator_state", generator_state}};
  return j.dump();
}

DataLoaderState DataLoaderState::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    C10_THROW_ERROR(ValueError, c10::str("[DataLoaderState::from_json] expected a JSON object, got text that does not parse: ", e.what()));
  }
  TORCH_CHECK_VALUE(j.is_object(), "[DataLoaderState::from_json] expected a JSON object, got ", j.type_name());
  auto integer = [&](const char* key) {
    TORCH_CHECK_VALUE(j.contains(key), "[DataLoaderState::from_json] expected the key \"", key, "\", it is missing");
    const auto& v = j.at(key);
    TORCH_CHECK_VALUE(v.is_number_integer() && v.get<int64_t>() >= 0, "[DataLoaderState::from_json] expected \"", key,
                      "\" to be an integer >= 0, got ", v.dump());
    return v.get<int64_t>();
  };
  DataLoaderState state;
  state.epoch = integer("epoch");
  state.batches_yielded = integer("batches_yielded");
  TORCH_CHECK_VALUE(j.contains("iterator_finished") && j.at("iterator_finished").is_boolean(),
                    "[DataLoaderState::from_json] expected \"iterator_finished\" to be true or false, got ",
                    j.contains("iterator_finished") ? j.at("iterator_finished").dump() : std::string("nothing"));
  state.iterator_finished = j.at("iterator_finished").get<bool>();
  TORCH_CHECK_VALUE(j.contains("generator_state") && j.at("generator_state").is_string(),
                    "[DataLoaderState::from_json] expected \"generator_state\" to be a string, got ",
                    j.contains("generator_state") ? j.at("generator_state").dump() : std::string("nothing"));
  state.generator_state = j.at("generator_state").get<std::string>();
  TORCH_CHECK_VALUE(
      detail::is_hex(state.generator_state),
      "[DataLoaderState::from_json] expected \"generator_state\" to be an even number of hex digits, got ",
      state.generator_state.size(), " characters that are not");
  return state;
}

// ---- preparation ----------------------------------------------------------------------------

PrepareDataLoaderOptions PrepareDataLoaderOptions::from_config(const DataLoaderConfiguration& config) {
  PrepareDataLoaderOptions options;
  options.split_batches = config.split_batches;
  options.dispatch_batches = config.dispatch_batches;
  options.even_batches = config.even_batches;
  options.use_seedable_sampler = config.use_seedable_sampler;
  options.data_seed = config.data_seed;
  options.non_blocking = config.non_blocking;
  options.use_stateful_dataloader = config.use_stateful_dataloader;
  return options;
}

DataLoader prepare_data_loader(const DataLoader& loader, const PartialState& state, const GradientState& gradient_state,
                               const PrepareDataLoaderOptions& options) {
  using detail::LoaderKind;
  const auto& src = *loader.impl();
  TORCH_CHECK_VALUE(src.kind == LoaderKind::kPlain,
                    "[prepare_data_loader] expected a data loader that is not prepared "
                    "yet, got one returned by prepare_data_loader");
  const bool iterable = src.iterable != nullptr;
  const bool dispatch = options.dispatch_batches.value_or(options.put_on_device && iterable);
  TORCH_CHECK_VALUE(!dispatch || options.put_on_device,
                    "[prepare_data_loader] dispatch_batches=true requires put_on_device=true");
  const int num_processes = options.num_processes.value_or(state.num_processes());
  const int process_index = options.process_index.value_or(state.process_index());
  TORCH_CHECK_VALUE(num_processes >= 1, "[prepare_data_loader] num_processes must be >= 1, got ", num_processes);
  TORCH_CHECK_INDEX(process_index >= 0 && process_index < num_processes,
                    "[prepare_data_loader] process_index must be "
                    "in [0, ",
                    num_processes, "), got ", process_index);
  // The dispatcher always splits over the processes of the state.
  const int shards = dispatch ? state.num_processes() : num_processes;
  const auto batch_size = src.batch_size;
  if (options.split_batches) {
    TORCH_CHECK_VALUE(batch_size.has_value(),
                      "[prepare_data_loader] split_batches needs a batch size, but the loader's "
                      "batch sampler yields batches of varying sizes");
    TORCH_CHECK_VALUE(*batch_size % shards == 0,
                      "[prepare_data_loader] split_batches needs a batch size that is a round "
                      "multiple of the number of processes (",
                      shards, "), got ", *batch_size);
  }

  auto impl = std::make_shared<detail::DataLoaderImpl>(src);
  detail::reset_progress(*impl);
  impl->iteration = 0;
  impl->skip_batches = 0;
  impl->kind = dispatch ? LoaderKind::kDispatcher : LoaderKind::kShard;
  impl->state = state;
  impl->gradient_state = gradient_state;
  if (options.put_on_device) impl->device = options.device.value_or(state.device());
  impl->non_blocking = options.non_blocking;
  impl->use_stateful = options.use_stateful_dataloader;
  impl->split_batches = options.split_batches;
  impl->num_processes = shards;
  impl->process_index = dispatch ? state.process_index() : process_index;
  if (batch_size) impl->total_batch_size = options.split_batches ? *batch_size : *batch_size * shards;
  if (batch_size && options.split_batches) impl->batch_size = *batch_size / shards;

  // A plain RandomSampler becomes a SeedableRandomSampler on the same generator. Custom batch
  // samplers keep their own sampler.
  auto batch_sampler = src.batch_sampler;
  if (options.use_seedable_sampler && batch_sampler && typeid(*batch_sampler) == typeid(BatchSampler)) {
    const auto random = std::dynamic_pointer_cast<RandomSampler>(batch_sampler->sampler());
    if (random && typeid(*random) == typeid(RandomSampler)) {
      auto seedable = std::make_shared<SeedableRandomSampler>(
          random->data_size(), RandomSamplerOptions{random->replacement(), random->size(), random->generator()},
          options.data_seed);
      batch_sampler =
          std::make_shared<BatchSampler>(seedable, *batch_sampler->batch_size(), batch_sampler->drop_last());
    }
  }
  impl->batch_sampler = batch_sampler;

  if (dispatch) {
    auto base = std::make_shared<detail::DataLoaderImpl>(src);
    detail::reset_progress(*base);
    base->batch_sampler = batch_sampler;
    impl->base = std::move(base);
    impl->slice_fn = options.slice_fn_for_dispatch;
  } else if (num_processes != 1) {
    if (iterable) {
      impl->iterable = std::make_shared<IterableDatasetShard>(
          src.iterable,
          IterableDatasetShardOptions{*batch_size, src.drop_last, num_processes, process_index, options.split_batches});
    } else {
      impl->batch_sampler =
          std::make_shared<BatchSamplerShard>(batch_sampler, num_processes, process_index,
                                              BatchSamplerShardOptions{options.split_batches, options.even_batches});
      impl->synchronize_generator = !options.use_seedable_sampler;
    }
  }
  for (const auto& type : options.rng_types) {
    TORCH_CHECK_VALUE(type == "torch" || type == "cuda" || type == "generator", "[prepare_data_loader] rng_types: "
                      "unknown generator '", type, "'; expected 'torch', 'cuda' or 'generator'");
    if (type != "generator") impl->rng_types.push_back(type);
  }
  return DataLoader(std::move(impl));
}

DataLoader prepare_data_loader(const DataLoader& loader, const PrepareDataLoaderOptions& options) {
  return prepare_data_loader(loader, PartialState(), GradientState(), options);
}

DataLoader skip_first_batches(const DataLoader& loader, int64_t num_batches) {
  TORCH_CHECK_VALUE(num_batches >= 0, "[skip_first_batches] num_batches must be >= 0, got ", num_batches);
  auto impl = std::make_shared<detail::DataLoaderImpl>(*loader.impl());
  detail::reset_progress(*impl);
  impl->skip_batches = num_batches;
  return DataLoader(std::move(impl));
}

}  // namespace accelerate
