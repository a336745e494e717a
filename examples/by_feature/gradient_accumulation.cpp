// Gradient accumulation (upstream: examples/by_feature/gradient_accumulation.py): several batches
// per optimizer step, without synchronising gradients between processes until the last one.
//
//   accelerate launch -n 2 gradient_accumulation --gradient_accumulation_steps 4
#include "task.h"

namespace acc = accelerate;

int main(int argc, char** argv) {
  acc::set_seed(42);
  // New Code //
  const int steps = std::stoi(task::flag(argc, argv, "--gradient_accumulation_steps", "4"));
  acc::Accelerator accelerator({.gradient_accumulation_steps = steps});
  // End New Code //
  task::MLP net;
  auto optimizer = std::make_shared<torch::optim::Adam>(net->parameters(), 1e-2);
  acc::DataLoader train_data(task::spirals(2048, 1), {.batch_size = 16, .shuffle = true});
  acc::DataLoader eval_data(task::spirals(512, 2), {.batch_size = 64});
  auto [model, opt, train, eval] = accelerator.prepare(net, optimizer, train_data, eval_data);

  for (int epoch = 0; epoch < 8; ++epoch) {
    for (auto& batch : train) {
      // New Code //
      // Inside `accumulate`, backward() adds to the gradients and step()/zero_grad() act only on
      // every `steps`-th batch (and on the last batch of the pass).
      auto guard = accelerator.accumulate(model);
      // End New Code //
      auto loss = torch::nn::functional::cross_entropy(model(batch.data), batch.target);
      accelerator.backward(loss);
      opt.step();
      opt.zero_grad();
    }
    accelerator.print("epoch", epoch, "accuracy", task::accuracy(accelerator, model, eval));
  }
  return 0;
}
