// The fully sharded engine's construction and its state dicts; see engine.h.
#include "fsdp/engine_impl.h"

#include "accelerate/utils/modeling.h"
#include "detail/check.h"
#include "detail/collective_watch.h"
#include "detail/state_impl.h"
#include "fsdp/rows.h"
#include "fsdp/wrap_policy.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <cmath>
#include <map>
#include <set>
#include <sstream>
#include <unordered_set>

namespace accelerate::detail::fsdp {
namespace {

// The processes one replica is sharded over (Note [Hybrid sharding]).
int shard_group_size(const FsdpSettings& settings, const PartialState& state, int dp_shard_size) {
  const int n = state.num_processes();
  if (settings.sharding_strategy == FsdpShardingStrategy::kNoShard) return n;
  if (dp_shard_size > 0) {
    TORCH_CHECK_VALUE(n % dp_shard_size == 0, "[", kApi, "] dp_shard_size ", dp_shard_size,
                      " does not divide the number of processes, ", n);
    return dp_shard_size;
  }
  const bool hybrid = settings.sharding_strategy == FsdpShardingStrategy::kHybridShard ||
                      settings.sharding_strategy == FsdpShardingStrategy::kHybridShardZero2;
  if (!hybrid) return n;
  // Every process must find the same groups, so the machines' sizes are compared first.
  const std::string mine = std::to_string(state.local_num_processes());
  const auto all = all_gather_bytes(state, std::vector<char>(mine.begin(), mine.end()), kApi);
  std::string sizes;
  bool equal = true;
  for (const auto& theirs : all) {
    equal = equal && std::string(theirs.begin(), theirs.end()) == mine;
    sizes += (sizes.empty() ? "" : ", ") + std::string(theirs.begin(), theirs.end());
  }
  const int local = state.local_num_processes();
  TORCH_CHECK_VALUE(equal && n % local == 0, "[", kApi, "] ", to_string(settings.sharding_strategy),
                    " shards within each machine and replicates across machines, so every machine must run as many "
                    "processes; the processes' machines run ", sizes, " (use a ParallelismConfig's dp_shard_size to "
                    "choose the groups)");
  return local;
}

// Note [Hybrid sharding]
// HYBRID_SHARD (and _HYBRID_SHARD_ZERO2, which keeps whole parameters from forward to backward)
// shards within groups of S consecutive processes and keeps one replica per group, as PyTorch's
// FSDP does over a 2-D mesh (replicate, shard). S is a ParallelismConfig's dp_shard_size, else the
// processes of one machine (PyTorch's intra-node groups), so the gathers stay inside a machine.
// Process r holds shard r % S of replica r / S. Gathers and reduce-scatters run in the shard
// group; each reduced piece is then summed over the processes holding the same shard in the other
// replicas (one allreduce per unit and dtype) and divided by the number of processes. State dicts
// gather within the shard group (every replica holds the whole model); sharded checkpoints are
// written by the first replica alone, as S shards, and every replica reads them back by shard
// index; the global gradient norm sums over the shard group only. With one group (S equal to the
// job) nothing changes; FULL_SHARD and SHARD_GRAD_OP under a ParallelismConfig of both sizes above
// 1 are hybrid in the same way, as FSDP2 over a 2-D mesh is.
PartialState shard_state_of(const PartialState& state, int shard_size) {
  const int n = state.num_processes();
  if (shard_size == n) return state;
  std::vector<std::vector<int>> groups(n / shard_size);
  for (int r = 0; r < n; ++r) groups[r / shard_size].push_back(r);
  return split_state(state, groups, "fsdp-shard");
}

// Which modules are units, and which are ignored.
struct UnitLayout {
  std::set<std::string> ignored;
  std::map<std::string, size_t> unit_of_module;  // the units but the root, by module name

