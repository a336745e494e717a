// The tensor-parallel styles and the table that names them; see style.h, and Note [Tensor
// parallelism] in engine.cpp for the scheme they follow (Megatron-LM's).
#include "tensor_parallel/style.h"

#include "tensor_parallel/communication.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <iterator>
#include <mutex>
#include <optional>

namespace accelerate::detail::tensor_parallel {

at::Tensor ParallelStyle::piece_of(const at::Tensor& whole, int64_t dim, int rank, int n) const {
  const int64_t piece = whole.size(dim) / n;
  return whole.narrow(dim, piece * rank, piece);
}

at::Tensor ParallelStyle::join(const std::vector<at::Tensor>& pieces, int64_t dim) const {
  return at::cat(pieces, dim);
}

namespace {

bool is_embedding(torch::nn::Module& module) {
  return dynamic_cast<torch::nn::EmbeddingImpl*>(&module) != nullptr;
}

// A split lookup reads rows it then discards, so an Embedding that renormalises what it looks up
// cannot be split.
void refuse_max_norm(torch::nn::Module& module, const std::string& name) {
  auto* embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(&module);
  TORCH_CHECK_VALUE(!embedding || !embedding->options.max_norm(), "[", kTpApi, "] module \"", name,
                    "\": an Embedding with max_norm cannot be split (it renormalises the rows it looks up, and a "
                    "split lookup reads rows it then discards)");
}

// "replicate": kept whole.
class Replicate final : public ParallelStyle {
 public:
  using ParallelStyle::ParallelStyle;
  bool any_module() const override { return true; }
  bool inert() const override { return true; }
};

// "colwise": a Linear's weight and bias split on dimension 0 (output features), an Embedding's
// weight on dimension 1 (embedding features); the output stays sharded on its last dimension.
class Colwise : public ParallelStyle {
 public:
  using ParallelStyle::ParallelStyle;

  void attach(torch::nn::Module& module, const std::string& name) override {
    embedding_ = is_embedding(module);
    refuse_max_norm(module, name);
  }
  std::vector<ParamSplit> splits(torch::nn::Module& module) const override {
    if (embedding_) return {{"weight", 1}};
    return {{"weight", 0}, {"bias", 0}};
  }
  void pre_forward(const StyleCall& call, torch::nn::Module& module, at::Tensor& x) override {
    if (!embedding_ && x.requires_grad()) x = copy_to_group(x, call.group_id);
  }

 private:
  bool embedding_ = false;
};

// "colwise_rep": colwise, the output gathered whole.
class ColwiseRep final : public Colwise {
 public:
  using Colwise::Colwise;

  void post_forward(const StyleCall& call, torch::nn::Module& module, at::Tensor& y) override {
    y = gather_last_dim(y, call.group_id);
  }
};

// "rowwise": a Linear's input features (weight dimension 1, the bias whole) or an Embedding's
// vocabulary (weight dimension 0) split; the partial outputs summed over the group.
class Rowwise final : public ParallelStyle {
 public:
  using ParallelStyle::ParallelStyle;

  void attach(torch::nn::Module& module, const std::string& name) override {
    embedding_ = is_embedding(module);
    refuse_max_norm(module, name);
    TORCH_CHECK_VALUE(!embedding_ || !dynamic_cast<torch::nn::EmbeddingImpl&>(module).options.padding_idx(), "[",
                      kTpApi, "] module \"", name, "\": a vocabulary-parallel Embedding with padding_idx is not "
                      "supported yet");
  }
  std::vector<ParamSplit> splits(torch::nn::Module& module) const override {
    return {{"weight", embedding_ ? 0 : 1}};
  }

  void pre_forward(const StyleCall& call, torch::nn::Module& module, at::Tensor& x) override {
    const int n = call.group.num_processes();
    if (embedding_) {
      // Indices outside this process's rows look up row 0; their vectors are zeroed after.
      const auto& weight = dynamic_cast<torch::nn::EmbeddingImpl&>(module).weight;
      const int64_t rows = weight.size(0), start = rows * call.group.process_index();
      at::Tensor outside = (x < start).logical_or(x >= start + rows);
      x = (x - start).masked_fill(outside, 0);
      masks_.push_back(outside);
      return;
    }
    const int64_t features = dynamic_cast<torch::nn::LinearImpl&>(module).weight.size(1);
    if (x.dim() > 0 && x.size(-1) == features * n && n > 1) {
      x = slice_last_dim(x, call.group_id);
    } else {
      TORCH_CHECK_VALUE(x.dim() > 0 && x.size(-1) == features, "[", kTpApi, "] module \"", call.module_name,
                        "\" (rowwise) takes inputs of ", features, " features (this process's) or ", features * n,
                        " (whole), got a last dimension of ", x.dim() ? x.size(-1) : 0);
    }
  }

  void post_forward(const StyleCall& call, torch::nn::Module& module, at::Tensor& y) override {
    if (embedding_) {
      TORCH_INTERNAL_ASSERT(!masks_.empty());
      y = y.masked_fill(masks_.back().unsqueeze(-1), 0);
      masks_.pop_back();
      y = sum_over_group(y, call.group_id);
      return;
    }
    // The bias is added once: the sum is taken of the output less the bias, and the bias added
    // after it, so that its gradient is the output's.
    const auto& bias = dynamic_cast<torch::nn::LinearImpl&>(module).bias;
    y = bias.defined() ? sum_over_group(y - bias, call.group_id) + bias : sum_over_group(y, call.group_id);
  }

  void drop_calls() override { masks_.clear(); }

