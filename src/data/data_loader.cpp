// `DataLoader`: the handle, its passes over the data, and what they tell the GradientState; see
// include/accelerate/data_loader.h. Samplers, shards, workers and dispatch are in the files
// beside this one; the state dict in loader_state.cpp, `prepare_data_loader` in prepare.cpp.
#include "data/data_loader.h"

#include "accelerate/utils/operations.h"
#include "accelerate/utils/random.h"
#include "data/dispatch.h"
#include "data/loader_state.h"
#include "detail/collectives.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <mutex>

namespace accelerate {
namespace detail::data {

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

namespace {

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
    const bool prepared = is_prepared();
    // A step boundary, before the pass changes anything (the previous one, if any, has ended).
    if (prepared && L.gradient_state) L.gradient_state->at_step_boundary();
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
      source = dispatch_from_main(L, start);
    } else {
      source = look_ahead(open_stream(L, SkipPlan{0, start}));
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
      // A step boundary with a batch to come (after the last one, the next pass's start is).
      if (is_prepared() && impl->gradient_state) impl->gradient_state->at_step_boundary();
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

  bool is_prepared() const { return impl->kind != LoaderKind::kPlain; }

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

}  // namespace detail::data

// ---- DataLoader -----------------------------------------------------------------------------

namespace {

void check_common_options(const DataLoaderOptions& options) {
  TORCH_CHECK_VALUE(options.num_workers >= 0, "[DataLoader] num_workers must be >= 0, got ", options.num_workers);
  TORCH_CHECK_VALUE(options.prefetch_factor >= 1, "[DataLoader] prefetch_factor must be >= 1, got ",
                    options.prefetch_factor);
}

}  // namespace

DataLoader::DataLoader(std::shared_ptr<detail::data::DataLoaderImpl> impl) : impl_(std::move(impl)) {
  TORCH_INTERNAL_ASSERT(impl_ != nullptr);
}

DataLoader::DataLoader(std::shared_ptr<Dataset> dataset, DataLoaderOptions options)
    : impl_(std::make_shared<detail::data::DataLoaderImpl>()) {
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
    : impl_(std::make_shared<detail::data::DataLoaderImpl>()) {
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
  auto iteration = std::make_shared<detail::data::DataLoaderIteration>();
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

int64_t DataLoader::size() const { return detail::data::loader_size(*impl_); }
std::optional<int64_t> DataLoader::batch_size() const { return impl_->batch_size; }
std::optional<int64_t> DataLoader::total_batch_size() const { return impl_->total_batch_size; }
int64_t DataLoader::total_dataset_length() const { return detail::data::dataset_length(*impl_); }
bool DataLoader::drop_last() const { return impl_->drop_last; }
int DataLoader::num_workers() const { return impl_->num_workers; }

void DataLoader::set_epoch(int64_t epoch) const {
  TORCH_CHECK_VALUE(epoch >= 0, "[DataLoader] set_epoch expects an epoch >= 0, got ", epoch);
  impl_->iteration = epoch;
  detail::data::set_epoch_everywhere(*impl_, epoch);
}

int64_t DataLoader::iteration() const { return impl_->iteration; }
bool DataLoader::end_of_dataloader() const { return impl_->end_of_dataloader; }
int64_t DataLoader::remainder() const { return impl_->remainder; }

std::shared_ptr<Dataset> DataLoader::dataset() const { return impl_->dataset; }
std::shared_ptr<IterableDataset> DataLoader::iterable_dataset() const { return impl_->iterable; }
std::shared_ptr<BatchSampler> DataLoader::batch_sampler() const { return impl_->batch_sampler; }
std::shared_ptr<Sampler> DataLoader::sampler() const {
  return impl_->batch_sampler ? impl_->batch_sampler->sampler() : nullptr;
}
bool DataLoader::prepared() const { return impl_->kind != detail::data::LoaderKind::kPlain; }
bool DataLoader::dispatch_batches() const { return impl_->kind == detail::data::LoaderKind::kDispatcher; }
bool DataLoader::split_batches() const { return impl_->split_batches; }
bool DataLoader::use_stateful_dataloader() const { return impl_->use_stateful; }

}  // namespace accelerate