  // The nearest enclosing unit of a module; nothing for a module inside an ignored one.
  std::optional<size_t> owner(const std::string& module_name) const {
    std::string name = module_name;
    std::optional<size_t> found;
    while (true) {
      if (ignored.count(name)) return std::nullopt;
      if (!found) {
        auto it = unit_of_module.find(name);
        if (it != unit_of_module.end()) found = it->second;
      }
      if (name.empty()) break;
      const auto dot = name.rfind('.');
      name = dot == std::string::npos ? "" : name.substr(0, dot);
    }
    return found.value_or(0);
  }
};

// Step 1. Hybrid sharding: the groups holding one replica each, and this process's place.
void split_into_replicas(FsdpEngineImpl& e, const PartialState& state) {
  const int n = state.num_processes();
  const int shard_size = e.state.num_processes();
  e.num_replicas = n / shard_size;
  e.replica = state.process_index() / shard_size;
  if (e.num_replicas > 1) {
    std::vector<std::vector<int>> groups(shard_size);
    for (int r = 0; r < n; ++r) groups[r % shard_size].push_back(r);
    e.replicas = split_state(state, groups, "fsdp-replicate");
  }
}

// Step 2. Gives meta-device tensors storage (cpu_ram_efficient_loading, or a model built on meta).
void materialise_meta_tensors(FsdpEngineImpl& e, const PartialState& state) {
  auto& root = *e.module;
  // A process that cannot tells the others, so that every process fails alike instead of waiting.
  std::string problem;
  try {
    bool meta = false;
    for (const auto& item : root.named_modules()) {
      bool here = false;
      for (const auto& t : item.value()->parameters(false)) here = here || t.is_meta();
      for (const auto& t : item.value()->buffers(false)) here = here || t.is_meta();
      if (!here) continue;
      meta = true;
      if (e.settings.param_init_fn) {
        e.settings.param_init_fn(*item.value());
        continue;
      }
      // Uninitialised: process 0's values arrive with sync_module_states.
      for (const auto& [name, t] : named_module_tensors(*item.value(), /*include_buffers=*/true, /*recurse=*/false)) {
        if (t.is_meta()) {
          set_module_tensor_to_device(*item.value(), name, state.device(),
                                      at::empty(t.sizes(), t.options().device(state.device())));
        }
      }
    }
    TORCH_CHECK_VALUE(!meta || e.settings.sync_module_states || e.settings.param_init_fn,
                      "the model has tensors on the meta device: set sync_module_states (process 0's values are "
                      "copied to the others) or give param_init_fn");
    for (const auto& t : root.parameters()) {
      TORCH_CHECK_VALUE(!t.is_meta(), "param_init_fn left a parameter on the meta device");
    }
  } catch (const std::exception& error) {
    problem = error_text(error);
  }
  {
    auto all = all_gather_bytes(state, std::vector<char>(problem.begin(), problem.end()), kApi);
    for (size_t r = 0; r < all.size(); ++r) {
      TORCH_CHECK_VALUE(all[r].empty(), "[", kApi, "] process ", r, ": ", std::string(all[r].begin(), all[r].end()));
    }
  }
}

// Step 3. Every process must shard the same model the same way.
void check_every_process_has_the_model(torch::nn::Module& root, const PartialState& state) {
  std::ostringstream mine;
  for (const auto& item : root.named_parameters()) {
    mine << item.key() << " " << item.value().sizes() << " " << item.value().scalar_type() << "\n";
  }
  const std::string text = mine.str();
  auto all = all_gather_bytes(state, std::vector<char>(text.begin(), text.end()), kApi);
  const std::string reference(all[0].begin(), all[0].end());
  for (size_t r = 1; r < all.size(); ++r) {
    const std::string theirs(all[r].begin(), all[r].end());
    if (theirs == reference) continue;
    std::istringstream a(reference), b(theirs);
    std::string la, lb;
    while (std::getline(a, la) && std::getline(b, lb) && la == lb) {
    }
    TORCH_CHECK_VALUE(false, "[", kApi, "] every process must prepare the same model: process 0 has '", la,
                      "' where process ", r, " has '", lb, "'");
  }
}

// Step 4. sync_module_states: process 0's values everywhere.
void broadcast_module_states(torch::nn::Module& root, const PartialState& state) {
  std::vector<at::Tensor> tensors = root.parameters();
  auto buffers = root.buffers();
  tensors.insert(tensors.end(), buffers.begin(), buffers.end());
  torch::NoGradGuard no_grad;
  // Small buckets: the flat copies of a large bucket would add the whole model again to the
  // peak memory that sharding is there to cut.
  uint64_t bytes = 0;
  for (const auto& t : tensors) bytes += bytes_of(t);
  count_unwatched(broadcast_sent(state.num_processes(), state.process_index() == 0, bytes));
  c10d::broadcast_coalesced(process_group(state, kApi), tensors, 16u * 1024 * 1024, 0);
}

// Step 5. The units: the root, then what the wrap policy chose.
UnitLayout add_units(FsdpEngineImpl& e) {
  auto& root = *e.module;
  UnitLayout layout;
  auto& ignored = layout.ignored;
  ignored.insert(e.settings.ignored_modules.begin(), e.settings.ignored_modules.end());
  std::map<std::string, torch::nn::Module*> by_name;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) by_name[item.key()] = item.value().get();
  for (const auto& name : ignored) {
    TORCH_CHECK_VALUE(by_name.count(name), "[", kApi, "] ignored_modules names '", name,
                      "', which is not a submodule of the model");
  }
  const auto chosen = choose_units(e.settings, root, ignored);
  const auto add_unit = [&](std::string name, torch::nn::Module* m) {
    Unit unit;
    unit.name = std::move(name);
    unit.module = m;
    e.units.push_back(std::move(unit));
  };
  add_unit("", &root);
  for (const auto& [name, m] : chosen) add_unit(name, m);
  TORCH_CHECK_VALUE(!e.settings.activation_checkpointing || e.units.size() > 1, "[", kApi,
                    "] activation_checkpointing recomputes the forward of each unit that auto_wrap_policy wraps, "
                    "and the policy wraps no submodule of this model (",
                    e.settings.auto_wrap_callable ? std::string("auto_wrap_callable")
                                                  : "auto_wrap_policy " + to_string(e.settings.auto_wrap_policy),
                    "): choose TRANSFORMER_BASED_WRAP (with transformer_cls_names_to_wrap) or SIZE_BASED_WRAP units "
                    "that some submodules meet");
  // Units by module name, for assigning each parameter to its innermost unit.
  for (size_t i = 1; i < e.units.size(); ++i) layout.unit_of_module[e.units[i].name] = i;
  return layout;
}

// Step 6. Each parameter to its innermost unit.
void assign_parameters(FsdpEngineImpl& e, const UnitLayout& layout) {
  auto& root = *e.module;
  // A parameter reached from two units (tied weights) belongs to the root, which stays gathered
  // through the whole forward and backward pass.
  std::unordered_map<const void*, std::pair<std::string, size_t>> assignment;
  std::vector<std::pair<std::string, at::Tensor>> order;
  std::unordered_set<const void*> ignored_params;
  for (const auto& item : root.named_modules()) {
    auto unit = layout.owner(item.key());
    for (const auto& p : item.value()->named_parameters(/*recurse=*/false)) {
      const void* key = p.value().unsafeGetTensorImpl();
      const std::string full = item.key().empty() ? p.key() : item.key() + "." + p.key();
      if (!unit) {
        ignored_params.insert(key);
        continue;
      }
      auto it = assignment.find(key);
      if (it == assignment.end()) {
        assignment.emplace(key, std::make_pair(full, *unit));
        order.emplace_back(full, p.value());
      } else if (it->second.second != *unit) {
        it->second.second = 0;
      }
    }
  }
  for (const auto& [name, param] : order) {
    const void* key = param.unsafeGetTensorImpl();
    if (ignored_params.count(key)) continue;  // tied to an ignored module: left alone
    const size_t u = assignment[key].second;
    ShardedParam p;
    p.name = name;
    p.param = param;
    p.shape = param.sizes().vec();
    p.rows = param.dim() == 0 ? 1 : param.size(0);
    p.row_numel = p.rows == 0 ? 0 : param.numel() / p.rows;
    p.shard_rows = (p.rows + e.world - 1) / e.world;
    e.where[key] = {u, e.units[u].params.size()};
    e.units[u].params.push_back(std::move(p));
  }
}

// Step 7. Flat pieces per dtype, then this process's shards.
void shard_parameters(FsdpEngineImpl& e) {
  torch::NoGradGuard no_grad;
  // The dtype a parameter computes in: the policy's param_dtype for floating ones.
  const auto compute_dtype = [&](at::ScalarType dtype) {
    return at::isFloatingType(dtype) && e.settings.param_dtype ? *e.settings.param_dtype : dtype;
  };
  for (auto& unit : e.units) {
    for (size_t i = 0; i < unit.params.size(); ++i) {
      auto& p = unit.params[i];
      auto it = std::find_if(unit.groups.begin(), unit.groups.end(),
                             [&](const DtypeGroup& g) { return g.dtype == p.param.scalar_type(); });
      if (it == unit.groups.end()) {
        const auto dtype = p.param.scalar_type();
        const auto compute = compute_dtype(dtype);
        const auto reduce = at::isFloatingType(dtype) && e.settings.reduce_dtype ? *e.settings.reduce_dtype : compute;
        unit.groups.push_back(DtypeGroup{dtype, {}, 0, 0, 0, compute, reduce});
        it = std::prev(unit.groups.end());
      }
      it->params.push_back(i);
      it->piece += e.shard ? p.shard_rows * p.row_numel : p.rows * p.row_numel;
    }
    for (auto& group : unit.groups) {
      for (size_t i : group.params) {
        auto& p = unit.params[i];
        const int64_t stride = e.shard ? p.shard_rows * p.row_numel : p.rows * p.row_numel;
        const auto padded_bytes =
            static_cast<size_t>(p.shard_rows * p.row_numel * e.world) * c10::elementSize(group.compute);
        p.own_gather = e.shard && padded_bytes >= kOwnCollectiveBytes;
        if (!p.own_gather) {
          p.offset = group.gather_piece;
          group.gather_piece += stride;
        }
        p.own_reduction = p.own_gather && group.reduce == group.compute;
        if (p.own_reduction) continue;
        p.reduce_offset = group.reduce_piece;
        group.reduce_piece += stride;
      }
    }
    bool cast = false;  // a parameter computes in another dtype than it is kept in
    for (auto& p : unit.params) {
      at::Tensor whole = p.param.detach();
      const auto compute = compute_dtype(p.param.scalar_type());
      cast = cast || compute != p.param.scalar_type();
      // The whole parameter while gathered: in the compute dtype, on the job's device.
      const auto full_options = p.param.options().device(e.state.device()).dtype(compute).requires_grad(false);
      if (e.shard) {
        const auto [first, n] = rows_held(p.rows, e.world, e.rank);
        auto rows = whole.reshape({p.rows, p.row_numel}).narrow(0, first, n);
        std::vector<int64_t> shard_shape = p.shape.empty() ? std::vector<int64_t>{1} : p.shape;
        shard_shape[0] = n;
        p.shard = e.at_rest(rows.reshape(shard_shape));
        p.full = at::empty(p.shape, full_options);
        e.pool.free_storage(p.full);
        p.param.set_data(p.shard);
      } else if (compute != p.param.scalar_type() || e.offload) {
        // The whole parameter, kept in its dtype (on the CPU when offloaded); `full` is its copy
        // while gathered.
        p.shard = e.offload ? e.at_rest(whole) : whole;
        p.full = at::empty(p.shape, full_options);
        e.pool.free_storage(p.full);
        if (e.offload) p.param.set_data(p.shard);
      } else {
        p.shard = whole;
        p.full = whole;
      }
    }
    unit.gathered = !e.shard && !cast && !e.offload;
  }
}

// Step 8. buffer_dtype.
void cast_buffers(FsdpEngineImpl& e, const UnitLayout& layout) {
  auto& root = *e.module;
  torch::NoGradGuard no_grad;
  // buffer_dtype: floating buffers live in it from now on (upstream's buffers are cast once too),
  // outside ignored modules; state dicts give them back in their own dtype.
  if (e.settings.buffer_dtype) {
    for (const auto& item : root.named_modules()) {
      if (!layout.owner(item.key())) continue;
      for (const auto& b : item.value()->buffers(/*recurse=*/false)) {
        if (!b.defined() || !at::isFloatingType(b.scalar_type()) || b.scalar_type() == *e.settings.buffer_dtype) continue;
        e.buffer_dtypes[b.unsafeGetTensorImpl()] = b.scalar_type();
        at::Tensor handle = b;
        handle.set_data(b.detach().to(*e.settings.buffer_dtype));
      }
    }
  }
}

// Step 9. The pool's bound.
void size_pool(FsdpEngineImpl& e) {
  // The pool holds at most what a unit's backward uses at once: its whole parameters and lent
  // gradients, the reduction in flight and the next unit's gather.
  for (const auto& unit : e.units) {
    size_t bytes = 0;
    for (const auto& group : unit.groups) {
      bytes += static_cast<size_t>(group.piece * e.world) * c10::elementSize(group.dtype);
    }
    e.pool.reserve(4 * bytes);
  }
}

// Step 10. The gradient divisor.
// Note [The gradient divisor]
// When some group reduces in fp16, the gradient that enters the model's backward pass (its root
// outputs' gradients) is divided by the smallest power of two at least N (Note [Dividing an fp16
// sum] in reduce.cpp), and what leaves the model is multiplied back, so that only what the engine
// reduces sees the division: the gradients of the root's tensor inputs (an embedding computed
// outside the model) and of ignored modules' parameters, which no reduction multiplies back, are
// multiplied by the divisor on their way. A power of two scales exactly: every gradient ends as it
// would without the division, except one that would have overflowed, which now fits as it does
// for one process on the whole batch. Gradients N times smaller come nearer fp16's smallest
// values, as one process's do; the loss scale, which grows until the gradients near the top of
// the range, keeps them clear of it.
void choose_gradient_divisor(FsdpEngineImpl& e) {
  bool fp16 = false;
  for (const auto& unit : e.units) {
    for (const auto& group : unit.groups) fp16 = fp16 || group.reduce == at::kHalf;
  }
  if (!fp16) return;
  const double total = static_cast<double>(e.world) * e.num_replicas;
  while (e.gradient_divisor < total) e.gradient_divisor *= 2;
}

// Step 11. The hooks: around each unit's forward, and on each parameter's gradient.
void install_hooks(const std::shared_ptr<FsdpEngineImpl>& impl) {
  auto& e = *impl;
  if (e.gradient_divisor > 1) {  // Note [The gradient divisor]: ignored modules' parameters
    const double divisor = e.gradient_divisor;
    for (auto& p : e.module->parameters()) {
      if (!p.requires_grad() || e.where.count(p.unsafeGetTensorImpl())) continue;
      p.register_hook([divisor](const at::Tensor& grad) { return grad * divisor; });
    }
  }
  for (size_t i = 1; i < e.units.size(); ++i) {
    add_hook_to_module(*e.units[i].module, unit_hook(impl, i), /*append=*/true);
  }
  // A gradient reaching a unit that was not gathered for its backward means its forward ran past
  // the unit's hook: the gradient would be neither reduced nor sharded. Say so instead.
  std::weak_ptr<FsdpEngineImpl> weak = impl;
  for (size_t i = 0; i < e.units.size(); ++i) {
    for (auto& p : e.units[i].params) {
      if (!p.param.requires_grad()) continue;
      p.param.register_hook([weak, i](const at::Tensor& grad) {
        auto engine = weak.lock();
        if (!engine || engine->units[i].backward_armed) return grad;
        const auto& name = engine->units[i].name;
        TORCH_CHECK(!name.empty(), "[", kApi, "] a parameter of the model got a gradient that did not come "
                    "through the output of the prepared model's call: compute the loss from what the prepared "
                    "model returns");
        TORCH_CHECK(false, "[", kApi, "] the parameters of unit ", name, " got gradients, but its forward ran "
                    "without the unit's hook: its module was called directly (", name, "(x) or ->forward(x)); "
                    "call it as accelerate::forward(module, x), or choose units whose callers do");
        return grad;
      });
    }
  }
}

}  // namespace

