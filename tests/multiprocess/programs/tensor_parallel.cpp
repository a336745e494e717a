// A program for the tensor-parallel launcher tests: the mesh comes from `accelerate launch`'s
// --parallelism_config_* flags. Every process trains a small transformer-shaped model (a
// vocabulary-parallel embedding, blocks of a norm and a colwise/rowwise MLP, a colwise head) for 3
// AdamW steps with the gradient clipped, on its data-parallel slice of each batch, then compares
// the whole weights (get_state_dict) and each step's gradient norm with the same training on one
// process, which it runs itself first. With `--save DIR` it also saves its state to DIR after the
// second step; with `--resume DIR` it loads DIR first and takes only the third step. With
// `--dropout` it checks instead that a dropout on replicated activations draws the same mask on
// every process of a tp group, each process seeded differently before `prepare`, and that a
// sequence-parallel dropout draws a different mask for each piece of the sequence. The main
// process prints "tp=<t> dp_shard=<s> dp_replicate=<r> (<backend>): OK on <device>" on success; a
// difference throws. On a GPU machine the job computes on the GPU (the reference on the CPU).
#include "accelerate/accelerate.h"

#include <torch/torch.h>

#include <cmath>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace acc = accelerate;

namespace {

constexpr int64_t kVocab = 32, kDim = 16, kHidden = 32, kBatch = 8, kSeq = 4;

struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : ln(register_module("ln", acc::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})))),
        fc1(register_module("fc1", acc::nn::Linear(kDim, kHidden))), fc2(register_module("fc2", acc::nn::Linear(kHidden, kDim))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + fc2(torch::gelu(fc1(ln(x)))); }
  acc::nn::LayerNorm ln;
  acc::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module, acc::nn::TensorParallelPlanned {
  NetImpl()
      : embed(register_module("embed", acc::nn::Embedding(kVocab, kDim))),
        blocks(register_module("blocks", torch::nn::Sequential(Block(), Block()))),
        head(register_module("head", acc::nn::Linear(kDim, kVocab))) {}
  torch::Tensor forward(const torch::Tensor& ids) { return head(acc::forward(blocks, embed(ids))); }
  std::vector<std::pair<std::string, std::string>> tp_plan() const override {
    return {{"embed", "rowwise"}, {"blocks.*.fc1", "colwise"}, {"blocks.*.fc2", "rowwise"}, {"head", "colwise_rep"}};
  }
  acc::nn::Embedding embed;
  torch::nn::Sequential blocks;
  acc::nn::Linear head;
};

std::shared_ptr<NetImpl> make_net() {
  auto net = std::make_shared<NetImpl>();
  torch::NoGradGuard no_grad;
  int i = 0;
  for (auto& p : net->parameters()) {
    p.copy_(torch::sin(torch::arange(p.numel(), torch::kFloat) * (0.29 + 0.03 * i++)).reshape(p.sizes()) * 0.5);
  }
  return net;
}

torch::Tensor ids(int step) {
  return (torch::arange(kBatch * kSeq, torch::kLong).reshape({kBatch, kSeq}) * (5 + step) + step) % kVocab;
}
torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& ids) {
  return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), ((ids * 7 + 3) % kVocab).reshape({-1}));
}

constexpr double kMaxNorm = 0.5;

// A split MLP whose summed (replicated) output goes through a dropout.
struct DropoutNetImpl : torch::nn::Module {
  DropoutNetImpl()
      : fc1(register_module("fc1", acc::nn::Linear(kDim, kHidden))),
        fc2(register_module("fc2", acc::nn::Linear(kHidden, kDim))),
        drop(register_module("drop", acc::nn::Dropout(0.5))) {}
  torch::Tensor forward(const torch::Tensor& x) { return drop(fc2(torch::gelu(fc1(x)))); }
  acc::nn::Linear fc1, fc2;
  acc::nn::Dropout drop;
};

