// The small task every by-feature example trains, so that each file shows only its feature (the
// part between `// New Code //` markers): classify points of two interleaved spirals with an MLP.
// Upstream's by_feature examples share a task the same way (GLUE MRPC with BERT).
#pragma once

#include <accelerate/accelerate.h>

#include <torch/torch.h>

#include <cmath>
#include <string>

namespace task {

/// `count` points of two spirals with a little noise, from a fixed seed: data [count, 2], labels {0, 1}.
inline std::shared_ptr<accelerate::TensorDataset> spirals(int64_t count, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto t = at::rand({count}, gen) * 3 * M_PI + 0.5;
  auto label = at::randint(0, 2, {count}, gen);
  auto angle = t + label.to(torch::kFloat) * M_PI;
  auto points = torch::stack({t * angle.cos(), t * angle.sin()}, 1) / 10 + 0.02 * at::randn({count, 2}, gen);
  return std::make_shared<accelerate::TensorDataset>(points, label);
}

struct MLPImpl : torch::nn::Module {
  MLPImpl() {
    net = register_module("net",
                          torch::nn::Sequential(torch::nn::Linear(2, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                                                torch::nn::ReLU(), torch::nn::Linear(64, 2)));
  }
  // Through accelerate::forward, so that hooks on the layers run (fully sharded units, offloading).
  torch::Tensor forward(const torch::Tensor& x) { return accelerate::forward(net, x); }
  torch::nn::Sequential net{nullptr};
};
TORCH_MODULE(MLP);

/// The share of `loader`'s samples the model classifies correctly, over every process.
template <typename Model>
double accuracy(const accelerate::Accelerator& accelerator, Model& model, const accelerate::DataLoader& loader) {
  torch::NoGradGuard no_grad;
  int64_t correct = 0, total = 0;
  for (auto& batch : loader) {
    auto predictions = accelerator.gather_for_metrics(model(batch.data).argmax(1));
    auto labels = accelerator.gather_for_metrics(batch.target);
    correct += predictions.eq(labels).sum().template item<int64_t>();
    total += labels.size(0);
  }
  return static_cast<double>(correct) / static_cast<double>(total);
}

/// Reads `--name value` from the command line, or `fallback`.
inline std::string flag(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == name) return argv[i + 1];
  }
  return fallback;
}

/// Whether `--name` is on the command line.
inline bool has_flag(int argc, char** argv, const std::string& name) {
  for (int i = 1; i < argc; ++i) {
    if (argv[i] == name) return true;
  }
  return false;
}

}  // namespace task