FsdpEngine::FsdpEngine(std::shared_ptr<torch::nn::Module> module, const PartialState& state, FsdpSettings settings,
                       int dp_shard_size)
    : impl_(std::make_shared<FsdpEngineImpl>(shard_state_of(state, shard_group_size(settings, state, dp_shard_size)))) {
  auto& e = *impl_;
  split_into_replicas(e, state);
  e.settings = std::move(settings);
  e.module = std::move(module);
  e.world = e.state.num_processes();
  e.rank = e.state.process_index();
  e.shard = e.settings.sharding_strategy != FsdpShardingStrategy::kNoShard;
  e.offload = e.settings.cpu_offload && !state.device().is_cpu();
  e.overlap_reductions = !state.device().is_cpu() || state.local_num_processes() < state.num_processes();

  materialise_meta_tensors(e, state);
  check_every_process_has_the_model(*e.module, state);
  if (e.settings.sync_module_states && state.num_processes() > 1) broadcast_module_states(*e.module, state);
  const UnitLayout layout = add_units(e);
  assign_parameters(e, layout);
  shard_parameters(e);
  cast_buffers(e, layout);
  size_pool(e);
  choose_gradient_divisor(e);
  install_hooks(impl_);
}

FsdpEngine::~FsdpEngine() {
  for (size_t i = 1; i < impl_->units.size(); ++i) {
    try {
      remove_hook_from_module(*impl_->units[i].module);
    } catch (const std::exception&) {
    }
  }
}

