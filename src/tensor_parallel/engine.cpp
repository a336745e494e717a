// Tensor parallelism of a prepared model; see engine.h.
#include "tensor_parallel/engine.h"

#include "accelerate/hooks.h"
#include "accelerate/utils/random.h"
#include "detail/collectives.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

namespace accelerate::detail {

// Note [Tensor parallelism]
// A plan names modules and styles (transformers' names). `prepare` first makes every process of
// the tensor-parallel group hold process 0's parameters and buffers (as PyTorch's
// distribute_tensor scatters from rank 0), then keeps in each split parameter only this process's
// piece, through `set_data`, so an optimizer built before `prepare` stays valid and steps pieces:
//   colwise / colwise_rep  a Linear's weight and bias split on dimension 0 (output features), an
//                          Embedding's weight on dimension 1 (embedding features);
//   rowwise                a Linear's weight split on dimension 1 (input features), its bias
//                          whole; an Embedding's weight on dimension 0 (the vocabulary).
// Each split module gets a ModelHook that communicates as Megatron-LM does, through autograd
// functions over the group:
//   colwise     the input passes through "copy" (forward: itself; backward: the gradients summed
//               over the group, since every process's piece of the output depends on all of it);
//               the output stays sharded on its last dimension, or is gathered (colwise_rep;
//               backward: this process's slice of the gradient);
//   rowwise     an input whose last dimension is whole is sliced to this process's features (its
//               backward gathers); the partial outputs are summed over the group (backward: the
//               gradient itself). The bias is added once: the sum is taken of the output less the
//               bias, and the bias added after it, so that its gradient is the output's.
//   rowwise on an Embedding (vocabulary-parallel): indices outside this process's rows look up
//               row 0 and their vectors are zeroed, then the vectors are summed over the group.
//   sequence_parallel  (transformers' style of the name; any module, a norm or a dropout say) the
//               parameters stay whole; the input is split on dimension 1, the sequence, into
//               torch.chunk's pieces (the last ones shorter, or empty, when tp_size does not
//               divide it; backward: the pieces' gradients gathered), the module computes on
//               this process's piece, and its output is gathered whole again (backward: this
//               process's piece of the gradient). Each process's parameter gradients then cover
//               its piece of the sequence only, so a hook on each parameter sums them over the
//               group before they are accumulated (and before DDP or FSDP reduce them): a
//               collective, so the module must give every parameter a gradient on every process,
//               an empty piece included (norms and dropouts do). In
//               training, the module draws its random numbers from a stream of this process's
//               own (Note [Random numbers of a sequence-parallel module]).
// Parameters outside split modules stay whole; every process of the group computes the same
// values and gradients for them from the same batch. That holds for random operations too: the
// group's processes also take process 0's default generators at `prepare` (CPU, and the CUDA
// device's when the model is there), so a dropout outside the split layers draws the same mask on
// each of them and their activations stay equal (the draws keep in step: every process runs the
// same operations on tensors of the same shapes). Data parallelism (DDP, FSDP) then runs over
// the processes that share a tensor-parallel rank (the mesh's "dp"), on pieces.
inline constexpr const char* kTpApi = "TensorParallel";

namespace {

// The groups autograd nodes communicate over, by number. A node outlives nothing it needs: the
// table keeps the group, and it is never destroyed (the process groups are, by
// destroy_process_group, which every collective then reports).
std::mutex registry_mutex;
std::vector<PartialState>& registry() {
  static auto* groups = new std::vector<PartialState>();
  return *groups;
}
int64_t register_group(const PartialState& group) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto& groups = registry();
  for (size_t i = 0; i < groups.size(); ++i) {
    if (groups[i].impl() == group.impl()) return static_cast<int64_t>(i);
  }
  groups.push_back(group);
  return static_cast<int64_t>(groups.size() - 1);
}
PartialState group_of(const torch::autograd::AutogradContext* ctx) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  return registry().at(static_cast<size_t>(ctx->saved_data.at("group").toInt()));
}

