// Checkpoints and resuming (upstream: examples/by_feature/checkpointing.py): save the whole
// training state every N steps or every epoch, and resume mid-epoch from a saved folder.
//
//   accelerate launch -n 2 checkpointing --output_dir runs/ckpt --checkpointing_steps epoch
//   accelerate launch -n 2 checkpointing --output_dir runs/ckpt --resume_from_checkpoint runs/ckpt/epoch_1
#include "task.h"

#include <filesystem>

namespace acc = accelerate;

int main(int argc, char** argv) {
  acc::set_seed(42);
  const std::string output_dir = task::flag(argc, argv, "--output_dir", "runs/checkpointing");
  // New Code //
  // "epoch", a number of steps, or "" for no checkpoints.
  const std::string checkpointing_steps = task::flag(argc, argv, "--checkpointing_steps", "epoch");
  const std::string resume_from = task::flag(argc, argv, "--resume_from_checkpoint", "");
  // End New Code //
  const int num_epochs = std::stoi(task::flag(argc, argv, "--num_epochs", "4"));
  acc::Accelerator accelerator;
  task::MLP net;
  auto optimizer = std::make_shared<torch::optim::Adam>(net->parameters(), 1e-2);
  auto schedule = acc::get_linear_schedule_with_warmup(optimizer, 10, 1000);
  acc::DataLoader train_data(task::spirals(2048, 1), {.batch_size = 32, .shuffle = true});
  acc::DataLoader eval_data(task::spirals(512, 2), {.batch_size = 64});
  auto [model, opt, train, eval, scheduler] = accelerator.prepare(net, optimizer, train_data, eval_data, schedule);

  // New Code //
  // The folder name says where training stopped: "epoch_<e>" after epoch e, "step_<s>" after s
  // steps. load_state restores model, optimizer, scheduler, random generators and the data order.
  int starting_epoch = 0;
  int64_t resume_step = 0;
  const auto steps_per_epoch = static_cast<int64_t>(train.size());
  if (!resume_from.empty()) {
    accelerator.print("resuming from", resume_from);
    accelerator.load_state(resume_from);
    const std::string name = std::filesystem::path(resume_from).filename().string();
    if (name.rfind("epoch_", 0) == 0) {
      starting_epoch = std::stoi(name.substr(6)) + 1;
    } else {
      const int64_t step = std::stoll(name.substr(5));
      starting_epoch = static_cast<int>(step / steps_per_epoch);
      resume_step = step % steps_per_epoch;
    }
  }
  // End New Code //

  int64_t overall_step = starting_epoch * steps_per_epoch;
  for (int epoch = starting_epoch; epoch < num_epochs; ++epoch) {
    // New Code //
    // Mid-epoch, skip the batches the saved run already trained on.
    acc::DataLoader loader =
        (epoch == starting_epoch && resume_step > 0) ? accelerator.skip_first_batches(train, resume_step) : train;
    overall_step += epoch == starting_epoch ? resume_step : 0;
    // End New Code //
    for (auto& batch : loader) {
      auto loss = torch::nn::functional::cross_entropy(model(batch.data), batch.target);
      accelerator.backward(loss);
      opt.step();
      scheduler.step();
      opt.zero_grad();
      ++overall_step;
      // New Code //
      if (!checkpointing_steps.empty() && checkpointing_steps != "epoch" &&
          overall_step % std::stoll(checkpointing_steps) == 0) {
        accelerator.save_state(output_dir + "/step_" + std::to_string(overall_step));
      }
      // End New Code //
    }
    accelerator.print("epoch", epoch, "accuracy", task::accuracy(accelerator, model, eval));
    // New Code //
    if (checkpointing_steps == "epoch") accelerator.save_state(output_dir + "/epoch_" + std::to_string(epoch));
    // End New Code //
  }
  return 0;
}