void FsdpEngine::set_require_backward_grad_sync(bool sync) { impl_->require_sync = sync; }

void FsdpEngine::root_pre_forward() {
  auto& e = *impl_;
  ++e.pass;
  if (at::GradMode::is_enabled() && !e.forward_order.empty()) {
    e.last_forward_order = std::move(e.forward_order);
    e.forward_order.clear();
  }
  e.gather(e.units[0]);
}

at::Tensor FsdpEngine::cast_forward_input(const at::Tensor& input) const {
  at::Tensor cast = impl_->cast_input(input);
  const double divisor = impl_->gradient_divisor;
  if (divisor == 1 || !at::GradMode::is_enabled() || !cast.defined() || !cast.requires_grad()) return cast;
  // Note [The gradient divisor]: the input's gradient leaves the model multiplied back. The hook
  // goes on a view of the model's own, so that the caller's tensor keeps none.
  at::Tensor mine = cast.view_as(cast);
  mine.register_hook([divisor](const at::Tensor& grad) { return grad * divisor; });
  return mine;
}

void FsdpEngine::root_post_forward(const std::vector<at::Tensor>& outputs) {
  if (!at::GradMode::is_enabled()) {
    for (auto& unit : impl_->units) impl_->reshard(unit);
    return;
  }
  arm_outputs(impl_, 0, outputs);
}