at::Tensor gather_last_dim(const PartialState& group, const at::Tensor& x) {
  auto pieces = all_gather(group, x.contiguous(), kTpApi);
  return at::cat(pieces, -1);
}
at::Tensor slice_last_dim(const PartialState& group, const at::Tensor& x) {
  const int64_t piece = x.size(-1) / group.num_processes();
  return x.narrow(-1, piece * group.process_index(), piece).contiguous();
}

// Forward: the input; backward: the gradients summed over the group.
struct CopyToGroup : torch::autograd::Function<CopyToGroup> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x.view_as(x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {all_reduce(group_of(ctx), grads[0].contiguous(), Reduction::kSum, kTpApi), at::Tensor()};
  }
};

// Forward: the sum over the group; backward: the gradient.
struct SumOverGroup : torch::autograd::Function<SumOverGroup> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return all_reduce(group_of(ctx), x.contiguous(), Reduction::kSum, kTpApi);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    (void)ctx;
    return {grads[0], at::Tensor()};
  }
};

// Forward: every process's pieces joined on the last dimension; backward: this process's slice.
struct GatherLastDim : torch::autograd::Function<GatherLastDim> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return gather_last_dim(group_of(ctx), x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {slice_last_dim(group_of(ctx), grads[0]), at::Tensor()};
  }
};

// Forward: this process's slice of the last dimension; backward: the slices' gradients joined.
struct SliceLastDim : torch::autograd::Function<SliceLastDim> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return slice_last_dim(group_of(ctx), x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {gather_last_dim(group_of(ctx), grads[0]), at::Tensor()};
  }
};

// torch.chunk's pieces of a length along the sequence dimension: ceil(len / n) long each, the last
// ones shorter or empty.
struct SequencePiece {
  int64_t start = 0, length = 0;
};
SequencePiece sequence_piece(int64_t len, int n, int rank) {
  const int64_t size = (len + n - 1) / n;
  const int64_t start = std::min(len, size * rank);
  return {start, std::min(len, start + size) - start};
}
at::Tensor slice_sequence(const PartialState& group, const at::Tensor& x) {
  const auto piece = sequence_piece(x.size(1), group.num_processes(), group.process_index());
  return x.narrow(1, piece.start, piece.length).contiguous();
}
// Every process's piece of dimension 1 joined into `len`: the pieces travel padded to the longest,
// and since only the last pieces are short, the padding lies past `len`.
at::Tensor gather_sequence(const PartialState& group, const at::Tensor& piece, int64_t len) {
  const int n = group.num_processes();
  const int64_t size = (len + n - 1) / n;
  if (size == 0) return piece.contiguous();
  at::Tensor padded = piece;
  if (piece.size(1) < size) {
    auto shape = piece.sizes().vec();
    shape[1] = size - piece.size(1);
    padded = at::cat({piece, at::zeros(shape, piece.options())}, 1);
  }
  return at::cat(all_gather(group, padded.contiguous(), kTpApi), 1).narrow(1, 0, len).contiguous();
}

// Forward: this process's piece of the sequence; backward: the pieces' gradients joined.
struct SliceSequence : torch::autograd::Function<SliceSequence> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["len"] = x.size(1);
    return slice_sequence(group_of(ctx), x);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {gather_sequence(group_of(ctx), grads[0], ctx->saved_data.at("len").toInt()), at::Tensor()};
  }
};

// Forward: every process's piece joined into the whole sequence of `len`; backward: this
// process's piece of the gradient.
struct GatherSequence : torch::autograd::Function<GatherSequence> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t group, int64_t len) {
    ctx->saved_data["group"] = group;
    return gather_sequence(group_of(ctx), x, len);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {slice_sequence(group_of(ctx), grads[0]), at::Tensor(), at::Tensor()};
  }
};

