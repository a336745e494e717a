// `prepare_data_loader` and `skip_first_batches`: a loader sharded over the processes, or
// dispatched from the main process, as upstream's `accelerate.data_loader` builds them.
#include "accelerate/data_loader.h"

#include "data/data_loader.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace accelerate {

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
  using detail::data::LoaderKind;
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

  auto impl = std::make_shared<detail::data::DataLoaderImpl>(src);
  detail::data::reset_progress(*impl);
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
    auto base = std::make_shared<detail::data::DataLoaderImpl>(src);
    detail::data::reset_progress(*base);
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
  auto impl = std::make_shared<detail::data::DataLoaderImpl>(*loader.impl());
  detail::data::reset_progress(*impl);
  impl->skip_batches = num_batches;
  return DataLoader(std::move(impl));
}

}  // namespace accelerate