const FsdpSettings& FsdpEngine::settings() const { return impl_->settings; }
const PartialState& FsdpEngine::shard_group() const { return impl_->state; }
int FsdpEngine::num_replicas() const { return impl_->num_replicas; }
int FsdpEngine::replica_index() const { return impl_->replica; }

std::vector<std::string> FsdpEngine::units_without_hook() const {
  std::vector<std::string> names;
  for (size_t i = 1; i < impl_->units.size(); ++i) {
    if (impl_->units[i].hooked_pass != impl_->pass) names.push_back(impl_->units[i].name);
  }
  return names;
}

std::vector<std::string> FsdpEngine::unit_names() const {
  std::vector<std::string> names;
  for (const auto& u : impl_->units) names.push_back(u.name);
  return names;
}

std::vector<std::pair<std::string, at::Tensor>> FsdpEngine::full_state_dict(bool keep, bool offload_to_cpu) {
  auto& e = *impl_;
  std::vector<std::pair<std::string, at::Tensor>> out;
  const auto add = [&](const std::string& name, at::Tensor value) {
    if (!keep) return;  // the gather happened; the tensor dies here
    out.emplace_back(name, offload_to_cpu ? value.to(at::kCPU) : std::move(value));
  };
  for (const auto& item : e.module->named_parameters()) {
    auto it = e.where.find(item.value().unsafeGetTensorImpl());
    if (it == e.where.end()) {
      add(item.key(), item.value().detach());
      continue;
    }
    add(item.key(), e.whole_value(e.units[it->second.first].params[it->second.second]));
  }
  for (const auto& item : e.module->named_buffers()) add(item.key(), e.buffer_as_saved(item.value()));
  return out;
}