// See Note [GCC 14 and autograd::Function::apply] in src/activation_checkpointing.cpp.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
template <typename F>
at::Tensor apply(const at::Tensor& x, int64_t group) {
  return F::apply(x, group);
}
at::Tensor apply_gather_sequence(const at::Tensor& x, int64_t group, int64_t len) {
  return GatherSequence::apply(x, group, len);
}
#pragma GCC diagnostic pop

}  // namespace

struct TpParam {
  std::string name;  // in the model
  at::Tensor param;  // the module's parameter object, never replaced
  int64_t dim = 0;   // the dimension it is split on
};

// A default generator set, for one call of a sequence-parallel module, to a stream of this
// process's own; `state` is what it held before.
struct ForkedGenerator {
  at::Generator generator;
  at::Tensor state;
};

struct SplitModule {
  std::string name;
  torch::nn::Module* module = nullptr;
  TpStyle style = TpStyle::kReplicate;
  bool embedding = false;
  int64_t hooked_pass = -1;
  bool ever_hooked = false;
  std::vector<at::Tensor> masks;  // vocabulary-parallel lookups in flight: the indices not held here
  std::vector<int64_t> lengths;   // sequence-parallel calls in flight: their inputs' sequence lengths
  std::vector<std::optional<ForkedGenerator>> forks;  // and the generators set aside for them
};

struct TensorParallelEngineImpl {
  explicit TensorParallelEngineImpl(const PartialState& g) : group(g) {}
  PartialState group;
  int64_t group_id = 0;
  std::shared_ptr<torch::nn::Module> module;
  std::vector<TpParam> params;
  std::unordered_map<const void*, size_t> by_impl;  // parameter → its index in `params`
  std::vector<SplitModule> modules;
  std::unordered_set<const void*> summed;  // parameters whose gradient a hook sums over the group
  int64_t pass = 0;
};

namespace {

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

class SplitHook final : public ModelHook {
 public:
  SplitHook(std::weak_ptr<TensorParallelEngineImpl> engine, size_t index) : engine_(std::move(engine)), index_(index) {}

  void pre_forward(torch::nn::Module& module, std::vector<at::Tensor>& inputs) override {
    auto e = engine_.lock();
    if (!e || inputs.empty() || !inputs[0].defined()) return;
    auto& m = e->modules[index_];
    m.hooked_pass = e->pass;
    m.ever_hooked = true;
    at::Tensor& x = inputs[0];
    const int n = e->group.num_processes();
    switch (m.style) {
      case TpStyle::kReplicate:
        return;
      case TpStyle::kSequenceParallel:
        TORCH_CHECK_VALUE(x.dim() >= 2, "[", kTpApi, "] module \"", m.name, "\" (sequence_parallel) splits its input "
                          "along dimension 1, the sequence; got a tensor of ", x.dim(), " dimension(s)");
        m.lengths.push_back(x.size(1));
        x = apply<SliceSequence>(x, e->group_id);
        m.forks.push_back(module.is_training() ? fork_generator(x, e->group.process_index()) : std::nullopt);
        return;
      case TpStyle::kColwise:
      case TpStyle::kColwiseRep:
        if (!m.embedding && x.requires_grad()) x = apply<CopyToGroup>(x, e->group_id);
        return;
      case TpStyle::kRowwise:
        if (m.embedding) {
          const auto& weight = dynamic_cast<torch::nn::EmbeddingImpl&>(module).weight;
          const int64_t rows = weight.size(0), start = rows * e->group.process_index();
          at::Tensor outside = (x < start).logical_or(x >= start + rows);
          x = (x - start).masked_fill(outside, 0);
          m.masks.push_back(outside);
          return;
        }
        const int64_t features = dynamic_cast<torch::nn::LinearImpl&>(module).weight.size(1);
        if (x.dim() > 0 && x.size(-1) == features * n && n > 1) {
          x = apply<SliceLastDim>(x, e->group_id);
        } else {
          TORCH_CHECK_VALUE(x.dim() > 0 && x.size(-1) == features, "[", kTpApi, "] module \"", m.name,
                            "\" (rowwise) takes inputs of ", features, " features (this process's) or ",
                            features * n, " (whole), got a last dimension of ", x.dim() ? x.size(-1) : 0);
        }
        return;
    }
  }

