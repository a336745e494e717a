// Tensor parallelism of a prepared model; see engine.h.
#include "tensor_parallel/engine.h"

#include "accelerate/hooks.h"
#include "accelerate/utils/random.h"
#include "detail/collectives.h"
#include "tensor_parallel/communication.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <unordered_map>
#include <unordered_set>

namespace accelerate::detail::tensor_parallel {

// Note [Tensor parallelism]
// A plan names modules and styles (transformers' names). `prepare` first makes every process of
// the tensor-parallel group hold process 0's parameters and buffers (as PyTorch's
// distribute_tensor scatters from rank 0), then keeps in each split parameter only this process's
// piece, through `set_data`, so an optimizer built before `prepare` stays valid and steps pieces:
//   colwise / colwise_rep  a Linear's weight and bias split on dimension 0 (output features), an
//                          Embedding's weight on dimension 1 (embedding features);
//   rowwise                a Linear's weight split on dimension 1 (input features), its bias
//                          whole; an Embedding's weight on dimension 0 (the vocabulary).
// Each split module gets a ModelHook that runs its style's (tensor_parallel/style.cpp), which
// communicates as Megatron-LM does, through autograd functions over the group
// (tensor_parallel/communication.h):
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
//               own (Note [Random numbers of a sequence-parallel module] in style.cpp).
// Parameters outside split modules stay whole; every process of the group computes the same
// values and gradients for them from the same batch. That holds for random operations too: the
// group's processes also take process 0's default generators at `prepare` (CPU, and the CUDA
// device's when the model is there), so a dropout outside the split layers draws the same mask on
// each of them and their activations stay equal (the draws keep in step: every process runs the
// same operations on tensors of the same shapes). Data parallelism (DDP, FSDP) then runs over
// the processes that share a tensor-parallel rank (the mesh's "dp"), on pieces.

struct TpParam {
  std::string name;  // in the model
  at::Tensor param;  // the module's parameter object, never replaced
  int64_t dim = 0;   // the dimension it is split on
  const ParallelStyle* style = nullptr;  // its module's, which cuts and joins it
};

struct SplitModule {
  std::string name;
  torch::nn::Module* module = nullptr;
  std::shared_ptr<ParallelStyle> style;
  int64_t hooked_pass = -1;
  bool ever_hooked = false;
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

// Records that the module's hook ran, and runs its style's.
class SplitHook final : public ModelHook {
 public:
  SplitHook(std::weak_ptr<TensorParallelEngineImpl> engine, size_t index) : engine_(std::move(engine)), index_(index) {}

  void pre_forward(torch::nn::Module& module, std::vector<at::Tensor>& inputs) override {
    auto e = engine_.lock();
    if (!e || inputs.empty() || !inputs[0].defined()) return;
    auto& m = e->modules[index_];
    m.hooked_pass = e->pass;
    m.ever_hooked = true;
    m.style->pre_forward(StyleCall{m.name, e->group, e->group_id}, module, inputs[0]);
  }

  void post_forward(torch::nn::Module& module, std::vector<at::Tensor>& outputs) override {
    auto e = engine_.lock();
    if (!e || outputs.empty() || !outputs[0].defined()) return;
    auto& m = e->modules[index_];
    m.style->post_forward(StyleCall{m.name, e->group, e->group_id}, module, outputs[0]);
  }

 private:
  std::weak_ptr<TensorParallelEngineImpl> engine_;
  size_t index_;
};

// Keeps this process's piece of `param` along `dim` (its style's cut), in place of the whole.
void keep_piece(const SplitModule& m, const char* what, at::Tensor& param, int64_t dim, const PartialState& group) {
  const int n = group.num_processes();
  const int64_t whole = param.size(dim);
  TORCH_CHECK_VALUE(m.style->divides(whole, n), "[", kTpApi, "] module \"", m.name, "\" (", m.style->name(), "): its ",
                    what, " has ", whole, " along dimension ", dim, ", which tp_size ", n, " does not divide");
  torch::NoGradGuard no_grad;
  param.set_data(m.style->piece_of(param, dim, group.process_index(), n).clone());
}

// Each process's gradients of a sequence-parallel module's parameters cover its piece of the
// sequence: a hook sums them over the group as they arrive, before they are accumulated. A
// parameter the module shares with a module outside it would have that module's whole gradient
// summed too, so it is refused.
void check_not_shared(torch::nn::Module& root, const std::vector<TpAssignment>& plan) {
  std::unordered_map<const void*, std::string> owner;  // parameter → its sequence-parallel module
  std::vector<std::string> names;
  for (const auto& a : plan) {
    if (!a.style->runs_on_sequence_piece()) continue;
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
    m.style->attach(*m.module, m.name);
    for (const auto& [name, dim] : m.style->splits(*m.module)) {
      auto named = m.module->named_parameters(/*recurse=*/false);
      if (!named.contains(name)) continue;
      at::Tensor& p = named[name];
      if (!p.defined()) continue;
      keep_piece(m, name, p, dim, group);
      e.by_impl[p.unsafeGetTensorImpl()] = e.params.size();
      e.params.push_back({m.name + "." + name, p, dim, m.style.get()});
    }
    if (m.style->runs_on_sequence_piece()) sum_gradients_over_group(impl_, *m.module);
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

namespace {

const TpParam& split_param(const TensorParallelEngineImpl& e, const at::Tensor& param) {
  auto it = e.by_impl.find(param.unsafeGetTensorImpl());
  TORCH_INTERNAL_ASSERT(it != e.by_impl.end(), "not a split parameter");
  return e.params[it->second];
}

}  // namespace

int64_t TensorParallelEngine::split_dim(const at::Tensor& param) const { return split_param(*impl_, param).dim; }

int64_t TensorParallelEngine::split_dim_of(const std::string& name) const {
  for (const auto& p : impl_->params) {
    if (p.name == name) return p.dim;
  }
  return -1;
}

at::Tensor TensorParallelEngine::whole_of(const at::Tensor& param, const at::Tensor& piece) const {
  const auto& p = split_param(*impl_, param);
  return p.style->join(all_gather(impl_->group, piece.detach().contiguous(), kTpApi), p.dim);
}

at::Tensor TensorParallelEngine::piece_of(const at::Tensor& param, const at::Tensor& whole,
                                          const std::string& what) const {
  const auto& p = split_param(*impl_, param);
  const int64_t dim = p.dim;
  const int n = impl_->group.num_processes();
  TORCH_CHECK_VALUE(whole.dim() > dim && p.style->divides(whole.size(dim), n), what, " has shape ", whole.sizes(),
                    ": it is split over the tensor-parallel group along dimension ", dim, ", which tp_size ", n,
                    " does not divide");
  return p.style->piece_of(whole, dim, impl_->group.process_index(), n);
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
  for (auto& m : impl_->modules) m.style->drop_calls();
}

std::vector<std::string> TensorParallelEngine::modules_without_hook() const {
  std::vector<std::string> names;
  for (const auto& m : impl_->modules) {
    if (!m.style->inert() && m.hooked_pass != impl_->pass) names.push_back(m.name);
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
        return m.style->inert() || m.hooked_pass == impl_->pass;
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
    if (m.style->inert() || m.hooked_pass == impl_->pass) continue;
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
      if (!m.style->inert() && !m.ever_hooked) found.insert(i);
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

}  // namespace accelerate::detail::tensor_parallel