void FsdpEngine::load_full_state_dict(const std::vector<std::pair<std::string, at::Tensor>>& values, bool strict) {
  auto& e = *impl_;
  std::map<std::string, at::Tensor> given(values.begin(), values.end());
  // Everything is checked before anything is written.
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (the model's tensor, the whole value)
  std::set<std::string> used;
  const auto plan = [&](const std::string& name, const at::Tensor& target) {
    auto found = given.find(name);
    if (found == given.end()) {
      TORCH_CHECK_VALUE(!strict, "[", kApi, "] the state dict has no '", name, "'");
      return;
    }
    used.insert(name);
    const auto expected = whole_shape(target);
    TORCH_CHECK_VALUE(found->second.sizes().vec() == expected, "[", kApi, "] '", name, "' has shape ",
                      found->second.sizes(), " in the state dict, the model's is ", c10::IntArrayRef(expected));
    copies.emplace_back(target, found->second);
  };
  for (const auto& item : e.module->named_parameters()) plan(item.key(), item.value());
  for (const auto& item : e.module->named_buffers()) plan(item.key(), item.value());
  if (strict) {
    for (const auto& [name, value] : given) {
      TORCH_CHECK_VALUE(used.count(name), "[", kApi, "] the state dict has '", name, "', which the model has not");
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& [target, value] : copies) {
    auto it = e.where.find(target.unsafeGetTensorImpl());
    if (it == e.where.end()) {
      target.copy_(value);
      continue;
    }
    auto& unit = e.units[it->second.first];
    auto& p = unit.params[it->second.second];
    p.shard.copy_(local_rows(target, value));  // what the parameter holds at rest (all of it under NO_SHARD)
    if (unit.gathered && !p.full.is_same(p.shard)) p.full.copy_(value);
  }
}

bool FsdpEngine::manages(const at::Tensor& param) const { return impl_->where.count(param.unsafeGetTensorImpl()); }

std::vector<int64_t> FsdpEngine::whole_shape(const at::Tensor& param) const {
  auto it = impl_->where.find(param.unsafeGetTensorImpl());
  if (it == impl_->where.end()) return param.sizes().vec();
  return impl_->units[it->second.first].params[it->second.second].shape;
}

at::Tensor FsdpEngine::local_rows(const at::Tensor& param, const at::Tensor& whole) const {
  if (!is_sharded(param)) return whole;
  const auto& [u, i] = impl_->where.at(param.unsafeGetTensorImpl());
  const auto& p = impl_->units[u].params[i];
  TORCH_CHECK_VALUE(whole.sizes().vec() == p.shape, "[", kApi, "] ", p.name, ": expected a tensor of shape ",
                    c10::IntArrayRef(p.shape), ", got ", whole.sizes());
  const auto [first, n] = rows_held(p.rows, impl_->world, impl_->rank);
  std::vector<int64_t> shape = p.shard.sizes().vec();
  return whole.reshape({p.rows, p.row_numel}).narrow(0, first, n).reshape(shape);
}

at::Tensor FsdpEngine::whole_rows(const at::Tensor& param, const at::Tensor& local) {
  if (!is_sharded(param)) return local;
  const auto& [u, i] = impl_->where.at(param.unsafeGetTensorImpl());
  ShardedParam view = impl_->units[u].params[i];
  view.shard = local;
  return impl_->whole_value(view);
}

std::vector<std::pair<std::string, at::Tensor>> FsdpEngine::local_state_dict() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : impl_->module->named_parameters()) out.emplace_back(item.key(), item.value().detach());
  for (const auto& item : impl_->module->named_buffers()) {
    out.emplace_back(item.key(), impl_->buffer_as_saved(item.value()));
  }
  return out;
}