  void post_forward(torch::nn::Module& module, std::vector<at::Tensor>& outputs) override {
    auto e = engine_.lock();
    if (!e || outputs.empty() || !outputs[0].defined()) return;
    auto& m = e->modules[index_];
    at::Tensor& y = outputs[0];
    switch (m.style) {
      case TpStyle::kReplicate:
      case TpStyle::kColwise:
        return;
      case TpStyle::kSequenceParallel: {
        TORCH_INTERNAL_ASSERT(!m.lengths.empty() && !m.forks.empty());
        const int64_t len = m.lengths.back();
        m.lengths.pop_back();
        restore_generator(m.forks.back());
        m.forks.pop_back();
        const auto piece = sequence_piece(len, e->group.num_processes(), e->group.process_index());
        TORCH_CHECK_VALUE(y.dim() >= 2 && y.size(1) == piece.length, "[", kTpApi, "] module \"", m.name,
                          "\" (sequence_parallel) must return a tensor whose dimension 1 is its input's (the "
                          "sequence): given ", piece.length, " of ", len, " positions, it returned shape ", y.sizes());
        y = apply_gather_sequence(y, e->group_id, len);
        return;
      }
      case TpStyle::kColwiseRep:
        y = apply<GatherLastDim>(y, e->group_id);
        return;
      case TpStyle::kRowwise:
        if (m.embedding) {
          TORCH_INTERNAL_ASSERT(!m.masks.empty());
          y = y.masked_fill(m.masks.back().unsqueeze(-1), 0);
          m.masks.pop_back();
          y = apply<SumOverGroup>(y, e->group_id);
          return;
        }
        const auto& bias = dynamic_cast<torch::nn::LinearImpl&>(module).bias;
        y = bias.defined() ? apply<SumOverGroup>(y - bias, e->group_id) + bias : apply<SumOverGroup>(y, e->group_id);
        return;
    }
  }

 private:
  std::weak_ptr<TensorParallelEngineImpl> engine_;
  size_t index_;
};

// Keeps this process's piece of `param` along `dim` (of `n` equal pieces), in place of the whole.
void keep_piece(const SplitModule& m, const char* what, at::Tensor& param, int64_t dim, const PartialState& group) {
  const int n = group.num_processes();
  const int64_t whole = param.size(dim);
  TORCH_CHECK_VALUE(whole % n == 0, "[", kTpApi, "] module \"", m.name, "\" (", to_string(m.style), "): its ", what,
                    " has ", whole, " along dimension ", dim, ", which tp_size ", n, " does not divide");
  torch::NoGradGuard no_grad;
  const int64_t piece = whole / n;
  param.set_data(param.narrow(dim, piece * group.process_index(), piece).clone());
}

// Each process's gradients of a sequence-parallel module's parameters cover its piece of the
// sequence: a hook sums them over the group as they arrive, before they are accumulated. A
// parameter the module shares with a module outside it would have that module's whole gradient
// summed too, so it is refused.
void check_not_shared(torch::nn::Module& root, const std::vector<TpAssignment>& plan) {
  std::unordered_map<const void*, std::string> owner;  // parameter → its sequence-parallel module
  std::vector<std::string> names;
  for (const auto& a : plan) {
    if (a.style != TpStyle::kSequenceParallel) continue;
    names.push_back(a.name);
    for (const auto& p : a.module->parameters()) owner[p.unsafeGetTensorImpl()] = a.name;
  }
  if (owner.empty()) return;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    const std::string& name = item.key();
    const bool within = std::any_of(names.begin(), names.end(), [&](const std::string& sp) {
      return name == sp || module_inside(sp, name);
    });
    if (within) continue;
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      auto it = owner.find(p.value().unsafeGetTensorImpl());
      TORCH_CHECK_VALUE(it == owner.end(), "[", kTpApi, "] module \"", it->second, "\" (sequence_parallel) shares a "
                        "parameter with \"", name.empty() ? std::string("the model") : name, "\" (its \"", p.key(),
                        "\"), which is outside it: the gradient of a sequence-parallel module's parameters is summed "
                        "over the tensor-parallel group, and the other module's would be summed with it");
    }
  }
}