int check_dropout() {
  acc::AcceleratorOptions options;
  options.tp_handler.tp_plan = {{"fc1", "colwise"}, {"fc2", "rowwise"}};
  acc::Accelerator accelerator(options);
  torch::manual_seed(100 + accelerator.process_index());
  auto net = std::make_shared<DropoutNetImpl>();
  auto model = accelerator.prepare_model(net);
  const auto tp = accelerator.torch_device_mesh()->get_group("tp");
  const auto x = torch::linspace(-1, 1, 4 * kDim).reshape({4, kDim});
  for (int pass = 0; pass < 3; ++pass) {
    const auto y = model(x).detach();
    const auto all = acc::gather(tp, y.unsqueeze(0));
    for (int64_t i = 1; i < all.size(0); ++i) {
      if (!torch::equal(all[0], all[i])) {
        throw std::runtime_error("pass " + std::to_string(pass) + ": the dropout's output differs between the "
                                 "processes of a tp group");
      }
    }
    if ((y == 0).sum().item<int64_t>() == 0) throw std::runtime_error("the dropout dropped nothing");
  }
  accelerator.print("tp=" + std::to_string(tp.num_processes()) + ": the dropout masks agree");

  // A sequence-parallel dropout: each process drops on its piece of the sequence, from a stream
  // of its own, and the output is gathered whole.
  acc::AcceleratorOptions sp_options;
  sp_options.tp_handler.tp_plan = {{"drop", "sequence_parallel"}};
  acc::Accelerator sp_accelerator(sp_options);
  auto seq = std::make_shared<torch::nn::SequentialImpl>();
  torch::nn::Linear identity(kDim, kDim);  // a parameter for DDP to synchronise; ones stay ones
  {
    torch::NoGradGuard no_grad;
    identity->weight.copy_(torch::eye(kDim));
    identity->bias.zero_();
  }
  seq->push_back("identity", identity);
  seq->push_back("drop", torch::nn::Dropout(0.5));
  auto sp_model = sp_accelerator.prepare_model(seq);
  const int64_t n = tp.num_processes(), len = 3 * n;
  torch::Tensor previous;
  for (int pass = 0; pass < 3; ++pass) {
    const auto kept = (sp_model(torch::ones({4, len, kDim})).detach() != 0).to(torch::kFloat);
    const auto all = acc::gather(tp, kept.unsqueeze(0));
    for (int64_t i = 1; i < all.size(0); ++i) {
      if (!torch::equal(all[0], all[i])) throw std::runtime_error("the sequence-parallel dropout's output differs");
    }
    for (int64_t piece = 1; piece < n; ++piece) {
      if (torch::equal(kept.narrow(1, 0, 3), kept.narrow(1, 3 * piece, 3))) {
        throw std::runtime_error("pass " + std::to_string(pass) + ": pieces 0 and " + std::to_string(piece) +
                                 " of the sequence were dropped alike");
      }
    }
    const double share = kept.mean().item<double>();
    if (share < 0.3 || share > 0.7) throw std::runtime_error("kept " + std::to_string(share) + " of the values at p = 0.5");
    if (previous.defined() && torch::equal(previous, kept)) throw std::runtime_error("two passes dropped alike");
    previous = kept;
  }
  // The shared stream moved on in step: what the processes of a group draw next still agrees.
  const auto next = acc::gather(tp, torch::rand({1, 8}));
  for (int64_t i = 1; i < next.size(0); ++i) {
    if (!torch::equal(next[0], next[i])) throw std::runtime_error("the tp group's generators no longer agree");
  }
  accelerator.print("tp=" + std::to_string(n) + ": each piece of the sequence draws its own dropout mask");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string save, resume;
  if (argc == 2 && std::string(argv[1]) == "--dropout") return check_dropout();
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--save") {
      save = argv[i + 1];
    } else if (flag == "--resume") {
      resume = argv[i + 1];
    } else {
      throw std::invalid_argument("unknown argument " + flag);
    }
  }
  // The reference: one process, the whole batch.
  std::vector<double> want_norms;
  std::map<std::string, torch::Tensor> want;
  {
    auto net = make_net();
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(0.02));
    for (int s = 0; s < 3; ++s) {
      opt.zero_grad();
      loss_of(net->forward(ids(s)), ids(s)).backward();
      want_norms.push_back(torch::nn::utils::clip_grad_norm_(net->parameters(), kMaxNorm));
      opt.step();
    }
    for (const auto& item : net->named_parameters()) want[item.key()] = item.value().detach().clone();
  }

  acc::Accelerator accelerator;
  auto mesh = accelerator.torch_device_mesh();
  if (!mesh) throw std::runtime_error("no device mesh: launch with --parallelism_config_tp_size");
  auto net = make_net();
  auto [model, opt] =
      accelerator.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.02)));
  const int dp = mesh->size("dp"), dp_rank = mesh->get_local_rank("dp");
  const int64_t rows = kBatch / dp;
  if (!resume.empty()) accelerator.load_state(resume);
  for (int s = resume.empty() ? 0 : 2; s < 3; ++s) {
    if (s == 2 && !save.empty()) accelerator.save_state(save);
    opt.zero_grad();
    auto x = ids(s).narrow(0, dp_rank * rows, rows).to(accelerator.device());  // on a GPU machine, the GPU
    accelerator.backward(loss_of(model(x), x));
    const double norm = accelerator.clip_grad_norm_(net->parameters(), kMaxNorm);
    if (std::abs(norm - want_norms[s]) > 1e-4 * want_norms[s]) {
      std::ostringstream text;
      text << "step " << s << ": gradient norm " << norm << ", one process " << want_norms[s];
      throw std::runtime_error(text.str());
    }
    opt.step();
  }
  for (const auto& item : accelerator.get_state_dict(model)) {
    const auto& w = want.at(item.key());
    const auto got = item.value().to(torch::kCPU);
    if (got.sizes() != w.sizes() || !torch::allclose(got, w, 1e-4, 1e-5)) {
      throw std::runtime_error(item.key() + " differs from the one-process run");
    }
  }
  std::ostringstream line;
  line << "tp=" << mesh->size("tp") << " dp_shard=" << mesh->size("dp_shard")
       << " dp_replicate=" << mesh->size("dp_replicate") << " (" << accelerator.state().partial_state().backend()
       << "): OK on " << accelerator.device();
  accelerator.print(line.str());
  return 0;
}