void FsdpEngine::load_local_state_dict(const std::map<std::string, at::Tensor>& values) {
  torch::NoGradGuard no_grad;
  std::set<std::string> used;
  const auto take = [&](const std::string& name, const at::Tensor& target) {
    auto it = values.find(name);
    TORCH_CHECK_VALUE(it != values.end(), "[", kApi, "] the checkpoint has no '", name, "'");
    TORCH_CHECK_VALUE(it->second.sizes() == target.sizes(), "[", kApi, "] '", name, "' has shape ",
                      it->second.sizes(), " in the checkpoint, this process holds ", target.sizes());
    target.copy_(it->second);
    used.insert(name);
  };
  for (const auto& item : impl_->module->named_parameters()) take(item.key(), item.value());
  for (const auto& item : impl_->module->named_buffers()) take(item.key(), item.value());
  for (const auto& [name, value] : values) {
    TORCH_CHECK_VALUE(used.count(name), "[", kApi, "] the checkpoint has '", name, "', which the model has not");
  }
}

std::pair<int64_t, int64_t> FsdpEngine::prefetch_counts() const {
  return {impl_->forward_prefetches, impl_->backward_prefetches};
}

bool FsdpEngine::is_sharded(const at::Tensor& param) const {
  return impl_->shard && impl_->where.count(param.unsafeGetTensorImpl());
}

