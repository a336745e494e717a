// Experiment tracking to the services teams already use: one run logged to an MLflow tracking
// server and, at the same time, as a W&B offline run (upstream: examples/by_feature/tracking.py
// with log_with=["mlflow", "wandb"]). Nothing here waits for the network: an MLflow server that
// is down or restarted loses nothing (see MLflowTracker), and W&B's run is uploaded later.
//
//   mlflow server --host 127.0.0.1 --port 5000 &               # any machine with mlflow installed
//   MLFLOW_TRACKING_URI=http://127.0.0.1:5000 accelerate launch -n 2 tracking_services
//   wandb sync wandb/offline-run-*                              # from any machine with wandb and a login
#include "task.h"

#include <cstdlib>
#include <iostream>

namespace acc = accelerate;

int main(int argc, char** argv) {
  acc::set_seed(42);
  const std::string project_dir = task::flag(argc, argv, "--project_dir", "runs/tracking_services");
  const double learning_rate = 1e-2;
  const int num_epochs = 4;
  if (std::getenv("MLFLOW_TRACKING_URI") == nullptr) {
    std::cerr << "tracking_services: set MLFLOW_TRACKING_URI to an MLflow tracking server (mlflow server --host "
                 "127.0.0.1 --port 5000; then MLFLOW_TRACKING_URI=http://127.0.0.1:5000)\n";
    return 2;
  }
  // New Code //
  // "mlflow" speaks to the server at MLFLOW_TRACKING_URI; "wandb" writes ./wandb/offline-run-*
  // (WANDB_DIR moves it). Each tracker's own options go in init_kwargs, under its name.
  acc::Accelerator accelerator({.log_with = {"mlflow", "wandb"}, .project_dir = project_dir});
  accelerator.init_trackers("spirals", {{"learning_rate", learning_rate}, {"num_epochs", num_epochs}},
                            {{"mlflow", {{"run_name", "mlp"}, {"tags", {{"example", "tracking_services"}}}}},
                             {"wandb", {{"name", "mlp"}, {"tags", {"example"}}, {"mode", "offline"}}}});
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
  // Ends both runs: W&B's exit record is written, and MLflow's queue is sent (up to the
  // tracker's flush_timeout) before the run is marked FINISHED.
  accelerator.end_training();
  // End New Code //
  return 0;
}
