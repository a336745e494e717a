// A program for the data-loader launcher tests: every process prepares a loader over
// arange(32 × num_processes) (batch size 8), iterates it, gathers each batch from all processes,
// and the main process prints what was gathered, one line per mode:
//
//   mp_data_loader MODE...     MODE: shard, split, shuffle, shuffle_split, dispatch,
//                              dispatch_split, dispatch_shuffle, iterable, workers, metrics
//
// "metrics" uses 32 × num_processes + 3 samples and gather_for_metrics, which drops the samples
// repeated to complete the last round.
#include "accelerate/data_loader.h"
#include "accelerate/state.h"
#include "accelerate/utils/operations.h"

#include <ATen/ATen.h>

#include <iostream>
#include <sstream>
#include <string>

namespace acc = accelerate;

namespace {

acc::DataLoader make_loader(const std::string& mode, int64_t length) {
  const bool shuffle = mode.find("shuffle") != std::string::npos;
  if (mode == "iterable") {
    return acc::DataLoader(acc::make_iterable_dataset(
                               [length]() -> acc::ExampleGenerator {
                                 return [length, i = int64_t{0}]() mutable -> std::optional<acc::Example> {
                                   if (i >= length) return std::nullopt;
                                   return acc::Example{at::scalar_tensor(i++, at::kLong)};
                                 };
                               },
                               length),
                           {.batch_size = 8});
  }
  return acc::DataLoader(std::make_shared<acc::TensorDataset>(at::arange(length)),
                         {.batch_size = 8, .shuffle = shuffle, .num_workers = mode == "workers" ? 2 : 0});
}

}  // namespace

int main(int argc, char** argv) {
  acc::PartialState state;
  acc::GradientState gradient_state;
  for (int i = 1; i < argc; ++i) {
    const std::string mode = argv[i];
    const bool metrics = mode == "metrics";
    const int64_t length = 32 * state.num_processes() + (metrics ? 3 : 0);
    acc::PrepareDataLoaderOptions options;
    options.split_batches = mode.find("split") != std::string::npos;
    if (mode.rfind("dispatch", 0) == 0) {
      options.put_on_device = true;
      options.dispatch_batches = true;
    }
    auto loader = acc::prepare_data_loader(make_loader(mode, length), state, gradient_state, options);
    std::ostringstream line;
    line << mode << ":";
    for (auto& batch : loader) {
      const auto all =
          metrics ? acc::gather_for_metrics(state, gradient_state, batch.data) : acc::gather(state, batch.data);
      for (int64_t k = 0; k < all.numel(); ++k) line << " " << all[k].item<int64_t>();
    }
    if (state.is_main_process()) std::cout << line.str() << std::endl;
  }
  state.wait_for_everyone();
  return 0;
}
