// Data loading sharded across processes (upstream: accelerate/data_loader.py, together with the
// parts of torch.utils.data it builds on: datasets, samplers, batch samplers, collate and the
// DataLoader itself). A `DataLoader` reads a map-style `Dataset` through a `BatchSampler`, or an
// `IterableDataset` in its own order, collates samples into batches and, with `num_workers`,
// prefetches them in order on background threads. `prepare_data_loader` returns the loader one
// process of a job iterates: batches sharded by `BatchSamplerShard` / `IterableDatasetShard`, or
// read by the main process alone and dispatched (`dispatch_batches`), with shuffling synchronised
// from process 0, `GradientState` told about the last batch, and a `state_dict()` that resumes
// mid-epoch at the next batch.
//
// Batches are one type-erased value, `Example`: a `data` tensor, an optional `target` tensor and
// named extra `fields` (tensors or any `c10::IValue`), used for single samples and for collated
// batches alike; `TensorTree<Example>` lets every operation of operations.h walk it. Datasets of
// LibTorch (`torch::data::datasets::TensorDataset`, a user `torch::data::datasets::Dataset`) work
// directly through `make_dataset`. Left out: worker processes (workers are threads), pinned
// memory, XLA/device-mesh/DeepSpeed handling, and `rng_types` (the sampler's generator is always
// synchronised; the process-wide generators belong to utils/random).
//
// Example:
//   auto dataset = std::make_shared<accelerate::TensorDataset>(inputs, labels);
//   accelerate::DataLoader loader(dataset, {.batch_size = 32, .shuffle = true, .num_workers = 2});
//   auto train = accelerate::prepare_data_loader(loader, state, gradient_state, {.even_batches = true});
//   for (int epoch = 0; epoch < 3; ++epoch) {
//     train.set_epoch(epoch);
//     for (auto& batch : train) step(batch.data, batch.target);
//   }
#pragma once