void sum_gradients_over_group(const std::shared_ptr<TensorParallelEngineImpl>& engine, torch::nn::Module& module) {
  std::weak_ptr<TensorParallelEngineImpl> weak = engine;
  for (auto& p : module.parameters()) {
    // Once per parameter, however many sequence-parallel modules share it: its gradient is the sum
    // of their uses' pieces, summed over the group once.
    if (!p.requires_grad() || !engine->summed.insert(p.unsafeGetTensorImpl()).second) continue;
    p.register_hook([weak](const at::Tensor& grad) {
      auto e = weak.lock();
      return e ? all_reduce(e->group, grad, Reduction::kSum, kTpApi) : grad;
    });
  }
}

}  // namespace

TensorParallelEngine::TensorParallelEngine(std::shared_ptr<torch::nn::Module> module, const PartialState& group,
                                           const std::vector<TpAssignment>& plan)
    : impl_(std::make_shared<TensorParallelEngineImpl>(group)) {
  auto& e = *impl_;
  e.module = std::move(module);
  check_not_shared(*e.module, plan);
  e.group_id = register_group(group);
  // Every process of the group starts from process 0's values.
  if (group.num_processes() > 1) {
    torch::NoGradGuard no_grad;
    for (auto& t : e.module->parameters()) t.set_data(broadcast(group, t.detach().contiguous(), 0, kTpApi));
    for (auto& t : e.module->buffers()) t.set_data(broadcast(group, t.detach().contiguous(), 0, kTpApi));
    synchronize_rng_state(group, RNGType::kTorch);
    const auto params = e.module->parameters();
    if (std::any_of(params.begin(), params.end(), [](const at::Tensor& t) { return t.is_cuda(); })) {
      synchronize_rng_state(group, RNGType::kCuda);
    }
  }
  for (const auto& assignment : plan) {
    SplitModule m;
    m.name = assignment.name;
    m.module = assignment.module.get();
    m.style = assignment.style;
    m.embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(m.module) != nullptr;
    if (m.embedding) {
      auto& embedding = dynamic_cast<torch::nn::EmbeddingImpl&>(*m.module);
      TORCH_CHECK_VALUE(m.style == TpStyle::kReplicate || !embedding.options.max_norm(), "[", kTpApi, "] module \"",
                        m.name, "\": an Embedding with max_norm cannot be split (it renormalises the rows it looks up, "
                        "and a split lookup reads rows it then discards)");
      TORCH_CHECK_VALUE(m.style != TpStyle::kRowwise || !embedding.options.padding_idx(), "[", kTpApi, "] module \"",
                        m.name, "\": a vocabulary-parallel Embedding with padding_idx is not supported yet");
    }
    const auto split = [&](const char* name, int64_t dim) {
      auto named = m.module->named_parameters(/*recurse=*/false);
      if (!named.contains(name)) return;
      at::Tensor& p = named[name];
      if (!p.defined()) return;
      keep_piece(m, name, p, dim, group);
      e.by_impl[p.unsafeGetTensorImpl()] = e.params.size();
      e.params.push_back({m.name + "." + name, p, dim});
    };
    switch (m.style) {
      case TpStyle::kReplicate:
        break;
      case TpStyle::kColwise:
      case TpStyle::kColwiseRep:
        split("weight", m.embedding ? 1 : 0);
        if (!m.embedding) split("bias", 0);
        break;
      case TpStyle::kRowwise:
        split("weight", m.embedding ? 0 : 1);
        break;
      case TpStyle::kSequenceParallel:
        sum_gradients_over_group(impl_, *m.module);
        break;
    }
    const size_t index = e.modules.size();
    e.modules.push_back(std::move(m));
    add_hook_to_module(*e.modules.back().module, std::make_shared<SplitHook>(impl_, index), /*append=*/true);
  }
}

