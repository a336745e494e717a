// Experiment tracking (upstream: examples/by_feature/tracking.py): log the configuration and the
// metrics of a run to TensorBoard event files and JSON lines, from the main process only.
//
//   accelerate launch -n 2 tracking --project_dir runs/tracking
//   tensorboard --logdir runs/tracking      # from any machine with TensorBoard installed
#include "task.h"

namespace acc = accelerate;

int main(int argc, char** argv) {
  acc::set_seed(42);
  const std::string project_dir = task::flag(argc, argv, "--project_dir", "runs/tracking");
  const double learning_rate = 1e-2;
  const int num_epochs = 4;
  // New Code //
  // Trackers by name ("tensorboard", "jsonl", "csv", "dvclive", or "all"), writing under
  // <project_dir>/<project name>.
  acc::Accelerator accelerator({.log_with = {"tensorboard", "jsonl"}, .project_dir = project_dir});
  accelerator.init_trackers("spirals", {{"learning_rate", learning_rate}, {"num_epochs", num_epochs}});
  // End New Code //
  task::MLP net;
  auto optimizer = std::make_shared<torch::optim::Adam>(net->parameters(), learning_rate);
  acc::DataLoader train_data(task::spirals(2048, 1), {.batch_size = 32, .shuffle = true});
  acc::DataLoader eval_data(task::spirals(512, 2), {.batch_size = 64});
  auto [model, opt, train, eval] = accelerator.prepare(net, optimizer, train_data, eval_data);

  int64_t step = 0;
  for (int epoch = 0; epoch < num_epochs; ++epoch) {
    double total_loss = 0;
    for (auto& batch : train) {
      auto loss = torch::nn::functional::cross_entropy(model(batch.data), batch.target);
      accelerator.backward(loss);
      opt.step();
      opt.zero_grad();
      total_loss += loss.item<double>();
      ++step;
    }
    const double accuracy = task::accuracy(accelerator, model, eval);
    accelerator.print("epoch", epoch, "accuracy", accuracy);
    // New Code //
    accelerator.log(
        {{"accuracy", accuracy}, {"train_loss", total_loss / static_cast<double>(train.size())}, {"epoch", epoch}},
        step);
    // End New Code //
  }
  // New Code //
  accelerator.end_training();  // flushes and closes every tracker
  // End New Code //
  return 0;
}
