// The state behind a `DataLoader` handle, shared by the files of src/data/: data_loader.cpp
// (the loader and its passes), loader_state.cpp (its state dict), dispatch.cpp, workers.cpp and
// prepare.cpp.
#pragma once

#include "accelerate/data_loader.h"
#include "accelerate/state.h"

#include <ATen/core/Generator.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace accelerate::detail::data {

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

/// Forgets where the loader's pass stands (a prepared copy starts afresh).
void reset_progress(DataLoaderImpl& impl);
/// The generator the loader's order is drawn from (a dispatcher's: its base loader's), if any.
std::optional<at::Generator> generator_of(const DataLoaderImpl& impl);
/// Copies process 0's generator state to every process (upstream: synchronize_rng_states with
/// "generator").
void synchronize_generator(const PartialState& state, at::Generator generator);
/// Sets the epoch of the loader's sampler and dataset (and of its base loader's).
void set_epoch_everywhere(const DataLoaderImpl& impl, int64_t epoch);
/// The number of samples of the whole dataset.
int64_t dataset_length(const DataLoaderImpl& impl);
/// The number of batches of one pass.
int64_t loader_size(const DataLoaderImpl& impl);

}  // namespace accelerate::detail::data