TensorParallelEngine::~TensorParallelEngine() = default;

const PartialState& TensorParallelEngine::group() const { return impl_->group; }

bool TensorParallelEngine::is_sharded(const at::Tensor& param) const {
  return impl_->by_impl.count(param.unsafeGetTensorImpl()) > 0;
}

void TensorParallelEngine::gather_whole(std::vector<std::pair<std::string, at::Tensor>>& values) const {
  std::unordered_map<std::string, const TpParam*> by_name;
  for (const auto& p : impl_->params) by_name[p.name] = &p;
  for (auto& [name, value] : values) {
    auto it = by_name.find(name);
    if (it == by_name.end()) continue;
    value = whole_of(it->second->param, value);
  }
}

int64_t TensorParallelEngine::split_dim(const at::Tensor& param) const {
  auto it = impl_->by_impl.find(param.unsafeGetTensorImpl());
  TORCH_INTERNAL_ASSERT(it != impl_->by_impl.end(), "not a split parameter");
  return impl_->params[it->second].dim;
}

int64_t TensorParallelEngine::split_dim_of(const std::string& name) const {
  for (const auto& p : impl_->params) {
    if (p.name == name) return p.dim;
  }
  return -1;
}

at::Tensor TensorParallelEngine::whole_of(const at::Tensor& param, const at::Tensor& piece) const {
  return at::cat(all_gather(impl_->group, piece.detach().contiguous(), kTpApi), split_dim(param));
}

at::Tensor TensorParallelEngine::piece_of(const at::Tensor& param, const at::Tensor& whole,
                                          const std::string& what) const {
  const int64_t dim = split_dim(param);
  const int n = impl_->group.num_processes();
  TORCH_CHECK_VALUE(whole.dim() > dim && whole.size(dim) % n == 0, what, " has shape ", whole.sizes(),
                    ": it is split over the tensor-parallel group along dimension ", dim, ", which tp_size ", n,
                    " does not divide");
  const int64_t piece = whole.size(dim) / n;
  return whole.narrow(dim, piece * impl_->group.process_index(), piece);
}

void TensorParallelEngine::split_whole(std::map<std::string, at::Tensor>& values) const {
  for (const auto& p : impl_->params) {
    auto it = values.find(p.name);
    if (it != values.end()) it->second = piece_of(p.param, it->second, "\"" + p.name + "\"").clone();
  }
}

double TensorParallelEngine::total_grad_norm(
    const std::vector<at::Tensor>& params, double norm_type,
    const std::function<double(const std::vector<at::Tensor>&)>& norm_of) const {
  std::vector<at::Tensor> split, whole;
  for (const auto& p : params) (is_sharded(p) ? split : whole).push_back(p);
  const double mine = norm_of(split), rest = norm_of(whole);
  if (std::isinf(norm_type)) {
    const double all = all_reduce(impl_->group, at::tensor({mine}, at::kDouble), Reduction::kMax, kTpApi).item<double>();
    return std::max(all, rest);
  }
  const double all = all_reduce(impl_->group, at::tensor({std::pow(mine, norm_type)}, at::kDouble), Reduction::kSum,
                                kTpApi).item<double>();
  return std::pow(all + std::pow(rest, norm_type), 1.0 / norm_type);
}

