// Finding a batch size that fits (upstream: examples/by_feature/memory.py): the training function
// takes the batch size as its first argument; `find_executable_batch_size` runs it with the
// starting size and, after each out-of-memory error, again with a smaller one.
//
//   accelerate launch -n 2 memory --starting_batch_size 256 --largest_batch_that_fits 100
//
// On a CPU with plenty of memory nothing runs out, so `--largest_batch_that_fits` pretends: a
// larger batch raises the out-of-memory error a device would.
#include "task.h"

namespace acc = accelerate;

int main(int argc, char** argv) {
  acc::set_seed(42);
  const int64_t starting = std::stoll(task::flag(argc, argv, "--starting_batch_size", "256"));
  const int64_t fits = std::stoll(task::flag(argc, argv, "--largest_batch_that_fits", "100"));
  acc::Accelerator accelerator;

  // New Code //
  auto train = acc::find_executable_batch_size(
      [&](int64_t batch_size) {
        accelerator.print("trying batch size", batch_size);
        // Everything sized by the batch is built inside, so a retry starts afresh.
        task::MLP net;
        auto optimizer = std::make_shared<torch::optim::Adam>(net->parameters(), 1e-2);
        acc::DataLoader train_data(task::spirals(2048, 1), {.batch_size = batch_size, .shuffle = true});
        acc::DataLoader eval_data(task::spirals(512, 2), {.batch_size = 64});
        auto [model, opt, loader, eval] = accelerator.prepare(net, optimizer, train_data, eval_data);
        for (int epoch = 0; epoch < 5; ++epoch) {
          for (auto& batch : loader) {
            if (batch.data.size(0) > fits) {
              throw c10::OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                          "DefaultCPUAllocator: not enough memory (pretended)");
            }
            auto loss = torch::nn::functional::cross_entropy(model(batch.data), batch.target);
            accelerator.backward(loss);
            opt.step();
            opt.zero_grad();
          }
        }
        accelerator.print("batch size", batch_size, "fits; accuracy", task::accuracy(accelerator, model, eval));
      },
      starting);
  train();
  // End New Code //
  return 0;
}
