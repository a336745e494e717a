// The models of the training benchmarks (W1 "mlp", W2 "transformer", W3 "tiny"), shared by
// bench/training.cpp (written with the Accelerator) and bench/training_plain.cpp (the same loop
// in plain LibTorch); bench/training_twin.py defines the same ones for PyTorch.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <vector>

namespace bench {

struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : fc1(register_module("fc1", torch::nn::Linear(512, 1024))),
        fc2(register_module("fc2", torch::nn::Linear(1024, 1024))),
        fc3(register_module("fc3", torch::nn::Linear(1024, 10))) {}
  at::Tensor forward(const at::Tensor& x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

struct TinyImpl : torch::nn::Module {
  TinyImpl() : fc(register_module("fc", torch::nn::Linear(32, 32))) {}
  at::Tensor forward(const at::Tensor& x) { return fc(x); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Tiny);

// W2. Parameters are set by `init_transformer`, so both sides start from the same numbers.
struct EncoderClassifierImpl : torch::nn::Module {
  EncoderClassifierImpl()
      : encoder(register_module(
            "encoder", torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(
                           torch::nn::TransformerEncoderLayerOptions(256, 4).dim_feedforward(2048).dropout(0.0), 2)))),
        head(register_module("head", torch::nn::Linear(256, 10))) {}
  // x: [sequence, batch, 256] -> logits [batch, 10].
  at::Tensor forward(const at::Tensor& x) { return head(encoder(x).mean(0)); }
  torch::nn::TransformerEncoder encoder;
  torch::nn::Linear head;
};
TORCH_MODULE(EncoderClassifier);

// Deterministic parameters independent of each framework's initialisation order: in name order,
// matrices N(0, 0.02²) from one generator, layer-norm weights 1, biases 0 (bench/training_twin.py
// does the same).
inline void init_transformer(torch::nn::Module& net) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  auto named = net.named_parameters();
  std::vector<std::string> names;
  for (const auto& item : named) names.push_back(item.key());
  std::sort(names.begin(), names.end());
  at::NoGradGuard no_grad;
  for (const auto& name : names) {
    auto& p = named[name];
    if (p.dim() >= 2) {
      p.copy_(at::randn(p.sizes(), gen) * 0.02);
    } else if (name.find("norm") != std::string::npos && name.size() > 6 && name.substr(name.size() - 6) == "weight") {
      p.fill_(1.0);
    } else {
      p.zero_();
    }
  }
}

// The workloads and step counts both training programs take.
struct StepFlags {
  std::vector<std::string> workloads;
  int warmup_steps = 20;
  int mlp_steps = 200;
  int tiny_steps = 2000;
  int transformer_warmup_steps = 3;
  int transformer_steps = 40;
};

/// Reads flag `a` into `f`, taking its argument from `value()`; false when `a` is not one of
/// StepFlags' (--workloads a,b,c and the step counts).
template <typename Value>
bool parse_step_flag(StepFlags& f, const std::string& a, Value&& value) {
  if (a == "--workloads") {
    f.workloads.clear();
    const std::string list = value();
    for (size_t start = 0, comma; start <= list.size(); start = comma + 1) {
      comma = std::min(list.find(',', start), list.size());
      if (comma > start) f.workloads.push_back(list.substr(start, comma - start));
    }
  } else if (a == "--warmup_steps") {
    f.warmup_steps = std::stoi(value());
  } else if (a == "--mlp_steps") {
    f.mlp_steps = std::stoi(value());
  } else if (a == "--tiny_steps") {
    f.tiny_steps = std::stoi(value());
  } else if (a == "--transformer_warmup_steps") {
    f.transformer_warmup_steps = std::stoi(value());
  } else if (a == "--transformer_steps") {
    f.transformer_steps = std::stoi(value());
  } else {
    return false;
  }
  return true;
}

}  // namespace bench