void TensorParallelEngine::begin_pass() {
  ++impl_->pass;
  // A forward that threw left its calls in flight: the generators they set aside go back (the
  // oldest last: it holds the group's shared stream), so a pass retried after the error draws
  // alike on every process again.
  for (auto& m : impl_->modules) {
    while (!m.forks.empty()) {
      restore_generator(m.forks.back());
      m.forks.pop_back();
    }
    m.lengths.clear();
    m.masks.clear();
  }
}

std::vector<std::string> TensorParallelEngine::modules_without_hook() const {
  std::vector<std::string> names;
  for (const auto& m : impl_->modules) {
    if (m.style != TpStyle::kReplicate && m.hooked_pass != impl_->pass) names.push_back(m.name);
  }
  return names;
}

// Note [Split layers called without their hook]
// A split module called past its hook (`child(x)` on a torch::nn::Linear member, or its weight in
// a functional call) computes with its piece and no communication: a rowwise layer fed a colwise
// layer's sharded output then returns this process's partial sum, of the right shape, silently
// wrong. After each forward pass that records gradients, the split modules whose hook did not run
// in it are looked for in the pass's autograd graph: a parameter of one of them reached from the
// outputs was used without its hook, and the pass is refused, naming the module and the fix. A
// pass without gradients has no graph: there, a pass in which no split module ran its hook is
// refused (the model calls none of them through their hook).
void TensorParallelEngine::check_pass(const std::vector<at::Tensor>& outputs) const {
  // The common case, checked without allocating: every split module ran its hook.
  if (std::all_of(impl_->modules.begin(), impl_->modules.end(), [&](const SplitModule& m) {
        return m.style == TpStyle::kReplicate || m.hooked_pass == impl_->pass;
      })) {
    return;
  }
  const auto refuse = [&](const std::string& names) {
    C10_THROW_ERROR(Error, c10::str("[", kTpApi, "] module(s) ", names, " of the tensor-parallel plan ran without "
                                    "their hook in this forward pass, so they computed with this process's piece and "
                                    "no communication (in a pass that records no gradients: they never ran their hook "
                                    "in any pass; a module the model never calls does not belong in the plan). A "
                                    "module's hook runs only when it is called through "
                                    "accelerate::forward(child, x), from a torch::nn::Sequential, or through a member "
                                    "declared with a holder of accelerate/nn.h (accelerate::nn::Linear, "
                                    "accelerate::nn::Embedding, accelerate::nn::Hooked<M>): declare the member with "
                                    "those holders (child(x) calls stay as they are)"));
  };
  std::unordered_map<const void*, size_t> module_of;  // parameter → index of its unhooked module
  for (size_t i = 0; i < impl_->modules.size(); ++i) {
    const auto& m = impl_->modules[i];
    if (m.style == TpStyle::kReplicate || m.hooked_pass == impl_->pass) continue;
    for (const auto& p : m.module->parameters(/*recurse=*/false)) module_of[p.unsafeGetTensorImpl()] = i;
  }
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  for (const auto& t : outputs) {
    if (t.defined() && t.grad_fn()) stack.push_back(t.grad_fn().get());
  }
  std::set<size_t> found;
  if (stack.empty()) {
    // No graph to look in: the modules that never ran their hook, in this pass or any before.
    for (size_t i = 0; i < impl_->modules.size(); ++i) {
      const auto& m = impl_->modules[i];
      if (m.style != TpStyle::kReplicate && !m.ever_hooked) found.insert(i);
    }
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    if (auto* accumulate = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      auto it = module_of.find(accumulate->variable.unsafeGetTensorImpl());
      if (it != module_of.end()) found.insert(it->second);
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function) stack.push_back(edge.function.get());
    }
  }
  if (found.empty()) return;
  std::string names;
  size_t listed = 0;
  for (size_t i : found) {
    if (listed++ < 8) names += (names.empty() ? "" : ", ") + impl_->modules[i].name;
  }
  refuse(names);
}

}  // namespace accelerate::detail