#include "accelerate/state.h"
#include "accelerate/utils/tensor_tree.h"

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace accelerate {

namespace detail::data {
struct DataLoaderImpl;
struct DataLoaderIteration;
}  // namespace detail::data

// ---- samples and batches ---------------------------------------------------------------------

/// One sample, or a batch of samples collated along a new first dimension: the pair of a
/// `torch::data::Example` plus named extra fields (e.g. "attention_mask", or strings).
struct Example {
  /// The input (undefined when the sample has none).
  at::Tensor data{};
  /// The label (undefined when the sample has none).
  at::Tensor target{};
  /// Other named values: tensors, numbers, strings, lists, … (ordered by name on every process).
  std::map<std::string, c10::IValue> fields{};
};

/// Walks an `Example` in the order data, target, fields (undefined tensors are left out).
template <>
struct TensorTree<Example> {
  template <typename F>
  static Example map(const Example& e, F&& f) {
    Example out;
    if (e.data.defined()) out.data = f(e.data);
    if (e.target.defined()) out.target = f(e.target);
    out.fields = f(e.fields);
    return out;
  }
};

/// Turns the samples of one batch into the batch.
using CollateFn = std::function<Example(std::vector<Example> samples)>;

/// Stacks `data`, `target` and tensor fields along a new first dimension; numeric and boolean
/// fields become a 1-dim tensor; any other field becomes the list of the samples' values
/// (upstream: torch's `default_collate`). Every sample must have the same fields and shapes.
Example default_collate(std::vector<Example> samples);

// ---- datasets -------------------------------------------------------------------------------

/// A map-style dataset: `size()` samples addressed by index (upstream: `torch.utils.data.Dataset`).
/// With `num_workers > 0`, `get` is called from several threads at once.
class Dataset {
 public:
  virtual ~Dataset() = default;
  /// Number of samples.
  virtual int64_t size() const = 0;
  /// The sample at `index`, in [0, size()).
  virtual Example get(int64_t index) = 0;
  /// Optionally, the samples at `indices` already collated, exactly as `default_collate` would
  /// collate them, when the dataset can read a batch faster than sample by sample (upstream:
  /// `__getitems__`). Used only by loaders with the default collate function; the indices are
  /// checked first. Empty (the default) means "read sample by sample".
  virtual std::optional<Example> get_batch(const std::vector<int64_t>& indices) { return std::nullopt; }
  /// Told the epoch by a prepared loader at the start of each pass (e.g. for augmentation seeds).
  virtual void set_epoch(int64_t epoch) {}
};

/// One pass over a stream of samples: each call gives the next one, or nothing once the pass is
/// over (and from then on). `IndexGenerator` and `IndexBatchGenerator` below work alike.
using ExampleGenerator = std::function<std::optional<Example>()>;

/// A dataset read as a stream, in its own order (upstream: `torch.utils.data.IterableDataset`).
/// `iter()` is called once per pass, on one thread at a time.
class IterableDataset {
 public:
  virtual ~IterableDataset() = default;
  /// Starts a pass over the samples.
  virtual ExampleGenerator iter() = 0;
  /// Number of samples of a pass, when known.
  virtual std::optional<int64_t> size() const { return std::nullopt; }
  /// Told the epoch by a prepared loader at the start of each pass.
  virtual void set_epoch(int64_t epoch) {}
};

/// Samples are rows of `data` (and of `target` when given) (upstream: `torch.utils.data.TensorDataset`).
class TensorDataset final : public Dataset {
 public:
  /// `data` and `target` must have the same first dimension (the number of samples).
  explicit TensorDataset(at::Tensor data, at::Tensor target = {});
  int64_t size() const override;
  Example get(int64_t index) override;
  /// The rows at `indices`, gathered at once.
  std::optional<Example> get_batch(const std::vector<int64_t>& indices) override;

 private:
  at::Tensor data_;
  at::Tensor target_;
};

/// A dataset of `size` samples whose sample `i` is `get(i)`.
std::shared_ptr<Dataset> make_dataset(int64_t size, std::function<Example(int64_t)> get);

/// An iterable dataset whose passes are started by `iter`; `size` when it is known.
std::shared_ptr<IterableDataset> make_iterable_dataset(std::function<ExampleGenerator()> iter,
                                                       std::optional<int64_t> size = std::nullopt);

namespace data_detail {
template <typename D, typename = void>
struct is_torch_dataset : std::false_type {};
template <typename D>
struct is_torch_dataset<D, std::void_t<typename D::ExampleType, decltype(std::declval<D&>().get(size_t{0})),
                                       decltype(std::declval<const D&>().size())>> : std::true_type {};

template <typename D, typename T>
Example to_example(const torch::data::Example<D, T>& e) {
  static_assert(std::is_same_v<D, at::Tensor>, "accelerate: a LibTorch dataset's examples must hold tensors");
  if constexpr (std::is_same_v<T, torch::data::example::NoTarget>) {
    return Example{e.data, {}, {}};
  } else {
    static_assert(std::is_same_v<T, at::Tensor>, "accelerate: a LibTorch dataset's targets must be tensors");
    return Example{e.data, e.target, {}};
  }
}

[[noreturn]] void throw_unsized_torch_dataset();
template <typename Optional>
int64_t checked_size(const Optional& size) {
  if (!size.has_value()) throw_unsized_torch_dataset();
  return static_cast<int64_t>(*size);
}

template <typename D>
class TorchDataset final : public Dataset {
 public:
  explicit TorchDataset(D dataset) : dataset_(std::move(dataset)), size_(checked_size(dataset_.size())) {}
  int64_t size() const override { return size_; }
  Example get(int64_t index) override { return to_example(dataset_.get(static_cast<size_t>(index))); }

 private:
  D dataset_;
  int64_t size_;
};
}  // namespace data_detail

/// Wraps a LibTorch dataset (`torch::data::datasets::TensorDataset`, or any
/// `torch::data::datasets::Dataset<Self, torch::data::Example<>>`) as a `Dataset`.
template <typename D, std::enable_if_t<data_detail::is_torch_dataset<D>::value, int> = 0>
std::shared_ptr<Dataset> make_dataset(D dataset) {
  return std::make_shared<data_detail::TorchDataset<D>>(std::move(dataset));
}

// ---- samplers -------------------------------------------------------------------------------

using IndexGenerator = std::function<std::optional<int64_t>()>;
using IndexBatchGenerator = std::function<std::optional<std::vector<int64_t>>()>;

/// Chooses the order in which a map-style dataset's indices are read (upstream: `Sampler`).
class Sampler {
 public:
  virtual ~Sampler() = default;
  /// Number of indices of a pass.
  virtual int64_t size() const = 0;
  /// Starts a pass over the indices.
  virtual IndexGenerator iter() = 0;
  /// Sets the epoch, for samplers whose order depends on it.
  virtual void set_epoch(int64_t epoch) {}
  /// The random generator the order comes from, if any; a prepared loader synchronises it from
  /// process 0 at the start of every pass and saves it in `state_dict()`.
  virtual std::optional<at::Generator> generator() const { return std::nullopt; }
};

/// Indices 0, 1, …, size-1 (upstream: `SequentialSampler`).
class SequentialSampler final : public Sampler {
 public:
  /// Indices of a dataset of `size` samples.
  explicit SequentialSampler(int64_t size);
  int64_t size() const override { return size_; }
  IndexGenerator iter() override;

 private:
  int64_t size_;
};

/// Settings of a `RandomSampler`.
struct RandomSamplerOptions {
  /// Draw with replacement.
  bool replacement = false;
  /// Indices per pass (default: the dataset size).
  std::optional<int64_t> num_samples{};
  /// Generator of the order; by default one seeded from LibTorch's default generator.
  std::optional<at::Generator> generator{};
};

/// A random permutation of the indices each pass (upstream: `RandomSampler`; the same draws as
/// PyTorch's for the same generator state).
class RandomSampler : public Sampler {
 public:
  /// Indices of a dataset of `data_size` samples.
  explicit RandomSampler(int64_t data_size, RandomSamplerOptions options = {});
  int64_t size() const override { return num_samples_; }
  IndexGenerator iter() override;
  std::optional<at::Generator> generator() const override { return generator_; }
  /// Number of samples of the dataset.
  int64_t data_size() const { return data_size_; }
  /// Whether indices are drawn with replacement.
  bool replacement() const { return replacement_; }

 protected:
  /// The indices of one pass, drawn from the generator.
  std::vector<int64_t> draw();

  int64_t data_size_;
  bool replacement_;
  int64_t num_samples_;
  at::Generator generator_;
};

/// A `RandomSampler` whose generator is seeded with `initial_seed + epoch` at the start of each
/// pass, so that every process and every run shuffle alike (upstream: `SeedableRandomSampler`).
/// The epoch advances by one at the end of each full pass, and a prepared loader sets it.
class SeedableRandomSampler final : public RandomSampler {
 public:
  /// `data_seed` defaults to the initial seed of LibTorch's default generator.
  explicit SeedableRandomSampler(int64_t data_size, RandomSamplerOptions options = {},
                                 std::optional<uint64_t> data_seed = std::nullopt);
  IndexGenerator iter() override;
  void set_epoch(int64_t epoch) override;
  /// The epoch of the next pass.
  int64_t epoch() const;
  /// The seed of epoch 0.
  uint64_t initial_seed() const { return initial_seed_; }

 private:
  uint64_t initial_seed_;
  std::shared_ptr<std::atomic<int64_t>> epoch_;
};

// ---- batch samplers -------------------------------------------------------------------------

/// Groups a sampler's indices into batches (upstream: `BatchSampler`). Also the base class of
/// custom batch samplers, which override `iter()` and `size()` and may yield batches of varying
/// sizes (then `batch_size()` is empty).
class BatchSampler {
 public:
  /// Batches of `batch_size` consecutive indices of `sampler`; with `drop_last` a short last
  /// batch is left out.
  BatchSampler(std::shared_ptr<Sampler> sampler, int64_t batch_size, bool drop_last);
  virtual ~BatchSampler() = default;

  /// Number of batches of a pass.
  virtual int64_t size() const;
  /// Starts a pass over the batches.
  virtual IndexBatchGenerator iter();
  /// The size of every batch but possibly the last; empty for varying sizes.
  virtual std::optional<int64_t> batch_size() const { return batch_size_; }
  /// Whether a short last batch is left out.
  virtual bool drop_last() const { return drop_last_; }
  /// Sets the epoch (forwarded to the sampler).
  virtual void set_epoch(int64_t epoch);
  /// The sampler whose indices are grouped, if any.
  virtual std::shared_ptr<Sampler> sampler() const { return sampler_; }
  /// The generator the order comes from, if any (by default the sampler's).
  virtual std::optional<at::Generator> generator() const;

 protected:
  /// For subclasses that produce batches themselves.
  BatchSampler(std::optional<int64_t> batch_size, bool drop_last) : batch_size_(batch_size), drop_last_(drop_last) {}

 private:
  std::shared_ptr<Sampler> sampler_;
  std::optional<int64_t> batch_size_;
  bool drop_last_ = false;
};

/// A fixed list of index batches, possibly of different sizes (upstream: a plain list used as
/// `batch_sampler`).
class ListBatchSampler final : public BatchSampler {
 public:
  /// Yields `batches` in order; `drop_last` tells a `BatchSamplerShard` to drop an incomplete last round.
  explicit ListBatchSampler(std::vector<std::vector<int64_t>> batches, bool drop_last = false);
  int64_t size() const override { return static_cast<int64_t>(batches_->size()); }
  IndexBatchGenerator iter() override;

 private:
  std::shared_ptr<const std::vector<std::vector<int64_t>>> batches_;
};

/// How `BatchSamplerShard` divides batches between processes.
struct BatchSamplerShardOptions {
  /// Cut every batch into `num_processes` slices instead of giving whole batches to each process.
  bool split_batches = false;
  /// Give every process the same number of batches, completing the last round with batches from
  /// the start of the sampler order.
  bool even_batches = true;
};

/// The batches of one process out of a batch sampler (upstream: `BatchSamplerShard`). Without
/// `split_batches`, process `i` takes batches i, i + n, i + 2n, …; with it, slice i of every batch.
///
/// Example (2 processes, batch sampler over range(20), batch size 3, even batches):
///   process 0: [0,1,2] [6,7,8] [12,13,14] [18,19,0]   process 1: [3,4,5] [9,10,11] [15,16,17] [1,2,3]
class BatchSamplerShard final : public BatchSampler {
 public:
  /// Shard `process_index` of `num_processes` of `batch_sampler`.
  BatchSamplerShard(std::shared_ptr<BatchSampler> batch_sampler, int num_processes = 1, int process_index = 0,
                    BatchSamplerShardOptions options = {});
  int64_t size() const override;
  IndexBatchGenerator iter() override;
  void set_epoch(int64_t epoch) override { batch_sampler_->set_epoch(epoch); }
  std::shared_ptr<Sampler> sampler() const override { return batch_sampler_->sampler(); }
  std::optional<at::Generator> generator() const override { return batch_sampler_->generator(); }

  /// Number of batches of the wrapped batch sampler.
  int64_t total_length() const { return batch_sampler_->size(); }
  /// The wrapped batch sampler.
  const std::shared_ptr<BatchSampler>& batch_sampler() const { return batch_sampler_; }
  /// Number of shards.
  int num_processes() const { return num_processes_; }
  /// The shard this sampler yields.
  int process_index() const { return process_index_; }
  /// See `BatchSamplerShardOptions`.
  bool split_batches() const { return options_.split_batches; }
  /// See `BatchSamplerShardOptions`.
  bool even_batches() const { return options_.even_batches; }
  /// Changes `even_batches` for the passes started from now on (`Accelerator::join_uneven_inputs`
  /// overrides it for the duration of its body).
  void set_even_batches(bool even_batches) { options_.even_batches = even_batches; }

 private:
  IndexBatchGenerator iter_with_split();
  IndexBatchGenerator iter_without_split();

  std::shared_ptr<BatchSampler> batch_sampler_;
  int num_processes_;
  int process_index_;
  BatchSamplerShardOptions options_;
};

/// Skips the first `skip_batches` batches of another batch sampler (upstream: `SkipBatchSampler`).
class SkipBatchSampler final : public BatchSampler {
 public:
  /// `batch_sampler` without its first `skip_batches` batches.
  SkipBatchSampler(std::shared_ptr<BatchSampler> batch_sampler, int64_t skip_batches);
  int64_t size() const override;
  IndexBatchGenerator iter() override;
  void set_epoch(int64_t epoch) override { batch_sampler_->set_epoch(epoch); }
  std::shared_ptr<Sampler> sampler() const override { return batch_sampler_->sampler(); }
  std::optional<at::Generator> generator() const override { return batch_sampler_->generator(); }
  /// Number of batches of the wrapped batch sampler, skipped ones included.
  int64_t total_length() const { return batch_sampler_->size(); }

 private:
  std::shared_ptr<BatchSampler> batch_sampler_;
  int64_t skip_batches_;
};

/// How `IterableDatasetShard` divides a stream between processes.
struct IterableDatasetShardOptions {
  /// Samples per process per batch (or, with `split_batches`, per batch of all processes).
  int64_t batch_size = 1;
  /// Leave out a short last batch instead of completing it with samples from the start.
  bool drop_last = false;
  /// Number of shards.
  int num_processes = 1;
  /// The shard to yield.
  int process_index = 0;
  /// `batch_size` is the size of the whole batch, cut into `num_processes` slices.
  bool split_batches = false;
};

/// The samples of one process out of an iterable dataset (upstream: `IterableDatasetShard`): the
/// stream is read in rounds of `batch_size × num_processes` samples (`batch_size` with
/// `split_batches`) and process `i` keeps slice `i` of each round; a short last round is completed
/// with the first samples of the stream unless `drop_last`.
class IterableDatasetShard final : public IterableDataset {
 public:
  /// The share of `options.process_index` of `dataset`.
  IterableDatasetShard(std::shared_ptr<IterableDataset> dataset, IterableDatasetShardOptions options = {});
  ExampleGenerator iter() override;
  /// Samples this process gets per pass, when the dataset's size is known.
  std::optional<int64_t> size() const override;
  void set_epoch(int64_t epoch) override;
  /// Samples of the whole dataset, when known.
  std::optional<int64_t> total_length() const { return dataset_->size(); }
  /// The wrapped dataset.
  const std::shared_ptr<IterableDataset>& dataset() const { return dataset_; }
  /// The sharding settings.
  const IterableDatasetShardOptions& options() const { return options_; }
  /// Samples of one round of all processes.
  int64_t round_size() const;
  /// This process's share of a round.
  int64_t process_batch_size() const;

 private:
  std::shared_ptr<IterableDataset> dataset_;
  IterableDatasetShardOptions options_;
};

// ---- the data loader ------------------------------------------------------------------------

/// Settings of a `DataLoader` (upstream: the keyword arguments of `torch.utils.data.DataLoader`).
struct DataLoaderOptions {
  /// Samples per batch (not with `batch_sampler`).
  int64_t batch_size = 1;
  /// Reshuffle the indices at every pass (not with `sampler` or `batch_sampler`).
  bool shuffle = false;
  /// Order of the indices (not with `shuffle`).
  std::shared_ptr<Sampler> sampler{};
  /// Batches of indices (not with `batch_size`, `shuffle`, `sampler` or `drop_last`).
  std::shared_ptr<BatchSampler> batch_sampler{};
  /// Threads that load and collate batches ahead of the loop, in order; 0 loads on the caller's thread.
  int num_workers = 0;
  /// Turns samples into a batch (default: `default_collate`).
  CollateFn collate_fn{};
  /// Leave out a short last batch.
  bool drop_last = false;
  /// Generator of the shuffled order (default: one seeded from LibTorch's default generator).
  std::optional<at::Generator> generator{};
  /// Batches loaded ahead per worker.
  int prefetch_factor = 2;
};

/// Where a data loader stands, to resume it later (upstream: `StatefulDataLoader.state_dict()`).
/// JSON through `to_json` / `from_json`, for checkpoints.
struct DataLoaderState {
  /// The pass the loader is in (or starts next).
  int64_t epoch = 0;
  /// Batches of that pass already delivered (skipped ones included); resuming starts after them.
  int64_t batches_yielded = 0;
  /// Whether the previous pass was delivered completely (then `epoch` is the next pass).
  bool iterator_finished = false;
  /// The sampler's generator state at the start of the pass (hex), empty without a generator.
  std::string generator_state{};
  /// The processes `batches_yielded` counts the batches of each of: a prepared loader's processes
  /// take their own batches of the whole order in turn, so its position of k batches stands for
  /// k x num_processes of them (1: the position counts whole batches, as with `split_batches`;
  /// 0: not known, as in states written before it was kept). Loading into a loader of another
  /// number of processes converts the position (beyond upstream: a job that changes size).
  int64_t num_processes = 0;

  /// The state as a JSON object with the five keys above ("num_processes" may be absent).
  std::string to_json() const;
  /// Parses `to_json`'s output; raises a ValueError naming the key that is missing or wrong.
  static DataLoaderState from_json(const std::string& text);
  bool operator==(const DataLoaderState&) const = default;
};

/// Loads batches from a dataset (upstream: `torch.utils.data.DataLoader`, and once prepared
/// `DataLoaderShard` or `DataLoaderDispatcher`). A cheap handle: copies share the loader and its
/// progress. Iterate it with a range-for; leaving the loop early is fine (the background threads
/// stop and `GradientState` forgets the loader).
class DataLoader {
 public:
  class Iterator;

  /// A loader over a map-style dataset.
  explicit DataLoader(std::shared_ptr<Dataset> dataset, DataLoaderOptions options = {});
  /// A loader over an iterable dataset (no `sampler`, `batch_sampler` or `shuffle`).
  explicit DataLoader(std::shared_ptr<IterableDataset> dataset, DataLoaderOptions options = {});
  /// A loader over a LibTorch dataset (see `make_dataset`).
  template <typename D, std::enable_if_t<data_detail::is_torch_dataset<D>::value, int> = 0>
  explicit DataLoader(D dataset, DataLoaderOptions options = {})
      : DataLoader(make_dataset(std::move(dataset)), std::move(options)) {}

  /// Starts a pass: synchronises the shuffling across processes, loads the first batch and
  /// looks one batch ahead (a collective for prepared loaders: every process must call it).
  Iterator begin() const;
  /// The iterator a finished pass compares equal to.
  Iterator end() const;

  /// Batches of a pass on this process (upstream: `len(dataloader)`).
  int64_t size() const;
  /// Samples per batch this loader yields; empty when batches vary in size.
  std::optional<int64_t> batch_size() const;
  /// Samples per batch over all processes (upstream: `total_batch_size`); empty when unknown.
  std::optional<int64_t> total_batch_size() const;
  /// Samples of the whole dataset over all processes (upstream: `total_dataset_length`).
  int64_t total_dataset_length() const;
  /// Whether a short last batch is left out (the setting of the loader that was prepared).
  bool drop_last() const;
  /// Background threads that load batches.
  int num_workers() const;

  /// Sets the epoch of the next pass, forwarded to the samplers and the dataset (upstream: `set_epoch`).
  void set_epoch(int64_t epoch) const;
  /// The current epoch: passes completed, or as set by `set_epoch`.
  int64_t iteration() const;
  /// Whether the batch being processed is the last of the pass.
  bool end_of_dataloader() const;
  /// Samples of the dataset in the last batch of all processes beyond a whole multiple (upstream:
  /// `remainder`), -1 when unknown or when the last batch is dropped.
  int64_t remainder() const;

  /// Where the loader stands: resuming from it starts exactly at the next batch.
  DataLoaderState state_dict() const;
  /// Makes the next pass resume from `state`.
  void load_state_dict(const DataLoaderState& state) const;

  /// The map-style dataset (null for an iterable one).
  std::shared_ptr<Dataset> dataset() const;
  /// The iterable dataset, sharded when prepared (null for a map-style one).
  std::shared_ptr<IterableDataset> iterable_dataset() const;
  /// The batch sampler (a `BatchSamplerShard` when prepared over several processes).
  std::shared_ptr<BatchSampler> batch_sampler() const;
  /// The index sampler inside the batch sampler, if any.
  std::shared_ptr<Sampler> sampler() const;
  /// Whether the loader was returned by `prepare_data_loader`.
  bool prepared() const;
  /// Whether only the main process reads and dispatches the batches.
  bool dispatch_batches() const;
  /// Whether batches are cut into one slice per process.
  bool split_batches() const;
  /// Whether checkpoints should store this loader's position (`use_stateful_dataloader`).
  bool use_stateful_dataloader() const;

  /// Implementation access for the library itself.
  const std::shared_ptr<detail::data::DataLoaderImpl>& impl() const { return impl_; }
  explicit DataLoader(std::shared_ptr<detail::data::DataLoaderImpl> impl);

 private:
  std::shared_ptr<detail::data::DataLoaderImpl> impl_;
};

/// One pass over a `DataLoader` (an input iterator; copies share the pass).
class DataLoader::Iterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = Example;
  using difference_type = std::ptrdiff_t;
  using pointer = Example*;
  using reference = Example&;

  /// The end of any pass.
  Iterator() = default;
  /// The current batch (the loop may move from it).
  Example& operator*() const;
  Example* operator->() const { return &**this; }
  /// Delivers the next batch (loading the one after it), or ends the pass.
  Iterator& operator++();
  void operator++(int) { ++*this; }
  friend bool operator==(const Iterator& a, const Iterator& b) {
    return a.done() == b.done() && (a.done() || a.it_ == b.it_);
  }

 private:
  friend class DataLoader;
  explicit Iterator(std::shared_ptr<detail::data::DataLoaderIteration> it) : it_(std::move(it)) {}
  bool done() const;
  std::shared_ptr<detail::data::DataLoaderIteration> it_;
};

