// A training run for an elastic job (tests/multihost/elastic_test.cpp): each time its group is
// formed, whatever its size, it resumes from the newest complete checkpoint, and it keeps the
// global batch at 16 samples by choosing its accumulation steps for the world size, as a user of
// upstream's GradientAccumulationPlugin would. It fits a small MLP, fully sharded when launched
// with --use_fsdp, with AdamW over a shuffled, stateful data loader of 2 samples per batch, saves
// the state after every optimizer step, and writes the final weights to <dir>/final.safetensors.
//   --dir DIR      the project folder (checkpoints under DIR/checkpoints)
//   --steps N      optimizer steps in all
//   --pace S       seconds each step is made to last (so that a test can act between steps)
// The main process prints "resumed at step <s> with <world> processes" when it loads a checkpoint,
// "step <s> world <w> accumulation <a> loss <l>" after each step, and writes "<round> <step>" to
// <dir>/progress once the step is saved (round: the launcher's attempt).
#include "accelerate/accelerate.h"
#include "step_counter.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

namespace acc = accelerate;

namespace {

using Progress = accelerate::testing::StepCounter;

constexpr int kGlobalBatch = 16;
constexpr int kBatch = 2;

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  int64_t steps = 0;
  double pace = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--dir") {
      dir = value;
    } else if (flag == "--steps") {
      steps = std::stoll(value);
    } else if (flag == "--pace") {
      pace = std::stod(value);
    } else {
      throw std::invalid_argument("unknown argument " + flag);
    }
  }
  if (dir.empty() || steps <= 0) throw std::invalid_argument("usage: mp_elastic --dir DIR --steps N [--pace S]");

  // The global batch stays 16 samples, whatever the group's size.
  const int world = acc::PartialState().num_processes();
  if (kGlobalBatch % (kBatch * world) != 0) throw std::invalid_argument("16 samples do not divide over the processes");
  const int accumulation = kGlobalBatch / (kBatch * world);
  acc::Accelerator accelerator({.gradient_accumulation_plugin = acc::GradientAccumulationPlugin{.num_steps = accumulation},
                                .dataloader_config = {.use_stateful_dataloader = true},
                                .project_dir = dir,
                                .project_config = {.automatic_checkpoint_naming = true, .total_limit = 3}});
  acc::set_seed(11);
  auto net = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::Tanh(), torch::nn::Linear(32, 1));
  auto optimizer = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.01));
  const auto x = torch::linspace(-1, 1, 256 * 8).reshape({256, 8}).sin();
  const auto y = x.matmul(torch::linspace(0.5, -0.5, 8).reshape({8, 1})).tanh() + 0.1;
  acc::DataLoader data(std::make_shared<acc::TensorDataset>(x, y), {.batch_size = kBatch, .shuffle = true});
  auto [model, opt, loader] = accelerator.prepare(net, optimizer, data);
  auto progress = std::make_shared<Progress>();
  accelerator.register_for_checkpointing(progress);
  if (std::filesystem::exists(dir + "/checkpoints")) {
    accelerator.load_state();
    accelerator.print("resumed at step " + std::to_string(progress->step) + " with " + std::to_string(world) +
                      " processes");
  }
  const char* round = std::getenv("TORCHELASTIC_RESTART_COUNT");

  torch::Tensor losses = torch::zeros({});
  while (progress->step < steps) {
    for (auto& batch : loader) {
      auto sync = accelerator.accumulate(model);
      const auto loss = torch::mse_loss(model(batch.data), batch.target);
      losses += loss.detach();
      accelerator.backward(loss);
      opt.step();
      opt.zero_grad();
      if (!accelerator.sync_gradients()) continue;
      const int64_t step = ++progress->step;
      // The mean over the global batch: every process saw `accumulation` batches of the same size.
      const auto global = accelerator.reduce(losses / accumulation, "mean");
      losses = torch::zeros({});
      std::ostringstream line;
      line << "step " << step << " world " << world << " accumulation " << accumulation << " loss "
           << std::setprecision(9) << global.item<double>();
      accelerator.print(line.str());
      accelerator.save_state();
      if (accelerator.is_main_process()) {
        const std::string tmp = dir + "/progress.tmp";
        std::ofstream(tmp) << (round != nullptr ? round : "0") << " " << step << "\n";
        std::rename(tmp.c_str(), (dir + "/progress").c_str());
      }
      if (pace > 0) std::this_thread::sleep_for(std::chrono::duration<double>(pace));
      if (step >= steps) break;
    }
  }
  const auto state = accelerator.get_state_dict(model);
  if (accelerator.is_main_process()) {
    acc::TensorMap tensors;
    for (const auto& item : state) tensors[item.key()] = item.value();
    acc::save_file(tensors, dir + "/final.safetensors");
  }
  accelerator.wait_for_everyone();
  accelerator.print("finished at step " + std::to_string(progress->step));
  return 0;
}