 private:
  bool embedding_ = false;
  std::vector<at::Tensor> masks_;  // vocabulary-parallel lookups in flight: the indices not held here
};

// Note [Random numbers of a sequence-parallel module]
// The group's processes share their default generators (they took process 0's at `prepare`), so
// that replicated computations draw alike. A sequence-parallel module computes on a different
// piece on each process, and a dropout there drawing from the shared stream would give every
// piece the same mask: position i of each piece dropped together, which one process never does.
// So, in training, each call first draws a seed from the shared CPU generator (every process
// draws alike, and the shared stream moves on in step), sets the default generator of the input's
// device to that seed plus this process's place in the group for the module's forward, and puts
// the generator's state back after it. A call recomputed by activation checkpointing starts from
// the restored generators, draws the same seed, and so the same masks. A forward that throws
// leaves the generator on its own stream until the prepared model's next call, which restores
// it. Only CPU and CUDA inputs fork: on another device the pieces draw from the shared stream
// (the same mask for each), and a CUDA module's CPU draws are not forked either.

// A default generator set, for one call of a sequence-parallel module, to a stream of this
// process's own; `state` is what it held before.
struct ForkedGenerator {
  at::Generator generator;
  at::Tensor state;
};

std::optional<ForkedGenerator> fork_generator(const at::Tensor& x, int rank) {
  if (!x.is_cpu() && !x.is_cuda()) return std::nullopt;
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  uint64_t seed = 0;
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    seed = cpu.get<at::CPUGeneratorImpl>()->random64();
  }
  at::Generator generator = x.is_cpu() ? cpu : at::globalContext().defaultGenerator(x.device());
  std::lock_guard<std::mutex> lock(generator.mutex());
  ForkedGenerator fork{generator, generator.get_state()};
  generator.set_current_seed(seed + static_cast<uint64_t>(rank));
  return fork;
}
void restore_generator(std::optional<ForkedGenerator>& fork) {
  if (!fork) return;
  std::lock_guard<std::mutex> lock(fork->generator.mutex());
  fork->generator.set_state(fork->state);
}

// "sequence_parallel" (transformers' style of the name; any module, a norm or a dropout say): the
// parameters stay whole; the input is split on dimension 1, the sequence, the module computes on
// this process's piece, and its output is gathered whole again.
class SequenceParallel final : public ParallelStyle {
 public:
  using ParallelStyle::ParallelStyle;
  bool any_module() const override { return true; }
  bool runs_on_sequence_piece() const override { return true; }

  void attach(torch::nn::Module& module, const std::string& name) override { refuse_max_norm(module, name); }

  void pre_forward(const StyleCall& call, torch::nn::Module& module, at::Tensor& x) override {
    TORCH_CHECK_VALUE(x.dim() >= 2, "[", kTpApi, "] module \"", call.module_name, "\" (sequence_parallel) splits its "
                      "input along dimension 1, the sequence; got a tensor of ", x.dim(), " dimension(s)");
    lengths_.push_back(x.size(1));
    x = slice_sequence(x, call.group_id);
    forks_.push_back(module.is_training() ? fork_generator(x, call.group.process_index()) : std::nullopt);
  }

  void post_forward(const StyleCall& call, torch::nn::Module& module, at::Tensor& y) override {
    TORCH_INTERNAL_ASSERT(!lengths_.empty() && !forks_.empty());
    const int64_t len = lengths_.back();
    lengths_.pop_back();
    restore_generator(forks_.back());
    forks_.pop_back();
    const auto piece = sequence_piece(len, call.group.num_processes(), call.group.process_index());
    TORCH_CHECK_VALUE(y.dim() >= 2 && y.size(1) == piece.length, "[", kTpApi, "] module \"", call.module_name,
                      "\" (sequence_parallel) must return a tensor whose dimension 1 is its input's (the "
                      "sequence): given ", piece.length, " of ", len, " positions, it returned shape ", y.sizes());
    y = gather_sequence(y, call.group_id, len);
  }

  // The generators go back the oldest last: it holds the group's shared stream.
  void drop_calls() override {
    while (!forks_.empty()) {
      restore_generator(forks_.back());
      forks_.pop_back();
    }
    lengths_.clear();
  }

 private:
  std::vector<int64_t> lengths_;                      // calls in flight: their inputs' sequence lengths
  std::vector<std::optional<ForkedGenerator>> forks_;  // and the generators set aside for them
};

template <typename S>
std::unique_ptr<ParallelStyle> make_style(const char* name) {
  return std::make_unique<S>(name);
}

// The styles by name, in the order errors list them.
const StyleEntry kStyles[] = {
    {"colwise", &make_style<Colwise>},
    {"colwise_rep", &make_style<ColwiseRep>},
    {"rowwise", &make_style<Rowwise>},
    {"sequence_parallel", &make_style<SequenceParallel>},
    {"replicate", &make_style<Replicate>},
};

// transformers' styles that have no type here yet.
const char* const kLaterStyles[] = {"local_colwise", "local_rowwise", "gather", "local", "rowwise_rep",
                                    "local_packed_rowwise"};

}  // namespace

const StyleEntry& find_style(const std::string& name, const std::string& pattern) {
  for (const auto& entry : kStyles) {
    if (name == entry.name) return entry;
  }
  bool later = false;
  for (const char* style : kLaterStyles) later = later || name == style;
  std::string known;
  const size_t count = std::size(kStyles);
  for (size_t i = 0; i < count; ++i) {
    known += (i == 0 ? "" : i + 1 == count ? " and " : ", ") + std::string(kStyles[i].name);
  }
  C10_THROW_ERROR(ValueError, c10::str("[TorchTensorParallelConfig] tp_plan entry \"", pattern, "\": style \"", name,
                                       "\" is ", later ? "not supported yet" : "unknown", "; the styles are ", known));
}

}  // namespace accelerate::detail::tensor_parallel
