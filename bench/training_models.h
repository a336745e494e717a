// The models of the training benchmarks (W1 "mlp", W2 "transformer", W3 "tiny", W12 "gpt2"), shared by
// bench/training.cpp (written with the Accelerator) and bench/training_plain.cpp (the same loop
// in plain LibTorch); bench/training_twin.py defines the same ones for PyTorch.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <utility>
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

// W12: a GPT-2-shaped decoder in nanoGPT's layout (pre-norm blocks of causal self-attention and a
// GELU MLP four times as wide, the token embedding reused as the output projection), GPT-2
// small's size by default. Parameter names are the twin's (bench/training_twin.py), so that
// init_transformer gives both sides the same numbers.
struct GptConfig {
  int64_t layers = 12, heads = 12, embd = 768, seq = 1024, vocab = 50304;
};

/// Causal attention of [B, heads, T, head size] tensors. Each program defines it: the library's
/// entry point (bench/training.cpp) or plain LibTorch's kernel (bench/training_plain.cpp).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

struct GptBlockImpl : torch::nn::Module {
  explicit GptBlockImpl(const GptConfig& c)
      : heads(c.heads),
        norm_1(register_module("norm_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.embd})))),
        attn_qkv(register_module("attn_qkv", torch::nn::Linear(c.embd, 3 * c.embd))),
        attn_proj(register_module("attn_proj", torch::nn::Linear(c.embd, c.embd))),
        norm_2(register_module("norm_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.embd})))),
        mlp_fc(register_module("mlp_fc", torch::nn::Linear(c.embd, 4 * c.embd))),
        mlp_proj(register_module("mlp_proj", torch::nn::Linear(4 * c.embd, c.embd))) {}
  at::Tensor forward(at::Tensor x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    auto qkv = attn_qkv(norm_1(x)).view({B, T, 3, heads, C / heads}).permute({2, 0, 3, 1, 4});
    auto y = causal_attention(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape({B, T, C});
    x = x + attn_proj(y);
    return x + mlp_proj(torch::gelu(mlp_fc(norm_2(x))));
  }
  int64_t heads;
  torch::nn::LayerNorm norm_1;
  torch::nn::Linear attn_qkv, attn_proj;
  torch::nn::LayerNorm norm_2;
  torch::nn::Linear mlp_fc, mlp_proj;
};
TORCH_MODULE(GptBlock);

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const GptConfig& c)
      : wte(register_module("wte", torch::nn::Embedding(c.vocab, c.embd))),
        wpe(register_module("wpe", torch::nn::Embedding(c.seq, c.embd))),
        h(register_module("h", torch::nn::ModuleList())),
        norm_f(register_module("norm_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.embd})))) {
    for (int64_t i = 0; i < c.layers; ++i) h->push_back(GptBlock(c));
  }
  // Token ids [B, T] -> logits [B, T, vocab].
  at::Tensor forward(const at::Tensor& idx) {
    auto x = wte(idx) + wpe(torch::arange(idx.size(1), idx.options()));
    for (const auto& block : *h) x = block->as<GptBlockImpl>()->forward(x);
    return torch::matmul(norm_f(x), wte->weight.t());
  }
  // FLOPs of one token's forward and backward pass: 6 per parameter (the position embedding
  // excepted, as nanoGPT counts) and the attention's 12 · layers · width · sequence.
  double flops_per_token(const GptConfig& c) {
    int64_t n = 0;
    for (const auto& p : parameters()) n += p.numel();
    n -= wpe->weight.numel();
    return 6.0 * static_cast<double>(n) + 12.0 * static_cast<double>(c.layers * c.embd * c.seq);
  }
  torch::nn::Embedding wte, wpe;
  torch::nn::ModuleList h;
  torch::nn::LayerNorm norm_f;
};
TORCH_MODULE(Gpt);

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
  GptConfig gpt;  // W12
  int64_t gpt_batch = 8;
  int gpt_warmup_steps = 3;
  int gpt_steps = 20;
};

/// Reads flag `a` into `f`, taking its argument from `value()`; false when `a` is not one of
/// StepFlags' (--workloads a,b,c, the step counts, and W12's --gpt_layers, --gpt_heads,
/// --gpt_embd, --gpt_seq, --gpt_vocab and --gpt_batch).
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
  } else if (a == "--gpt_layers") {
    f.gpt.layers = std::stoll(value());
  } else if (a == "--gpt_heads") {
    f.gpt.heads = std::stoll(value());
  } else if (a == "--gpt_embd") {
    f.gpt.embd = std::stoll(value());
  } else if (a == "--gpt_seq") {
    f.gpt.seq = std::stoll(value());
  } else if (a == "--gpt_vocab") {
    f.gpt.vocab = std::stoll(value());
  } else if (a == "--gpt_batch") {
    f.gpt_batch = std::stoll(value());
  } else if (a == "--gpt_warmup_steps") {
    f.gpt_warmup_steps = std::stoi(value());
  } else if (a == "--gpt_steps") {
    f.gpt_steps = std::stoi(value());
  } else {
    return false;
  }
  return true;
}

// The W12 batch: token ids and targets [batch, seq] drawn from `gen`.
inline std::pair<at::Tensor, at::Tensor> gpt_batch(const StepFlags& f, at::Generator& gen) {
  auto x = at::randint(0, f.gpt.vocab, {f.gpt_batch, f.gpt.seq}, gen, at::kLong);
  auto y = at::randint(0, f.gpt.vocab, {f.gpt_batch, f.gpt.seq}, gen, at::kLong);
  return {x, y};
}

// W12's loss: cross-entropy over every position's logits.
inline at::Tensor gpt_loss(const at::Tensor& logits, const at::Tensor& targets) {
  return torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
}

}  // namespace bench