double FsdpEngine::total_grad_norm(const std::vector<at::Tensor>& params, double norm_type) {
  const bool inf = std::isinf(norm_type);
  // Each parameter's share (its max, or its norm to the power p), for the shards and for the rest.
  std::vector<at::Tensor> sharded, local;
  for (const auto& p : params) {
    const auto& g = p.grad();
    if (!g.defined() || g.numel() == 0) continue;
    auto share = inf ? g.abs().max() : g.norm(norm_type).pow(norm_type);
    // On the job's device: offloaded gradients are on the CPU, those of other parameters may not be.
    (is_sharded(p) ? sharded : local)
        .push_back(share.to(impl_->state.device(), at::kDouble).reshape({1}));
  }
  const auto combine = [&](const std::vector<at::Tensor>& shares) {
    if (shares.empty()) return at::zeros({1}, at::TensorOptions().dtype(at::kDouble).device(impl_->state.device()));
    auto all = at::cat(shares);
    return (inf ? all.max() : all.sum()).reshape({1});
  };
  const double over_processes =
      all_reduce(impl_->state, combine(sharded), inf ? Reduction::kMax : Reduction::kSum, kApi).item<double>();
  const double here = combine(local).item<double>();
  if (inf) return std::max(over_processes, here);
  return std::pow(over_processes + here, 1.0 / norm_type);
}

}  // namespace accelerate::detail::fsdp