// ---- preparation ----------------------------------------------------------------------------

/// How prepared data loaders behave (upstream: `DataLoaderConfiguration`).
struct DataLoaderConfiguration {
  /// Cut each batch of the loader into one slice per process (the batch size must be a round
  /// multiple of the number of processes) instead of giving each process whole batches.
  bool split_batches = false;
  /// Let only the main process read, and send every process its part; by default on for
  /// iterable datasets when batches are put on the device.
  std::optional<bool> dispatch_batches{};
  /// Give every process the same number of batches by reusing samples from the start.
  bool even_batches = true;
  /// Shuffle with a `SeedableRandomSampler` (seed + epoch) instead of a synchronised generator.
  bool use_seedable_sampler = false;
  /// Seed of the `SeedableRandomSampler` (default: LibTorch's initial seed).
  std::optional<uint64_t> data_seed{};
  /// Copy batches to the device without blocking.
  bool non_blocking = false;
  /// Store the loader's position in checkpoints (this library's loaders always keep it).
  bool use_stateful_dataloader = false;
};

/// Slices a dispatched batch for one process: rows [start, end) of every tensor by default.
using SliceFn =
    std::function<Example(const Example& batch, int64_t start, int64_t end, int process_index, int num_processes)>;

/// Arguments of `prepare_data_loader` (upstream: its keyword arguments).
struct PrepareDataLoaderOptions {
  /// Device for `put_on_device` (default: the state's device).
  std::optional<c10::Device> device{};
  /// Number of shards (default: the state's number of processes).
  std::optional<int> num_processes{};
  /// This process's shard (default: the state's process index).
  std::optional<int> process_index{};
  /// See `DataLoaderConfiguration`.
  bool split_batches = false;
  /// Move every batch to `device`.
  bool put_on_device = false;
  /// See `DataLoaderConfiguration::dispatch_batches`; needs `put_on_device`. A dispatching
  /// loader always splits over the state's processes (`num_processes`/`process_index` are ignored).
  std::optional<bool> dispatch_batches{};
  /// See `DataLoaderConfiguration`.
  bool even_batches = true;
  /// Slicing of dispatched batches (default: rows of every tensor and of list fields).
  SliceFn slice_fn_for_dispatch{};
  /// See `DataLoaderConfiguration`; replaces a `RandomSampler` batched by a `BatchSampler`
  /// (custom batch samplers keep their own sampler).
  bool use_seedable_sampler = false;
  /// See `DataLoaderConfiguration`.
  std::optional<uint64_t> data_seed{};
  /// See `DataLoaderConfiguration`.
  bool non_blocking = false;
  /// See `DataLoaderConfiguration`.
  bool use_stateful_dataloader = false;
  /// Global generators copied from process 0 at the start of every pass: "torch" (LibTorch's
  /// default CPU generator) and "cuda"; "generator" is accepted and means the loader's own
  /// generator, which a sharded shuffling loader always synchronises (upstream: `rng_types`).
  std::vector<std::string> rng_types{};

  /// The options that a `DataLoaderConfiguration` sets.
  static PrepareDataLoaderOptions from_config(const DataLoaderConfiguration& config);
};

/// The loader that this process iterates in a job of `state.num_processes()` processes (upstream:
/// `prepare_data_loader`). Batches are sharded by `BatchSamplerShard` or `IterableDatasetShard`,
/// or dispatched from the main process; the end of each pass and the padding of the last batch
/// are reported to `gradient_state`. The original loader's dataset and samplers are shared.
DataLoader prepare_data_loader(const DataLoader& loader, const PartialState& state, const GradientState& gradient_state,
                               const PrepareDataLoaderOptions& options = {});
/// `prepare_data_loader` on the process-wide states.
DataLoader prepare_data_loader(const DataLoader& loader, const PrepareDataLoaderOptions& options = {});

/// A loader like `loader` that skips the first `num_batches` batches of every pass, without
/// loading them from a map-style dataset (upstream: `skip_first_batches`). For a dispatching
/// loader the count is of the batches each process receives.
DataLoader skip_first_batches(const DataLoader& loader, int64_t num_batches = 0);

}  // namespace accelerate
