// A program for the checkpoint tests: trains a small model (Adam, a warm-up schedule, dropout
// drawing from the global generator, a shuffling data loader, gradient accumulation 2) for three
// epochs, in one go or interrupted by `save_state` and resumed by `load_state` in a new process.
//
//   mp_checkpoint full PROJECT OUT            train 3 epochs, write OUT.<process>.safetensors
//   mp_checkpoint first PROJECT               train 2 epochs, save_state (checkpoints/checkpoint_<i>)
//   mp_checkpoint second PROJECT OUT [save]   load_state(), train to the end of epoch 3, write OUT…;
//                                             with "save", save_state again at the end
//   mp_checkpoint stateful-first PROJECT      as first, with use_stateful_dataloader, saving after
//                                             batch 10 (an optimizer step in the middle of the
//                                             second epoch: accumulated gradients are not saved)
//   mp_checkpoint stateful-second PROJECT OUT load_state(), finish the three epochs, write OUT…
//   mp_checkpoint failwrite PROJECT           train 1 epoch; the last process cannot write files
//                                             larger than 1 KiB; save_state must fail everywhere
//
// With MP_CHECKPOINT_SAVE_ON_EACH_NODE set, the project saves with save_on_each_node.
//
// OUT holds the model's tensors, the optimizer's state tensors, the order of the samples of the
// third epoch, four draws of the global generator after training, and in its metadata the
// learning rate, the accelerator's step count and the optimizer's JSON state. The checkpoint
// tests compare these files bit for bit.
#include "accelerate/accelerate.h"

#include <torch/torch.h>

#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <iostream>
#include <string>

namespace acc = accelerate;

namespace {

constexpr int64_t kSamples = 48;
constexpr int64_t kBatch = 4;
constexpr int64_t kEpochs = 3;

struct Job {
  acc::Accelerator accelerator;
  acc::PreparedModel<torch::nn::Sequential> model;
  acc::AcceleratedOptimizer optimizer;
  acc::AcceleratedScheduler scheduler;
  acc::DataLoader loader;
};

Job make_job(const std::string& project, bool stateful) {
  acc::AcceleratorOptions options;
  options.gradient_accumulation_steps = 2;
  options.project_config = {.project_dir = project, .automatic_checkpoint_naming = true, .total_limit = 3};
  // The multi-host tests save on every machine's local main process.
  options.project_config.save_on_each_node = std::getenv("MP_CHECKPOINT_SAVE_ON_EACH_NODE") != nullptr;
  options.dataloader_config.use_stateful_dataloader = stateful;
  // MP_CHECKPOINT_TIMEOUT: the process group's timeout in seconds (the tests of cut links).
  if (const char* timeout = std::getenv("MP_CHECKPOINT_TIMEOUT")) {
    options.init_process_group_kwargs.timeout = std::chrono::seconds(std::stoi(timeout));
  }
  acc::Accelerator accelerator(options);
  acc::set_seed(1234);

  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  auto x = at::randn({kSamples, 4}, gen);
  auto y = x.sum(1, /*keepdim=*/true);
  auto index = at::arange(kSamples, at::kFloat).unsqueeze(1);
  auto data = std::make_shared<acc::TensorDataset>(x, at::cat({y, index}, 1));
  acc::DataLoader loader(data, {.batch_size = kBatch, .shuffle = true});

  torch::nn::Sequential net(torch::nn::Linear(4, 16), torch::nn::ReLU(), torch::nn::Linear(16, 1));
  auto adam = std::make_shared<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-2));
  auto schedule = acc::get_linear_schedule_with_warmup(adam, 3, 40);
  auto [model, optimizer, scheduler, prepared_loader] = accelerator.prepare(net, adam, schedule, loader);
  return Job{accelerator, model, optimizer, scheduler, prepared_loader};
}

// Trains until the end of epoch `until` (or after `stop_after` batches of this run); returns the
// sample indices of the last epoch's batches.
at::Tensor train(Job& job, int64_t until, int64_t stop_after = -1) {
  std::vector<at::Tensor> last_epoch;
  int64_t batches = 0;
  for (int64_t epoch = job.loader.iteration(); epoch < until; ++epoch) {
    for (auto& batch : job.loader) {
      auto guard = job.accelerator.accumulate(job.model);
      auto out = torch::dropout(job.model(batch.data), 0.2, /*train=*/true);
      auto loss = torch::mse_loss(out, batch.target.narrow(1, 0, 1));
      job.accelerator.backward(loss);
      job.optimizer.step();
      job.scheduler.step();
      job.optimizer.zero_grad();
      if (epoch == kEpochs - 1) last_epoch.push_back(batch.target.select(1, 1).clone());
      if (++batches == stop_after) return {};
    }
  }
  return last_epoch.empty() ? at::empty({0}) : at::cat(last_epoch);
}

void write_result(Job& job, const std::string& out, const at::Tensor& order) {
  acc::TensorMap tensors;
  for (const auto& item : job.accelerator.get_state_dict(job.model)) tensors.emplace("model." + item.key(), item.value());
  const auto optimizer = acc::optimizer_state_dict(*job.optimizer.optimizer());
  for (const auto& [name, t] : optimizer.tensors) tensors.emplace("optimizer." + name, t);
  tensors.emplace("order", order);
  tensors.emplace("draws", torch::rand({4}));
  acc::SafetensorsMetadata metadata{{"lr", std::to_string(job.scheduler.get_last_lr().at(0))},
                                    {"step", std::to_string(job.accelerator.step())},
                                    {"optimizer", optimizer.values.dump()},
                                    {"iteration", std::to_string(job.accelerator.save_iteration())}};
  acc::save_file(tensors, out + "." + std::to_string(job.accelerator.process_index()) + ".safetensors", metadata);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: mp_checkpoint MODE PROJECT [OUT] [save]\n";
    return 2;
  }
  const std::string mode = argv[1], project = argv[2], out = argc > 3 ? argv[3] : "";
  const bool stateful = mode.rfind("stateful", 0) == 0;
  auto job = make_job(project, stateful);
  if (mode == "full") {
    write_result(job, out, train(job, kEpochs));
  } else if (mode == "first") {
    train(job, 2);
    job.accelerator.save_state();
  } else if (mode == "stateful-first") {
    train(job, kEpochs, 10);
    job.accelerator.save_state();
  } else if (mode == "second" || mode == "stateful-second") {
    job.accelerator.load_state();
    write_result(job, out, train(job, kEpochs));
    if (argc > 4 && std::string(argv[4]) == "save") job.accelerator.save_state();
  } else if (mode == "failwrite") {
    train(job, 1);
    if (job.accelerator.is_last_process()) {
      std::signal(SIGXFSZ, SIG_IGN);
      struct rlimit limit {1024, 1024};
      ::setrlimit(RLIMIT_FSIZE, &limit);
    }
    try {
      job.accelerator.save_state();
    } catch (const std::exception& e) {
      std::cout << "save failed: " << e.what() << std::endl;
      job.accelerator.wait_for_everyone();  // the owner removes the staging folder after the failure
      const bool left = std::filesystem::exists(std::filesystem::path(project) / "checkpoints" / "checkpoint_0") ||
                        std::filesystem::exists(std::filesystem::path(project) / "checkpoints" / ".checkpoint_0.partial");
      return left ? 4 : 0;
    }
    std::cout << "save succeeded" << std::endl;
    return 3;
  } else {
    std::cerr << "mp_checkpoint: unknown mode " << mode << "\n";
    return 2;
  }
  return 0;
}
