// A program for the training launcher tests: upstream's equivalence check (its test script's
// `training_check`). Every process first trains y = a·x + b for 3 epochs with SGD on one process
// over batches of 8 × num_processes (the baseline), then trains it again through an Accelerator
// whose processes read batches of 8 — and must end with the same a and b:
//
//   mp_training MODE...   MODE: plain, split_batches, bf16, seedable, mismatch
//
// "mismatch" prepares a model whose shape differs on the last process (an error path).
// The main process prints "<mode>: a=<a> b=<b> baseline a=<a> b=<b>" and "<mode>: OK" on success;
// a mismatch throws, which makes the process (and the launch) fail.
#include "accelerate/accelerate.h"

#include <torch/torch.h>

#include <cmath>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>

namespace acc = accelerate;

namespace {

struct RegressionModelImpl : torch::nn::Module {
  RegressionModelImpl() {
    a = register_parameter("a", torch::zeros({}));
    b = register_parameter("b", torch::zeros({}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return x * a + b; }
  torch::Tensor a, b;
};
TORCH_MODULE(RegressionModel);

// y = 2x + 3 + noise, from a seeded generator (upstream: RegressionDataset(length, seed=42)).
std::shared_ptr<acc::TensorDataset> regression_dataset(int64_t length) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(42);
  auto x = at::randn({length}, gen);
  auto y = 2 * x + 3 + 0.1 * at::randn({length}, gen);
  return std::make_shared<acc::TensorDataset>(x, y);
}

acc::DataLoader baseline_loader(const std::shared_ptr<acc::TensorDataset>& data, int64_t batch_size, bool seedable,
                                at::Generator generator) {
  if (seedable) {
    auto sampler = std::make_shared<acc::SeedableRandomSampler>(data->size(), acc::RandomSamplerOptions{}, 42);
    return acc::DataLoader(data, {.batch_size = batch_size, .sampler = sampler});
  }
  return acc::DataLoader(data, {.batch_size = batch_size, .shuffle = true, .generator = generator});
}

template <typename Step>
void train_three_epochs(const acc::DataLoader& loader, Step&& step) {
  for (int epoch = 0; epoch < 3; ++epoch) {
    loader.set_epoch(epoch);
    for (auto& batch : loader) step(batch);
  }
}

void check(const std::string& mode) {
  acc::AcceleratorOptions options;
  options.dataloader_config.split_batches = mode == "split_batches";
  options.dataloader_config.use_seedable_sampler = mode == "seedable";
  if (mode == "seedable") options.dataloader_config.data_seed = 42;
  options.mixed_precision = mode == "bf16" ? "bf16" : "no";
  acc::AcceleratorState::reset(/*reset_partial_state=*/false);
  acc::Accelerator accelerator(options);
  const int n = accelerator.num_processes();
  const int64_t batch = 8;
  auto data = regression_dataset(batch * 4 * n);
  const bool seedable = mode == "seedable";

  if (mode == "mismatch") {
    torch::nn::Linear model(accelerator.is_last_process() ? 3 : 2, 1);
    (void)accelerator.prepare(model);
    return;
  }

  // The baseline: one process, batches of batch × n.
  auto generator = at::make_generator<at::CPUGeneratorImpl>(42);
  RegressionModel baseline;
  torch::optim::SGD baseline_opt(baseline->parameters(), 0.1);
  train_three_epochs(baseline_loader(data, batch * n, seedable, generator), [&](acc::Example& b) {
    baseline_opt.zero_grad();
    torch::mse_loss(baseline(b.data), b.target).backward();
    baseline_opt.step();
  });

  // The same training through the accelerator.
  generator.set_current_seed(42);
  RegressionModel net;
  auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), 0.1);
  auto split = options.dataloader_config.split_batches;
  auto [loader, model, optimizer] =
      accelerator.prepare(baseline_loader(data, split ? batch * n : batch, seedable, generator), net, sgd);
  train_three_epochs(loader, [&](acc::Example& b) {
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model(b.data), b.target);
    accelerator.backward(loss);
    optimizer.step();
  });

  const auto& trained = accelerator.unwrap_model(model);
  const double a = trained->a.item<double>(), b = trained->b.item<double>();
  const double a0 = baseline->a.item<double>(), b0 = baseline->b.item<double>();
  // Every process must hold the same model.
  auto all = accelerator.gather(torch::stack({trained->a, trained->b}).detach().unsqueeze(0));
  const bool same_everywhere = torch::equal(all[0], all[n - 1]);
  // fp32 sums in a different order: float tolerance (upstream's assert_close defaults).
  const bool close = std::abs(a - a0) <= 1e-5 + 1.3e-6 * std::abs(a0) && std::abs(b - b0) <= 1e-5 + 1.3e-6 * std::abs(b0);
  std::ostringstream line;
  line << std::setprecision(9) << mode << ": a=" << a << " b=" << b << " baseline a=" << a0 << " b=" << b0;
  accelerator.print(line.str());
  TORCH_CHECK(same_everywhere, mode, ": the processes ended with different models");
  TORCH_CHECK(close, mode, ": distributed training did not reproduce the single-process baseline");
  TORCH_CHECK(std::abs(a0 - 2) < 0.5 && std::abs(b0 - 3) < 0.5, mode, ": the baseline did not learn y = 2x + 3");
  accelerator.print(mode + ": OK");
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) check(argv[i]);
  return 0;
}
