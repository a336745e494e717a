// The C++ side of the checkpoint interop tests (tests/multiprocess/python_checkpoint_test.cpp): the
// training of tests/python/upstream_checkpoint.py (an MLP whose weights and data are formulas of
// their indices, AdamW, a linear warm-up schedule), each process on its shard of the batch.
//
//   mp_python_interop STEPS_TO [--steps-from K --load DIR] [--save-at K --save DIR]
//                     [--scheduler linear|none] --out RESULT.json
//
// `--load` reads a folder with load_state (its layout detected); `--save` writes one in Python
// Accelerate's layout, before step K (after the last when K is STEPS_TO). `--scheduler none` trains at a fixed rate (upstream steps a scheduler once
// per process, so runs at different process counts only agree without one). RESULT.json (process 0) holds the parameters, the rate, four draws of the
// global generator after the load or the save, the accelerator's step (upstream's: one per
// `accumulate`) and the loss of the last step.
#include "accelerate/accelerate.h"

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <fstream>
#include <optional>
#include <iostream>
#include <string>

namespace acc = accelerate;

namespace {

constexpr int64_t kBatch = 8;

torch::nn::Sequential make_model() {
  torch::nn::Sequential net(torch::nn::Linear(4, 8), torch::nn::Tanh(), torch::nn::Linear(8, 3));
  torch::NoGradGuard no_grad;
  int k = 0;
  for (auto& p : net->parameters()) {
    auto i = torch::arange(p.numel(), torch::kDouble);
    p.copy_((0.3 * torch::sin(0.7 * i + k)).reshape(p.sizes()).to(torch::kFloat));
    ++k;
  }
  return net;
}

std::pair<at::Tensor, at::Tensor> batch(int64_t step) {
  auto n = torch::arange(kBatch, torch::kDouble).unsqueeze(1) + static_cast<double>(step * kBatch);
  auto x = torch::cos(0.1 * n + 0.37 * torch::arange(4, torch::kDouble)).to(torch::kFloat);
  auto y = torch::sin(0.2 * n + torch::arange(3, torch::kDouble)).to(torch::kFloat);
  return {x, y};
}

}  // namespace

int main(int argc, char** argv) {
  int64_t steps_from = 0, steps_to = -1, save_at = -1;
  std::string load, save, out, scheduler_kind = "linear";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--steps-from") steps_from = std::stoll(value);
    else if (flag == "--steps-to") steps_to = std::stoll(value);
    else if (flag == "--save-at") save_at = std::stoll(value);
    else if (flag == "--load") load = value;
    else if (flag == "--save") save = value;
    else if (flag == "--out") out = value;
    else if (flag == "--scheduler") scheduler_kind = value;
    else {
      std::cerr << "mp_python_interop: unknown flag " << flag << "\n";
      return 2;
    }
  }
  if (steps_to < 0 || out.empty()) {
    std::cerr << "usage: mp_python_interop --steps-to N [--steps-from K --load DIR] [--save-at K --save DIR] --out F\n";
    return 2;
  }
  acc::Accelerator accelerator;
  torch::manual_seed(100 + accelerator.process_index());
  auto net = make_model();
  auto adamw = std::make_shared<torch::optim::AdamW>(
      net->parameters(), torch::optim::AdamWOptions(0.01).betas({0.9, 0.999}).eps(1e-8).weight_decay(0.01));
  std::optional<acc::AcceleratedScheduler> scheduler;
  auto [model, optimizer] = accelerator.prepare(net, adamw);
  if (scheduler_kind == "linear") scheduler = accelerator.prepare_scheduler(acc::get_linear_schedule_with_warmup(adamw, 3, 20));

  std::vector<double> draws;
  const auto draw = [&] {
    auto t = torch::rand({4});
    draws.assign(t.data_ptr<float>(), t.data_ptr<float>() + 4);
  };
  if (!load.empty()) {
    accelerator.load_state(load);
    draw();
  }
  double last_loss = 0;
  const int64_t processes = accelerator.num_processes();
  const int64_t rank = accelerator.process_index();
  for (int64_t step = steps_from; step < steps_to; ++step) {
    if (step == save_at) {
      accelerator.save_state(save, {.layout = acc::CheckpointLayout::kPython});
      draw();
    }
    auto guard = accelerator.accumulate(model);  // counts the accelerator's step, saved with the state
    auto [x, y] = batch(step);
    const int64_t per = kBatch / processes;
    auto loss = torch::mse_loss(model(x.narrow(0, rank * per, per)), y.narrow(0, rank * per, per));
    optimizer.zero_grad();
    accelerator.backward(loss);
    optimizer.step();
    if (scheduler) scheduler->step();
    last_loss = loss.item<double>();
  }
  if (save_at == steps_to) {  // the state the result shows
    accelerator.save_state(save, {.layout = acc::CheckpointLayout::kPython});
    draw();
  }
  const auto weights = accelerator.get_state_dict(model);  // a collective when fully sharded
  if (accelerator.is_main_process()) {
    nlohmann::json result;
    for (const auto& item : weights) {
      auto t = item.value().contiguous();
      result["params"][item.key()] = std::vector<float>(t.data_ptr<float>(), t.data_ptr<float>() + t.numel());
    }
    result["lr"] = scheduler ? scheduler->get_last_lr().at(0) : 0.01;
    result["draws"] = draws;
    result["step"] = accelerator.step();
    result["loss"] = last_loss;
    std::ofstream(out) << result.dump();
  }
  return 0;
}
