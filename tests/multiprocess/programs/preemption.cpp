// A training run that stops when the job is asked to (AcceleratorOptions::preemption), for
// tests/multiprocess/preemption_test.cpp. It fits a linear model with SGD and momentum over a
// shuffled, prepared data loader (2 batches accumulated per step) for --steps optimizer steps,
// counting its steps in an object registered for checkpointing, and writes the final weights to
// <dir>/final.safetensors.
//   --dir DIR        the project folder (checkpoints under DIR/checkpoints)
//   --steps N        optimizer steps in all (default 12)
//   --resume         load the newest checkpoint first
//   --resume_if_saved  load the newest checkpoint when there is one (a job that is started again
//                    by its scheduler, as a requeued Slurm job is)
//   --mark N         after step N, each process writes its pid to DIR/mark_<rank> and the steps
//                    slow down (0.5 s each), so that a signal sent then finds the job running
//   --manual         save_on_preemption off: the loop asks preemption_requested() after each
//                    step, and on a request prints "rank <r>: asked to stop after step <k>",
//                    saves and ends with kPreemptedExitCode itself
//   --signals A,B    the signals that ask the job to stop (default: PreemptionKwargs's)
//   --save_at N      save_state() after step N, as a periodic save does
//   --total_limit L  ProjectConfiguration::total_limit
//   --raise_after_save  every process raises SIGUSR1 right after the save of --save_at
//   --raise_before_load every process raises SIGUSR1 right before load_state() resumes
#include "accelerate/accelerate.h"
#include "step_counter.h"

#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unistd.h>

namespace acc = accelerate;

namespace {

using Progress = accelerate::testing::StepCounter;

}  // namespace

int main(int argc, char** argv) {
  std::string dir, signals;
  int64_t steps = 12, mark = -1, save_at = -1, total_limit = 0;
  bool resume = false, resume_if_saved = false, manual = false, raise_after_save = false, raise_before_load = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const auto value = [&] {
      if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
      return std::string(argv[++i]);
    };
    if (flag == "--dir") {
      dir = value();
    } else if (flag == "--steps") {
      steps = std::stoll(value());
    } else if (flag == "--mark") {
      mark = std::stoll(value());
    } else if (flag == "--signals") {
      signals = value();
    } else if (flag == "--resume") {
      resume = true;
    } else if (flag == "--resume_if_saved") {
      resume_if_saved = true;
    } else if (flag == "--manual") {
      manual = true;
    } else if (flag == "--save_at") {
      save_at = std::stoll(value());
    } else if (flag == "--total_limit") {
      total_limit = std::stoll(value());
    } else if (flag == "--raise_after_save") {
      raise_after_save = true;
    } else if (flag == "--raise_before_load") {
      raise_before_load = true;
    } else {
      throw std::invalid_argument("unknown argument " + flag);
    }
  }
  if (dir.empty()) throw std::invalid_argument("--dir is required");

  acc::PreemptionKwargs preemption;
  preemption.save_on_preemption = !manual;
  if (!signals.empty()) {
    preemption.signals.clear();
    std::istringstream names(signals);
    for (std::string name; std::getline(names, name, ',');) preemption.signals.push_back(name);
  }
  acc::Accelerator accelerator({.gradient_accumulation_steps = 2,
                                .dataloader_config = {.use_stateful_dataloader = true},  // resume mid-pass
                                .project_dir = dir,
                                .project_config = {.automatic_checkpoint_naming = true, .total_limit = static_cast<int>(total_limit)},
                                .preemption = preemption});
  acc::set_seed(7);
  auto net = torch::nn::Linear(8, 1);
  auto optimizer = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const auto x = torch::linspace(-1, 1, 64 * 8).reshape({64, 8});
  const auto y = x.matmul(torch::linspace(0.5, -0.5, 8).reshape({8, 1})) + 0.1;
  acc::DataLoader data(std::make_shared<acc::TensorDataset>(x, y), {.batch_size = 4, .shuffle = true});
  auto [model, opt, loader] = accelerator.prepare(net, optimizer, data);
  auto progress = std::make_shared<Progress>();
  accelerator.register_for_checkpointing(progress);
  if (resume || (resume_if_saved && std::filesystem::exists(dir + "/checkpoints"))) {
    if (raise_before_load) std::raise(SIGUSR1);
    accelerator.load_state();
  }

  while (progress->step < steps) {
    for (auto& batch : loader) {
      auto sync = accelerator.accumulate(model);
      accelerator.backward(torch::mse_loss(model(batch.data), batch.target));
      opt.step();
      opt.zero_grad();
      if (!accelerator.sync_gradients()) continue;
      const int64_t step = ++progress->step;
      accelerator.print("step " + std::to_string(step));
      if (mark >= 0 && step >= mark) {
        if (step == mark) {
          std::ofstream(dir + "/mark_" + std::to_string(accelerator.process_index())) << ::getpid() << "\n";
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
      }
      if (manual && accelerator.preemption_requested()) {
        std::cout << "rank " << accelerator.process_index() << ": asked to stop after step " << step << std::endl;
        accelerator.save_state();
        return acc::kPreemptedExitCode;
      }
      if (step == save_at) {
        accelerator.save_state();
        if (raise_after_save) std::raise(SIGUSR1);
      }
      if (step >= steps) break;
    }
  }
  accelerator.wait_for_everyone();
  if (accelerator.is_main_process()) {
    acc::save_file({{"weight", net->weight.detach()}, {"bias", net->bias.detach()}}, dir + "/final.safetensors");
  }
  accelerator.print("finished at step " + std::to_string(progress->step));
  return 0;
}
