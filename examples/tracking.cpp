// Experiment tracking: fit y = 2x + 1 and log the loss and the parameters to TensorBoard, JSONL
// and CSV files. Run it alone or with `accelerate launch --num_processes 2`; only the main process
// writes. Then: `tensorboard --logdir runs/tracking_example`.
#include <accelerate/accelerate.h>

#include <torch/torch.h>

#include <memory>
#include <string>

namespace acc = accelerate;

int main(int argc, char** argv) {
  const std::string project_dir = argc > 1 ? argv[1] : "runs/tracking_example";
  // New Code //
  acc::Accelerator accelerator({.log_with = {"tensorboard", "jsonl", "csv"}, .project_dir = project_dir});
  torch::manual_seed(0);
  torch::nn::Linear net(1, 1);
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
  auto [model, optimizer] = accelerator.prepare(net, sgd);
  // New Code //
  accelerator.init_trackers("linear", {{"learning_rate", 0.1}, {"steps", 100}});

  const auto x = torch::linspace(-1, 1, 32).unsqueeze(1);
  const auto y = 2 * x + 1;
  double loss_value = 0;
  for (int64_t step = 0; step < 100; ++step) {
    auto loss = torch::mse_loss(model(x), y);
    accelerator.backward(loss);
    optimizer.step();
    optimizer.zero_grad();
    loss_value = loss.item<double>();
    // New Code //
    accelerator.log({{"loss", loss_value},
                     {"parameters", {{"weight", net->weight.item<double>()}, {"bias", net->bias.item<double>()}}}},
                    step);
  }
  // New Code //
  accelerator.end_training();
  accelerator.print("final loss", loss_value < 1e-3 ? "below 1e-3" : "too high");
  accelerator.print("logs in", accelerator.logging_dir() + "/linear; open them with: tensorboard --logdir",
                    accelerator.logging_dir());
  return 0;
}
