// The fully sharded engine; see fsdp.h.
#include "detail/fsdp.h"

#include "accelerate/hooks.h"
#include "accelerate/utils/device_map.h"
#include "accelerate/utils/environment.h"
#include "accelerate/utils/safetensors.h"
#include "detail/check.h"
#include "detail/collectives.h"
#include "detail/env.h"
#include "detail/state_impl.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

namespace accelerate::detail {

// Note [Fully sharded engine]
// Every parameter of a unit is split on dimension 0 into `num_processes` pieces of
// ceil(rows / num_processes) rows (the last ones shorter, possibly empty), as PyTorch's
// `fully_shard` does. The module keeps its own parameter objects, so an optimizer built on
// `module->parameters()` before `prepare` stays valid; what changes is the data behind them:
// - at rest, a parameter's data is this process's shard, and its `.grad` the shard's gradient:
//   the optimizer steps shards only;
// - around its unit's forward and backward, its data is the whole tensor, on a storage of its own
//   that the engine frees (size 0) when the unit is resharded and fills again when it is gathered.
//   Autograd keeps the parameter itself (and views of that storage) for the backward pass, so
//   the backward sees the gathered values; `set_data` leaves the version counter alone, and the
//   gather writes through another tensor, so neither counts as an in-place change.
// A unit is gathered before its forward (ModelHook on its module, or the prepared model's call
// for the root) and before its backward (hooks on its outputs' gradients), and freed after its
// forward (FULL_SHARD, not the root) and after its backward. After its backward, the whole
// gradients of its parameters are reduce-scattered in one flat collective per dtype (averaged
// over the processes); the backward end is seen by an autograd node on the unit's inputs, and
// for the root (and any unit whose inputs needed no gradient) by a callback at the end of the
// backward pass. Inside `no_sync` the whole gradients accumulate and the reduction waits for the
// synchronising pass. NO_SHARD keeps every parameter whole and averages gradients per unit.

// Note [Offloading to the CPU]
// cpu_offload (upstream's CPUOffload(offload_params=True)) keeps what the optimizer steps on the
// CPU: the shards at rest (under NO_SHARD, the whole parameters), their gradients, and so the
// optimizer's state and its step. Only units at work occupy the device: a gather copies this
// process's rows from the CPU (page-locked memory on GPUs) into the device's flat buffer, and a
// reduction's piece is copied back into the gradient on the CPU. The model arrives on the device
// (prepare places it there, as for any strategy, which also lets sync_module_states broadcast on
// it), and sharding moves the rows each process keeps to the CPU, freeing the device's copy.
// Buffers, ignored modules and activations stay on the device. Collectives always run on the
// device's tensors (NCCL takes no CPU tensors): state dicts gather there and come back to the CPU.
// On the CPU itself there is nothing to move, and the setting changes nothing.

namespace {

// A dtype of the mixed-precision policy by upstream's names, or none for an empty one.
c10::optional<at::ScalarType> policy_dtype(const char* field, const std::string& name) {
  if (name.empty()) return c10::nullopt;
  if (name == "fp32" || name == "float32" || name == "float") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "fp16" || name == "float16" || name == "half") return at::kHalf;
  if (name == "fp64" || name == "float64" || name == "double") return at::kDouble;
  TORCH_CHECK_VALUE(false, "[FullyShardedDataParallelPlugin] mixed_precision_policy.", field, " must be one of fp32, ",
                    "bf16, fp16 or fp64 (or empty for the parameters' own dtype), got \"", name, "\"");
  return c10::nullopt;
}

}  // namespace

FsdpSettings resolve_fsdp_plugin(const FullyShardedDataParallelPlugin& plugin, c10::Device device) {
  const auto env = [](const char* name) { return get_env(name); };
  const auto flag = [&](const std::optional<bool>& given, const char* name, bool fallback) {
    if (given) return *given;
    auto value = env(name);
    return value ? str_to_bool(*value) : fallback;
  };
  FsdpSettings s;
  if (plugin.fsdp_version) {
    s.fsdp_version = *plugin.fsdp_version;
  } else if (auto v = env("FSDP_VERSION")) {
    s.fsdp_version = parse_env_int("FSDP_VERSION", *v);
  }
  TORCH_CHECK_VALUE(s.fsdp_version == 1 || s.fsdp_version == 2,
                    "[FullyShardedDataParallelPlugin] fsdp_version must be 1 or 2, got ", s.fsdp_version);

  // What the user set wins over both variables of the environment.
  const bool user_chose = plugin.sharding_strategy || plugin.reshard_after_forward;
  std::optional<FsdpShardingStrategy> strategy = plugin.sharding_strategy;
  if (!user_chose) {
    if (auto v = env("FSDP_SHARDING_STRATEGY")) strategy = parse_fsdp_sharding_strategy(*v);
  }
  std::optional<bool> reshard = plugin.reshard_after_forward;
  if (!user_chose) {
    if (auto v = env("FSDP_RESHARD_AFTER_FORWARD")) {
      // Version 1 configurations write a sharding strategy here; version 2 a boolean.
      const std::string text = *v;
      bool is_bool = true;
      try {
        reshard = str_to_bool(text);
      } catch (const std::exception&) {
        is_bool = false;
      }
      if (!is_bool && !strategy) strategy = parse_fsdp_sharding_strategy(text);
    }
  }
  if (strategy && reshard) {
    const bool implied = *strategy == FsdpShardingStrategy::kFullShard || *strategy == FsdpShardingStrategy::kHybridShard;
    const bool conflicting = *strategy != FsdpShardingStrategy::kNoShard && implied != *reshard;
    TORCH_CHECK_VALUE(!conflicting, "[FullyShardedDataParallelPlugin] sharding_strategy ", to_string(*strategy),
                      " and reshard_after_forward=", *reshard ? "true" : "false",
                      " contradict each other; set one of them");
  }
  if (strategy) {
    s.sharding_strategy = *strategy;
  } else if (reshard) {
    s.sharding_strategy = *reshard ? FsdpShardingStrategy::kFullShard : FsdpShardingStrategy::kShardGradOp;
  }
  s.reshard_after_forward = s.sharding_strategy == FsdpShardingStrategy::kFullShard ||
                            s.sharding_strategy == FsdpShardingStrategy::kHybridShard;

  if (plugin.backward_prefetch) {
    s.backward_prefetch = *plugin.backward_prefetch;
  } else if (auto v = env("FSDP_BACKWARD_PREFETCH")) {
    s.backward_prefetch = parse_fsdp_backward_prefetch(*v);
  }
  s.forward_prefetch = flag(plugin.forward_prefetch, "FSDP_FORWARD_PREFETCH", false);
  // At most one gather is on its way ahead of its unit (Note [Prefetching]), within either setting.
  s.limit_all_gathers = flag(plugin.limit_all_gathers, "FSDP_LIMIT_ALL_GATHERS", true);

  const auto& mp = plugin.mixed_precision_policy;
  s.param_dtype = policy_dtype("param_dtype", mp.param_dtype);
  s.reduce_dtype = policy_dtype("reduce_dtype", mp.reduce_dtype);
  s.buffer_dtype = policy_dtype("buffer_dtype", mp.buffer_dtype);

  if (plugin.auto_wrap_policy) {
    s.auto_wrap_policy = *plugin.auto_wrap_policy;
  } else if (auto v = env("FSDP_AUTO_WRAP_POLICY")) {
    s.auto_wrap_policy = parse_fsdp_auto_wrap_policy(*v);
  }
  TORCH_CHECK_VALUE(!(plugin.auto_wrap_policy && plugin.auto_wrap_callable),
                    "[FullyShardedDataParallelPlugin] give either auto_wrap_policy or auto_wrap_callable, not both");
  s.auto_wrap_callable = plugin.auto_wrap_callable;
  s.transformer_cls_names_to_wrap = plugin.transformer_cls_names_to_wrap;
  if (s.transformer_cls_names_to_wrap.empty()) {
    if (auto v = env("FSDP_TRANSFORMER_CLS_TO_WRAP")) {
      std::stringstream in(*v);
      for (std::string item; std::getline(in, item, ',');) {
        item.erase(0, item.find_first_not_of(' '));
        item.erase(item.find_last_not_of(' ') + 1);
        if (!item.empty()) s.transformer_cls_names_to_wrap.push_back(item);
      }
    }
  }
  TORCH_CHECK_VALUE(s.auto_wrap_policy != FsdpAutoWrapPolicy::kTransformerBasedWrap ||
                        !s.transformer_cls_names_to_wrap.empty(),
                    "[FullyShardedDataParallelPlugin] TRANSFORMER_BASED_WRAP needs transformer_cls_names_to_wrap "
                    "(or FSDP_TRANSFORMER_CLS_TO_WRAP): the class names of the modules to wrap");
  if (plugin.min_num_params) {
    s.min_num_params = *plugin.min_num_params;
  } else if (auto v = env("FSDP_MIN_NUM_PARAMS")) {
    s.min_num_params = parse_env_int("FSDP_MIN_NUM_PARAMS", *v);
  }
  TORCH_CHECK_VALUE(s.min_num_params > 0, "[FullyShardedDataParallelPlugin] min_num_params must be positive, got ",
                    s.min_num_params);

  s.cpu_offload = flag(plugin.cpu_offload, "FSDP_OFFLOAD_PARAMS", false);  // Note [Offloading to the CPU]
  s.ignored_modules = plugin.ignored_modules;
  if (plugin.state_dict_type) {
    s.state_dict_type = *plugin.state_dict_type;
  } else if (auto v = env("FSDP_STATE_DICT_TYPE")) {
    s.state_dict_type = parse_fsdp_state_dict_type(*v);
  }
  s.sync_module_states = flag(plugin.sync_module_states, "FSDP_SYNC_MODULE_STATES", true);
  s.param_init_fn = plugin.param_init_fn;
  s.cpu_ram_efficient_loading = flag(plugin.cpu_ram_efficient_loading, "FSDP_CPU_RAM_EFFICIENT_LOADING", false);
  TORCH_CHECK_VALUE(!s.cpu_ram_efficient_loading || s.sync_module_states,
                    "[FullyShardedDataParallelPlugin] cpu_ram_efficient_loading needs sync_module_states: the "
                    "processes other than 0 get their weights from process 0");
  s.activation_checkpointing = flag(plugin.activation_checkpointing, "FSDP_ACTIVATION_CHECKPOINTING", false);
  s.use_orig_params = flag(plugin.use_orig_params, "FSDP_USE_ORIG_PARAMS", true);
  TORCH_CHECK_VALUE(s.use_orig_params, "[FullyShardedDataParallelPlugin] use_orig_params=false (one flat parameter "
                                       "per unit for the optimizer) is not supported: the optimizer always steps "
                                       "the module's own parameters, sharded");
  return s;
}

namespace {

// One parameter of a unit.
struct ShardedParam {
  std::string name;          // in the model
  at::Tensor param;          // the module's parameter object, never replaced
  std::vector<int64_t> shape;
  int64_t rows = 1;          // dimension 0 (1 for a scalar)
  int64_t row_numel = 1;     // elements per row
  int64_t shard_rows = 1;    // rows of every padded piece
  at::Tensor shard;          // this process's rows, what `param` holds at rest
  at::Tensor full;           // the whole tensor on a storage of its own, empty while resharded
  at::Tensor grad_at_rest;   // the shard's gradient, kept aside while the whole one is computed
  at::Tensor pending_grad;   // whole gradients accumulated inside no_sync
  at::Tensor lent_grad;      // the zeroed buffer given as `.grad` before the backward (Note [Lending gradient buffers])
  int64_t lent_version = 0;  // its version then: unchanged means autograd added nothing
  int64_t offset = 0;        // in its dtype group's packed gather piece
  bool own_gather = false;   // gathered on its own, straight into its whole storage (Note [Gathering large parameters in place])
  // Note [Reducing large gradients where autograd wrote them]
  bool own_reduction = false;  // reduced in a collective of its own, from the buffer lent as its `.grad`
  at::Tensor reduce_input;     // that collective's input: the whole gradient, then padding rows
  int64_t reduce_offset = 0;   // otherwise: in its dtype group's packed reduction piece
};

int64_t rows_of(const ShardedParam& p, int rank) {
  return std::clamp<int64_t>(p.rows - rank * p.shard_rows, 0, p.shard_rows);
}

}  // namespace

std::pair<int64_t, int64_t> rows_held(int64_t rows, int world, int rank) {
  const int64_t each = (rows + world - 1) / world;
  const int64_t first = std::min(rows, rank * each);
  return {first, std::clamp<int64_t>(rows - rank * each, 0, each)};
}

namespace {

struct DtypeGroup {
  at::ScalarType dtype;        // of the shards (what the optimizer steps)
  std::vector<size_t> params;  // indices into the unit's params
  int64_t piece = 0;           // elements of one process's padded piece of every parameter
  int64_t gather_piece = 0;    // the same for the packed gather: the parameters without a gather of their own
  int64_t reduce_piece = 0;    // the same for the packed reduction: the parameters without a reduction of their own
  at::ScalarType compute;      // of the whole parameters: the policy's param_dtype, else `dtype`
  at::ScalarType reduce;       // of the gradients' reduction: reduce_dtype, else `compute`
};

// A dtype group's gather, started and not yet waited for.
struct GatherInFlight {
  size_t group;
  at::Tensor piece;  // this process's rows, sent
  at::Tensor all;    // every process's, received
  PendingCollective pending;
  std::optional<size_t> param;  // a parameter gathered on its own: `all` is its whole storage
};

struct Unit {
  std::string name;  // "" for the root
  torch::nn::Module* module = nullptr;
  std::vector<ShardedParam> params;
  std::vector<DtypeGroup> groups;
  bool gathered = false;
  std::vector<GatherInFlight> gathering;  // a gather started ahead (prefetch), not finished
  bool backward_armed = false;  // gradients set aside, waiting for the reduction
  int pending_input_nodes = 0;  // forward calls whose input node has not run backward yet
};

}  // namespace

// Buffers the engine frees and allocates again unit after unit (Note [Reusing the engine's buffers]).
struct BufferPool {
  std::multimap<size_t, at::DataPtr> free;
  size_t held = 0;
  size_t cap = 0;
  at::DataPtr take(size_t bytes, at::Allocator* allocator);
  void give(size_t bytes, at::DataPtr data);
  // Frees the bytes of `t`'s storage into the pool (the tensor keeps its shape, with no data).
  void free_storage(const at::Tensor& t);
  // Gives `t`'s storage its bytes again (`bytes`, when more than `t` needs).
  void allocate_storage(const at::Tensor& t, size_t bytes = 0);
  // A flat tensor of `numel` uninitialised elements.
  at::Tensor empty(int64_t numel, const at::TensorOptions& options);
  // Gives a tensor from `empty` back, when nothing else holds it.
  void release(at::Tensor& t);
  // Takes the bytes of a CPU buffer that a finished collective used back into the pool, whoever
  // still refers to it (the process group's own records of the collective may outlive the wait);
  // `release` for other devices.
  void reclaim(at::Tensor& t);
};

struct FsdpEngineImpl : std::enable_shared_from_this<FsdpEngineImpl> {
  BufferPool pool;
  FsdpSettings settings;
  PartialState state;                    // the processes this one's shards are split over
  std::optional<PartialState> replicas;  // hybrid sharding: this shard's holders in every replica
  int num_replicas = 1;
  int replica = 0;
  std::shared_ptr<torch::nn::Module> module;
  std::vector<Unit> units;  // root first
  bool shard = true;        // false for NO_SHARD
  bool offload = false;     // cpu_offload on another device than the CPU (Note [Offloading to the CPU])
  std::unordered_map<const void*, at::ScalarType> buffer_dtypes;  // buffers cast by buffer_dtype: their own dtype
  int world = 1;
  int rank = 0;
  bool callback_queued = false;
  bool require_sync = true;  // false inside no_sync
  bool overlap_reductions = true;  // Note [When a reduction overlaps the backward pass]
  struct InFlight {
    Unit* unit = nullptr;
    DtypeGroup* group = nullptr;
    std::vector<size_t> slots;  // the parameters it reduces, as positions in `group->params`
    bool packed = true;  // the group's packed reduction, which carries every parameter's flag; else one parameter's own
    at::Tensor mine;   // this process's piece of the sum, once waited for
    at::Tensor input;  // the whole gradients, alive until then
    PendingCollective pending;
    double post_divide = 1;  // what the sum is divided by once it arrived (Note [Dividing an fp16 sum])
    bool had_every_gradient = false;  // this process had the group's every gradient: every flag's sum is positive
    bool mine_is_gradient = false;    // `mine` becomes the shard's gradient as it is (not from the pool)
    bool input_shared = false;        // someone else still holds the gradient lent from `input`
  };
  std::vector<InFlight> in_flight;  // reductions started and not finished
  std::unordered_map<const void*, std::pair<size_t, size_t>> where;  // parameter → (unit, index)

  // Prefetching (Note [Prefetching]): the units (not the root) in the order their forwards ran,
  // in this pass and in the one before.
  std::vector<size_t> forward_order, last_forward_order;
  int64_t forward_prefetches = 0, backward_prefetches = 0;

  explicit FsdpEngineImpl(const PartialState& shard) : state(shard) {}

  void gather(Unit& unit);
  // Starts `unit`'s gather without waiting (nothing when it is gathered or on its way, or when
  // another unit's prefetch is still on its way); true when it started one.
  bool start_gather(Unit& unit);
  // Waits for `unit`'s started gather and puts the whole parameters in place.
  void finish_gather(Unit& unit);
  // The unit that ran after (`after`) or before `unit` in `order`, if any.
  static std::optional<size_t> neighbour(const std::vector<size_t>& order, size_t unit, bool after);
  // Starts the gather of the unit whose backward comes after `index`'s (backward_prefetch).
  void prefetch_for_backward(size_t index);
  void reshard(Unit& unit);
  void pre_backward(size_t unit);
  void post_backward(size_t unit);
  void end_of_backward();
  void lend_gradient_buffers(Unit& unit);
  at::Tensor take_whole_gradient(ShardedParam& p);
  bool take_own_gradient(ShardedParam& p, bool& shared);
  // A zeroed input for `p`'s own reduction: every process's padded rows.
  at::Tensor zeroed_reduce_input(const ShardedParam& p) {
    at::Tensor out = pool.empty(p.shard_rows * p.row_numel * world, p.param.options());
    out.zero_();
    return out;
  }
  void reduce(Unit& unit);
  void finish_reductions();
  at::Tensor whole_value(const ShardedParam& p);
  // A buffer as state dicts hold it: in its own dtype when buffer_dtype cast it.
  at::Tensor buffer_as_saved(const at::Tensor& b) const {
    auto it = buffer_dtypes.find(b.unsafeGetTensorImpl());
    return it == buffer_dtypes.end() ? b.detach() : b.detach().to(it->second);
  }
  // What a parameter holds at rest, from `t` (on the device): a copy of its own, on the CPU when
  // offloaded (in page-locked memory when the device is a GPU, so that copies to it run at full speed).
  at::Tensor at_rest(const at::Tensor& t) const {
    if (!offload) return t.clone();
    auto out = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(state.device().is_cuda()));
    out.copy_(t);
    return out;
  }
  // A floating input of a unit (or of the root) in the dtype the unit computes in.
  at::Tensor cast_input(const at::Tensor& t) const {
    if (!settings.param_dtype || !t.defined() || !at::isFloatingType(t.scalar_type())) return t;
    return t.to(*settings.param_dtype);
  }
};

namespace {

constexpr const char* kApi = "FullyShardedDataParallel";
// A parameter at least this large, padded, is gathered and reduced in collectives of its own
// (Note [Gathering large parameters in place], Note [Reducing large gradients where autograd
// wrote them]).
constexpr size_t kOwnCollectiveBytes = size_t{1} << 20;

}  // namespace

// Note [Reusing the engine's buffers]
// Every unit's whole parameters, and the flat buffers of its gathers and reductions, are needed
// for a moment and then freed, unit after unit, several times a step. Given back to malloc,
// buffers of this size end up kept in its heap (glibc raises its mmap threshold to the size of
// the first ones freed) and the process's resident memory grows well past what is in use. The
// engine keeps them instead: a freed buffer goes to a pool by byte size, bounded by a few units'
// worth, and the next buffer of that size comes from there. So do the whole gradients (Note
// [Lending gradient buffers]). A collective's CPU buffers are taken back once it has been waited
// for, whoever still refers to them: the process group's own records of a collective (MPI's
// queue, a work object) can outlive the wait, and a buffer given back only when nothing held it
// went back to malloc instead, most of the time. A gradient buffer goes back only while nothing
// else holds it, since the user may keep a gradient.
at::DataPtr BufferPool::take(size_t bytes, at::Allocator* allocator) {
  auto it = free.find(bytes);
  if (it == free.end()) return allocator->allocate(bytes);
  at::DataPtr out = std::move(it->second);
  free.erase(it);
  held -= bytes;
  return out;
}

void BufferPool::give(size_t bytes, at::DataPtr data) {
  if (!data || bytes == 0 || held + bytes > cap) return;  // freed here
  held += bytes;
  free.emplace(bytes, std::move(data));
}

void BufferPool::free_storage(const at::Tensor& t) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  const size_t bytes = storage->nbytes();
  if (bytes == 0) return;
  give(bytes, storage->set_data_ptr(at::DataPtr(nullptr, t.device())));
  storage->set_nbytes(0);
}

void BufferPool::allocate_storage(const at::Tensor& t, size_t bytes) {
  auto* storage = t.storage().unsafeGetStorageImpl();
  bytes = std::max(bytes, static_cast<size_t>(t.numel()) * t.element_size());
  if (storage->nbytes() == bytes) return;
  storage->set_data_ptr_noswap(take(bytes, storage->allocator()));
  storage->set_nbytes(bytes);
}

at::Tensor BufferPool::empty(int64_t numel, const at::TensorOptions& options) {
  at::Tensor out = at::empty({0}, options);
  auto* storage = out.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(numel) * out.element_size();
  storage->set_data_ptr_noswap(take(bytes, storage->allocator()));
  storage->set_nbytes(bytes);
  out.unsafeGetTensorImpl()->set_sizes_contiguous({numel});
  return out;
}

void BufferPool::reclaim(at::Tensor& t) {
  // On a GPU the wait only orders the caller's stream after the collective, which may still be
  // running: the process group's references keep its memory from the allocator until it is
  // done, so there the buffer goes back only when nothing else holds it.
  if (!t.defined() || !t.is_cpu()) return release(t);
  free_storage(t);
  t = at::Tensor();
}

void BufferPool::release(at::Tensor& t) {
  if (t.defined() && t.use_count() == 1 && t.storage().use_count() == 1) free_storage(t);
  t = at::Tensor();
}

namespace {

// Marks the backward end of a unit: an identity on its inputs whose backward runs once the
// gradients of everything the unit computed from them are known.
struct UnitInputNode : torch::autograd::Function<UnitInputNode> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                int64_t engine, int64_t unit) {
    ctx->saved_data["engine"] = c10::IValue(engine);
    ctx->saved_data["unit"] = c10::IValue(unit);
    return inputs.vec();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* impl = reinterpret_cast<FsdpEngineImpl*>(static_cast<intptr_t>(ctx->saved_data["engine"].toInt()));
    const auto unit = static_cast<size_t>(ctx->saved_data["unit"].toInt());
    auto& u = impl->units[unit];
    if (u.pending_input_nodes > 0 && --u.pending_input_nodes == 0) impl->post_backward(unit);
    grads.emplace_back();
    grads.emplace_back();
    return grads;
  }
};

void arm_outputs(const std::shared_ptr<FsdpEngineImpl>& impl, size_t unit, const std::vector<at::Tensor>& outputs) {
  std::weak_ptr<FsdpEngineImpl> weak = impl;
  for (const auto& t : outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    at::Tensor handle = t;
    handle.register_hook([weak, unit](const at::Tensor& grad) {
      if (auto e = weak.lock()) e->pre_backward(unit);
      return grad;
    });
  }
}

// Runs around the forward of a wrapped submodule.
class UnitHook final : public ModelHook {
 public:
  UnitHook(std::weak_ptr<FsdpEngineImpl> engine, size_t unit) : engine_(std::move(engine)), unit_(unit) {}

  void pre_forward(torch::nn::Module& module, std::vector<at::Tensor>& inputs) override {
    (void)module;
    auto e = engine_.lock();
    if (!e) return;
    auto& u = e->units[unit_];
    e->gather(u);
    // A recomputation in the backward pass (Note [Activation checkpointing]) is not a forward:
    // it neither extends the order that prefetching follows nor prefetches.
    if (at::GradMode::is_enabled() && !recomputing_activations()) {
      e->forward_order.push_back(unit_);
      if (e->settings.forward_prefetch) {
        if (auto next = FsdpEngineImpl::neighbour(e->last_forward_order, unit_, /*after=*/true)) {
          if (e->start_gather(e->units[*next])) ++e->forward_prefetches;
        }
      }
    }
    for (auto& input : inputs) input = e->cast_input(input);
    if (!at::GradMode::is_enabled()) return;
    std::vector<size_t> positions;
    std::vector<at::Tensor> differentiable;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].defined() && inputs[i].requires_grad()) {
        positions.push_back(i);
        differentiable.push_back(inputs[i]);
      }
    }
    if (differentiable.empty()) return;  // the end of the backward pass reduces this unit
    // See Note [GCC 14 and autograd::Function::apply] in src/hooks.cpp.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
    auto routed = UnitInputNode::apply(at::TensorList(differentiable),
                                       static_cast<int64_t>(reinterpret_cast<intptr_t>(e.get())),
                                       static_cast<int64_t>(unit_));
#pragma GCC diagnostic pop
    for (size_t i = 0; i < positions.size(); ++i) inputs[positions[i]] = routed[i];
    ++u.pending_input_nodes;
  }

  void post_forward(torch::nn::Module& module, std::vector<at::Tensor>& outputs) override {
    (void)module;
    auto e = engine_.lock();
    if (!e) return;
    auto& u = e->units[unit_];
    if (at::GradMode::is_enabled()) arm_outputs(e, unit_, outputs);
    if (e->settings.reshard_after_forward || !at::GradMode::is_enabled()) e->reshard(u);
  }

  // Units other than the root are checkpointed when the plugin asks for it (upstream applies
  // the checkpoint wrapper to the modules its auto-wrap policy selects).
  bool checkpoints_activations() const override {
    auto e = engine_.lock();
    return e && e->settings.activation_checkpointing;
  }

 private:
  std::weak_ptr<FsdpEngineImpl> engine_;
  size_t unit_;
};

int64_t count_params(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters(/*recurse=*/false)) n += p.numel();
  return n;
}

// A module's class as a user names it: without namespaces, and without the "Impl" of a
// TORCH_MODULE class ("Block" for `ns::BlockImpl`).
std::string class_name(const torch::nn::Module& m) {
  std::string name = m.name();
  const auto colon = name.rfind("::");
  if (colon != std::string::npos) name = name.substr(colon + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

bool name_matches(const std::string& pattern, const torch::nn::Module& m) {
  return pattern == m.name() || pattern == class_name(m) || pattern == class_name(m) + "Impl";
}

// Which submodules (by dotted name) are units, by the policy; post-order like PyTorch's
// recursive wrapping, so that size-based wrapping sees only what the children left.
int64_t choose_units(const FsdpSettings& s, const std::string& name, torch::nn::Module& m, bool is_root,
                     const std::set<std::string>& ignored, std::vector<std::pair<std::string, torch::nn::Module*>>& out) {
  int64_t unwrapped = count_params(m);
  for (const auto& child : m.named_children()) {
    const std::string child_name = name.empty() ? child.key() : name + "." + child.key();
    if (ignored.count(child_name)) continue;
    unwrapped += choose_units(s, child_name, *child.value(), false, ignored, out);
  }
  if (is_root) return unwrapped;
  bool wrap = false;
  if (s.auto_wrap_callable) {
    wrap = s.auto_wrap_callable(name, m, unwrapped);
  } else if (s.auto_wrap_policy == FsdpAutoWrapPolicy::kTransformerBasedWrap) {
    for (const auto& pattern : s.transformer_cls_names_to_wrap) wrap = wrap || name_matches(pattern, m);
  } else if (s.auto_wrap_policy == FsdpAutoWrapPolicy::kSizeBasedWrap) {
    wrap = unwrapped >= s.min_num_params;
  }
  if (!wrap) return unwrapped;
  out.emplace_back(name, &m);
  return 0;
}

}  // namespace

// Note [Prefetching]
// Without prefetching a unit's gather starts when its forward (or backward) does, and the
// computation waits for it. forward_prefetch starts the gather of the unit that ran next in the
// previous forward pass as soon as a unit's forward begins (PyTorch's FSDP also follows the
// order of an earlier iteration); backward_prefetch starts the gather of the unit whose backward
// comes next (the one before in this pass's forward order) when a unit's backward begins
// (BACKWARD_PRE) or when its gradients are computed, before their reduction (BACKWARD_POST).
// Both cost one more unit of whole parameters. At most one gather is on its way ahead
// (limit_all_gathers' rate limit, always on); a unit whose turn comes waits for its own. Every
// process prefetches alike, since every process runs the same units in the same order, so the
// collectives keep one order. A gather started ahead and never needed is waited for and freed
// when the unit is resharded (at the end of the backward pass at the latest).
//
// Note [Gathering large parameters in place]
// A dtype group's parameters are gathered in one collective: each process sends its rows of
// every parameter in one piece, and every parameter's rows are then copied out of the gathered
// buffer into its whole storage, rank by rank. A parameter whose padded size is 1 MiB or more is
// gathered on its own instead, straight into its whole storage, made that large: the processes'
// pieces arrive one after the other, rows r·shard_rows onwards from process r, so the first
// `rows` rows are the parameter and only padding follows. Nothing is copied, and no gathered
// buffer lives beside the whole parameter. (Its reduction mirrors this: Note [Reducing large
// gradients where autograd wrote them].)
bool FsdpEngineImpl::start_gather(Unit& unit) {
  if (unit.gathered || !unit.gathering.empty() || !shard) return false;
  for (const auto& other : units) {
    if (!other.gathering.empty()) return false;
  }
  torch::NoGradGuard no_grad;
  for (size_t g = 0; g < unit.groups.size(); ++g) {
    const auto& group = unit.groups[g];
    // Gathered in the compute dtype: the cast happens on the shards, and half the bytes travel.
    auto options = at::TensorOptions().dtype(group.compute).device(state.device());
    // This process's rows of `p` at `offset` in `piece`, then zeros up to shard_rows.
    const auto put_rows = [&](at::Tensor& piece, const ShardedParam& p, int64_t offset) {
      const int64_t n = rows_of(p, rank) * p.row_numel;
      if (n > 0) piece.narrow(0, offset, n).copy_(p.shard.reshape({-1}));
      const int64_t padding = p.shard_rows * p.row_numel - n;
      if (padding > 0) piece.narrow(0, offset + n, padding).zero_();
    };
    // Note [Gathering large parameters in place]
    for (size_t i : group.params) {
      auto& p = unit.params[i];
      if (!p.own_gather) continue;
      const int64_t stride = p.shard_rows * p.row_numel;
      auto piece = pool.empty(stride, options);
      put_rows(piece, p, 0);
      pool.allocate_storage(p.full, static_cast<size_t>(stride * world) * p.full.element_size());
      at::Tensor all = at::empty({0}, options);
      all.set_(p.full.storage(), 0, {stride * world}, {1});
      auto pending = all_gather_into_async(state, all, piece, kApi);
      unit.gathering.push_back(GatherInFlight{g, piece, all, std::move(pending), i});
    }
    if (group.gather_piece == 0) continue;
    auto piece = pool.empty(group.gather_piece, options);
    for (size_t i : group.params) {
      const auto& p = unit.params[i];
      if (!p.own_gather) put_rows(piece, p, p.offset);
    }
    auto all = pool.empty(group.gather_piece * world, options);
    auto pending = all_gather_into_async(state, all, piece, kApi);
    unit.gathering.push_back(GatherInFlight{g, piece, all, std::move(pending), std::nullopt});
  }
  return true;
}

void FsdpEngineImpl::finish_gather(Unit& unit) {
  torch::NoGradGuard no_grad;
  auto started = std::move(unit.gathering);
  unit.gathering.clear();
  unit.gathered = true;
  for (auto& flight : started) {
    wait_collective(state, flight.pending, kApi);
    flight.pending = PendingCollective{};  // the collective's references to the buffers go
    pool.reclaim(flight.piece);
    if (flight.param) {
      // Already in its whole storage: `all` is that storage, whose rows are the parameter's.
      auto& p = unit.params[*flight.param];
      flight.all = at::Tensor();
      p.param.set_data(p.full);
      continue;
    }
    const auto& group = unit.groups[flight.group];
    auto by_rank = flight.all.view({world, group.gather_piece});
    for (size_t i : group.params) {
      auto& p = unit.params[i];
      if (p.own_gather) continue;
      pool.allocate_storage(p.full);
      auto rows = p.full.view({p.rows, p.row_numel});
      for (int r = 0; r < world; ++r) {
        const int64_t n = rows_of(p, r);
        if (n == 0) continue;
        rows.narrow(0, r * p.shard_rows, n).copy_(by_rank[r].narrow(0, p.offset, n * p.row_numel).view({n, p.row_numel}));
      }
      p.param.set_data(p.full);
    }
  }
  for (auto& flight : started) {
    if (!flight.param) pool.reclaim(flight.all);
  }
}

std::optional<size_t> FsdpEngineImpl::neighbour(const std::vector<size_t>& order, size_t unit, bool after) {
  auto it = std::find(order.begin(), order.end(), unit);
  if (it == order.end()) return std::nullopt;
  if (after) return std::next(it) == order.end() ? std::nullopt : std::optional<size_t>(*std::next(it));
  return it == order.begin() ? std::nullopt : std::optional<size_t>(*std::prev(it));
}

void FsdpEngineImpl::gather(Unit& unit) {
  if (unit.gathered) return;
  if (shard) {
    // Every gather goes through the started form: prefetched, or started and waited for now.
    if (unit.gathering.empty()) {
      // Another unit's prefetch may be on its way: it goes first, as on every process.
      for (auto& other : units) {
        if (&other != &unit && !other.gathering.empty()) finish_gather(other);
      }
      start_gather(unit);
    }
    finish_gather(unit);
    return;
  }
  unit.gathered = true;
  torch::NoGradGuard no_grad;
  // NO_SHARD with a param_dtype or offloaded: the whole parameters in that dtype on the device,
  // copied from the whole ones at rest.
  for (auto& p : unit.params) {
    if (p.full.is_same(p.shard)) continue;
    pool.allocate_storage(p.full);
    p.full.copy_(p.shard);
    p.param.set_data(p.full);
  }
}

void FsdpEngineImpl::reshard(Unit& unit) {
  if (!unit.gathering.empty()) finish_gather(unit);  // a prefetch that was not needed
  if (!unit.gathered) return;
  unit.gathered = false;
  for (auto& p : unit.params) {
    if (p.full.is_same(p.shard)) continue;  // NO_SHARD in the parameters' own dtype: nothing to free
    p.param.set_data(p.shard);
    pool.free_storage(p.full);
  }
}

void FsdpEngineImpl::pre_backward(size_t index) {
  auto& unit = units[index];
  if (unit.backward_armed) return;
  if (!callback_queued) {
    callback_queued = true;
    auto self = shared_from_this();
    torch::autograd::Engine::get_default_engine().queue_callback([self] { self->end_of_backward(); });
  }
  if (!overlap_reductions) finish_reductions();  // Note [When a reduction overlaps the backward pass]
  gather(unit);
  for (auto& p : unit.params) {
    p.grad_at_rest = p.param.grad();
    p.param.mutable_grad() = at::Tensor();
  }
  if (require_sync) lend_gradient_buffers(unit);
  unit.backward_armed = true;
  if (settings.backward_prefetch == FsdpBackwardPrefetch::kBackwardPre) prefetch_for_backward(index);
}

// Note [Lending gradient buffers]
// Autograd gives a parameter without a `.grad` the first gradient its backward computed (a new
// buffer of the whole parameter's size, from malloc) and adds later ones into it. Those buffers
// live until the unit's reduction has copied them: every unit's whole gradients would come from
// malloc, unit after unit, among activations and the optimizer's temporaries, and glibc's heap
// fragments (bench/README.md, W9). Instead, before a unit's backward on a synchronising pass,
// each parameter that needs a gradient gets a zeroed buffer from the engine's pool as its
// `.grad`; autograd adds into it in place, and the reduction copies it and gives it back. A
// buffer whose version did not move received nothing: its parameter had no gradient in this pass
// and gets none. Inside no_sync the whole gradients outlive the pass (they accumulate), and
// autograd allocates them as before; so it does when the backward builds a graph of its own
// (create_graph), where it replaces the `.grad` instead of adding into it. A large parameter's
// buffer is its reduction's input itself (Note [Reducing large gradients where autograd wrote
// them]).
void FsdpEngineImpl::lend_gradient_buffers(Unit& unit) {
  torch::NoGradGuard no_grad;
  for (auto& p : unit.params) {
    if (!p.param.requires_grad()) continue;
    if (p.own_reduction) {
      // The reduction's input, zeroed (its padding rows are sent as they are); its first elements
      // are the whole gradient. A view shares its base's version, and nothing else writes the base.
      p.reduce_input = zeroed_reduce_input(p);
      at::Tensor view = p.reduce_input.narrow(0, 0, p.param.numel()).view(p.param.sizes());
      p.lent_version = static_cast<int64_t>(view._version());
      p.lent_grad = view;
      p.param.mutable_grad() = view;
      continue;
    }
    if (p.pending_grad.defined()) continue;
    at::Tensor buffer = pool.empty(p.param.numel(), p.param.options());
    buffer.unsafeGetTensorImpl()->set_sizes_contiguous(p.param.sizes());  // a view would keep the flat one alive
    buffer.zero_();
    p.lent_version = static_cast<int64_t>(buffer._version());
    p.lent_grad = buffer;
    p.param.mutable_grad() = buffer;
  }
}

// The gradient autograd left in `p` (undefined when none); a lent buffer that received nothing
// goes back to the pool.
at::Tensor FsdpEngineImpl::take_whole_gradient(ShardedParam& p) {
  at::Tensor whole = p.param.grad();
  p.param.mutable_grad() = at::Tensor();
  if (p.lent_grad.defined()) {
    const bool untouched = whole.is_same(p.lent_grad) && static_cast<int64_t>(whole._version()) == p.lent_version;
    p.lent_grad = at::Tensor();
    if (untouched) {
      pool.release(whole);
      return at::Tensor();
    }
  }
  return whole;
}

void FsdpEngineImpl::prefetch_for_backward(size_t index) {
  if (auto next = neighbour(forward_order, index, /*after=*/false)) {
    if (!units[*next].backward_armed && start_gather(units[*next])) ++backward_prefetches;
  }
}

void FsdpEngineImpl::post_backward(size_t index) {
  auto& unit = units[index];
  if (!unit.backward_armed) return;
  unit.backward_armed = false;
  if (settings.backward_prefetch == FsdpBackwardPrefetch::kBackwardPost) prefetch_for_backward(index);
  reduce(unit);
  reshard(unit);
}

void FsdpEngineImpl::end_of_backward() {
  callback_queued = false;
  // Units in reverse order of definition, the root last: the same order on every process.
  for (size_t i = units.size(); i-- > 0;) {
    units[i].pending_input_nodes = 0;
    post_backward(i);
    reshard(units[i]);
  }
  finish_reductions();
}

// Note [Reducing large gradients where autograd wrote them]
// A unit's gradients are reduced in one collective per dtype group: each process's piece holds
// its rows of every parameter, so every whole gradient is copied into a flat buffer first, and
// both are alive until the copy is done (a unit's gradients twice). A parameter whose padded
// gradient is 1 MiB or more is reduced on its own instead: the buffer lent as its `.grad` (Note
// [Lending gradient buffers]) is that collective's input, its whole gradient followed by the
// padding rows, so that process r's piece is rows r·shard_rows onwards, as the shards are cut.
// Autograd adds into it in place, and the collective sends it as it is: no copy, and no second
// buffer. Its piece of the sum becomes the shard's gradient as it is when the shards are kept in
// the reduction's dtype on the job's device. Whether it had a gradient travels among the flags of
// its group's packed reduction (Note [Which parameters had a gradient]), which also reduces the
// smaller parameters as before. A group whose reduction is in another dtype than its gradients
// (reduce_dtype) keeps every parameter in the packed reduction, which casts them as it copies.

// Leaves `p`'s whole gradient of this pass, and whatever no_sync accumulated, in the first
// elements of `p.reduce_input` (zeros where there was none); true when there was some. `shared`:
// something besides the engine still holds the buffer lent as the gradient.
bool FsdpEngineImpl::take_own_gradient(ShardedParam& p, bool& shared) {
  at::Tensor whole = p.param.grad();
  p.param.mutable_grad() = at::Tensor();
  at::Tensor lent = std::exchange(p.lent_grad, at::Tensor());
  if (!p.reduce_input.defined()) p.reduce_input = zeroed_reduce_input(p);  // nothing was lent
  auto target = p.reduce_input.narrow(0, 0, p.param.numel());
  bool had = false;
  if (whole.defined() && whole.is_same(lent)) {
    had = static_cast<int64_t>(whole._version()) != p.lent_version;
  } else if (whole.defined()) {
    // Autograd replaced the lent buffer instead of adding into it (a backward with create_graph).
    target.copy_(whole.reshape({-1}));
    had = true;
  }
  if (p.pending_grad.defined()) {
    target.add_(p.pending_grad.reshape({-1}));
    pool.release(p.pending_grad);
    had = true;
  }
  whole = at::Tensor();
  lent = at::Tensor();
  shared = p.reduce_input.storage().use_count() > 1;
  return had;
}

void FsdpEngineImpl::reduce(Unit& unit) {
  torch::NoGradGuard no_grad;
  const bool sync = require_sync;
  for (auto& group : unit.groups) {
    // Note [Accumulating inside no_sync]
    // Inside no_sync the whole gradients accumulate from pass to pass; when the policy reduces in
    // a wider dtype than it computes in (param_dtype bf16, reduce_dtype fp32), they accumulate in
    // the reduction's dtype, as `fully_shard` does, so that the sum of many passes is not rounded
    // to the compute dtype at every pass. A single pass's gradient is cast when it is copied into
    // the reduction's buffer. (FSDP1 accumulates in param_dtype; both versions here widen. A
    // narrower reduce_dtype, which `fully_shard` would also accumulate in, is not used for the
    // sum: it would only lose precision, or overflow in fp16.)
    const bool upcast = !sync && c10::elementSize(group.reduce) > c10::elementSize(group.compute);
    for (size_t i : group.params) {
      auto& p = unit.params[i];
      if (sync && p.own_reduction) continue;  // taken where autograd wrote it, below
      at::Tensor whole = take_whole_gradient(p);
      if (!whole.defined()) continue;
      if (p.pending_grad.defined()) {
        p.pending_grad.add_(whole);
        pool.release(whole);
      } else if (upcast) {
        p.pending_grad = whole.to(group.reduce);
        pool.release(whole);
      } else {
        p.pending_grad = std::move(whole);
      }
    }
  }
  if (!sync) {
    for (auto& p : unit.params) p.param.mutable_grad() = p.grad_at_rest, p.grad_at_rest = at::Tensor();
    return;
  }
  // Note [When a reduction overlaps the backward pass]
  // On a GPU, or between machines, a unit's reduction travels while the backward pass goes on to
  // the next unit (the device's or the network's work beside the computation, as in PyTorch's
  // FSDP); the one before it is finished first, so at most one unit's whole gradients wait in a
  // buffer. When every process computes on the CPU of one machine, the collective's copies and
  // sums take the same cores as the computation, and the overlap buys no time: the reduction is
  // finished before the next unit's backward begins (pre_backward), and the next unit's whole
  // gradients never share the memory with it (W9 at 4 processes: a peak some 20 MiB lower at the
  // same rate; bench/README.md).
  finish_reductions();
  for (auto& group : unit.groups) {
    auto options = at::TensorOptions().dtype(group.reduce).device(state.device());
    bool any = false;
    for (size_t i : group.params) any = any || unit.params[i].param.requires_grad();
    if (!any) continue;
    // Note [Dividing an fp16 sum]
    // The processes' gradients are averaged: summed by the collective, then divided by their
    // number. fp16 overflows above 65504, so a sum of N fp16 gradients, each of which fits, can
    // become inf, and loss scaling would then skip a step that one process on the whole batch
    // takes. For an fp16 reduction each process's gradients are divided by about √N before the
    // collective (a power of two, which rounds nothing but the tiniest values) and the sum by the
    // rest after it, as PyTorch's FSDP does; bf16 and fp32 have fp32's range and divide once,
    // afterwards.
    const double total = static_cast<double>(world) * num_replicas;
    double pre = 1;
    if (group.reduce == at::kHalf) {
      while (pre * pre < total) pre *= 2;
    }
    const size_t first = in_flight.size();
    // Every process's packed piece ends with one flag per parameter of the group (Note [Which
    // parameters had a gradient]).
    std::vector<float> had(group.params.size(), 0.f);
    std::vector<size_t> packed;  // positions in group.params
    for (size_t j = 0; j < group.params.size(); ++j) {
      auto& p = unit.params[group.params[j]];
      if (!p.own_reduction) {
        packed.push_back(j);
        had[j] = p.pending_grad.defined() ? 1.f : 0.f;
        continue;
      }
      if (!p.param.requires_grad()) continue;
      // Note [Reducing large gradients where autograd wrote them]
      bool shared = false;
      had[j] = take_own_gradient(p, shared) ? 1.f : 0.f;
      InFlight reduction;
      reduction.unit = &unit;
      reduction.group = &group;
      reduction.slots = {j};
      reduction.packed = false;
      reduction.input = std::exchange(p.reduce_input, at::Tensor());
      reduction.input_shared = shared;
      reduction.post_divide = total / pre;
      if (pre > 1) reduction.input.div_(pre);
      const int64_t stride = p.shard_rows * p.row_numel;
      reduction.mine_is_gradient = !p.grad_at_rest.defined() && p.shard.scalar_type() == group.reduce &&
                                   p.shard.device() == state.device();
      reduction.mine = reduction.mine_is_gradient ? at::empty({stride}, options) : pool.empty(stride, options);
      reduction.pending = reduce_scatter_sum_async(state, reduction.mine, reduction.input, kApi);
      in_flight.push_back(std::move(reduction));
    }
    bool complete = true;  // every packed parameter has a gradient: only padding needs zeros
    for (size_t j : packed) complete = complete && had[j] > 0;
    const auto flags = static_cast<int64_t>(had.size());
    const int64_t stride = group.reduce_piece + flags;
    auto input = pool.empty(shard ? stride * world : stride, options);
    if (!complete) input.zero_();
    auto by_rank = input.view({shard ? world : 1, stride});
    by_rank.narrow(1, group.reduce_piece, flags).copy_(at::tensor(had).to(options));  // the same flags in every piece
    if (complete && shard) {
      for (size_t j : packed) {
        const auto& p = unit.params[group.params[j]];
        for (int r = 0; r < world; ++r) {
          const int64_t n = rows_of(p, r);
          if (n < p.shard_rows) {
            by_rank[r].narrow(0, p.reduce_offset + n * p.row_numel, (p.shard_rows - n) * p.row_numel).zero_();
          }
        }
      }
    }
    for (size_t j : packed) {
      auto& p = unit.params[group.params[j]];
      if (!p.pending_grad.defined()) continue;
      auto rows = p.pending_grad.reshape({p.rows, p.row_numel});
      if (!shard) {
        input.narrow(0, p.reduce_offset, p.rows * p.row_numel).copy_(rows.reshape({-1}));
        continue;
      }
      for (int r = 0; r < world; ++r) {
        const int64_t n = rows_of(p, r);
        if (n > 0) {
          by_rank[r]
              .narrow(0, p.reduce_offset, n * p.row_numel)
              .copy_(rows.narrow(0, r * p.shard_rows, n).reshape({-1}));
        }
      }
    }
    for (size_t j : packed) pool.release(unit.params[group.params[j]].pending_grad);  // `input` holds them now
    if (pre > 1) input.div_(pre);
    InFlight reduction;
    reduction.unit = &unit;
    reduction.group = &group;
    reduction.slots = std::move(packed);
    reduction.input = input;
    reduction.post_divide = total / pre;
    if (shard) {
      reduction.mine = pool.empty(stride, options);
      reduction.pending = reduce_scatter_sum_async(state, reduction.mine, reduction.input, kApi);
    } else {
      reduction.mine = all_reduce(state, input, Reduction::kSum, kApi);
    }
    in_flight.push_back(std::move(reduction));
    const bool every = std::find(had.begin(), had.end(), 0.f) == had.end();
    for (size_t k = first; k < in_flight.size(); ++k) in_flight[k].had_every_gradient = every;
  }
}

void FsdpEngineImpl::finish_reductions() {
  torch::NoGradGuard no_grad;
  auto done = std::move(in_flight);
  in_flight.clear();
  for (auto& r : done) {
    wait_collective(state, r.pending, kApi);
    r.pending = PendingCollective{};  // the collective's references to the buffers go
    if (replicas) {
      // Hybrid sharding: the same rows of every replica are summed too, then averaged over all.
      r.mine = all_reduce(*replicas, r.mine, Reduction::kSum, kApi);
    }
    r.mine.div_(r.post_divide);
  }
  // Note [Which parameters had a gradient]
  // A parameter that took no part in the pass has no gradient on one process, and under
  // `fully_shard` gets none: the optimizer then leaves it alone (AdamW neither decays nor moves
  // it). Whether some process had one is known only together, and a process's piece of the sum
  // cannot say it (a gradient may sum to exactly zero), so each process appends a flag per
  // parameter, 1 when it had a gradient, to every piece of its group's packed reduction: the
  // reduction sums them with the gradients, and a parameter whose flags sum to zero gets no
  // gradient, on every process alike. The flags are read only when this process lacked a
  // gradient: otherwise each sum is at least its own 1, and reading them would wait for the device.
  std::unordered_map<const DtypeGroup*, at::Tensor> had_by_group;
  for (auto& r : done) {
    if (!r.packed || r.had_every_gradient) continue;
    const auto flags = static_cast<int64_t>(r.group->params.size());
    had_by_group[r.group] = r.mine.narrow(0, r.group->reduce_piece, flags).to(at::kCPU, at::kFloat);
  }
  for (auto& r : done) {
    auto found = had_by_group.find(r.group);
    const at::Tensor had = found == had_by_group.end() ? at::Tensor() : found->second;
    for (size_t j : r.slots) {
      auto& p = r.unit->params[r.group->params[j]];
      if (!p.param.requires_grad()) continue;
      if (had.defined() && !(had.data_ptr<float>()[j] > 0)) {
        p.param.mutable_grad() = p.grad_at_rest;  // what earlier passes left, if anything
        p.grad_at_rest = at::Tensor();
        continue;
      }
      const int64_t n = shard ? rows_of(p, rank) : p.rows;
      const int64_t offset = r.packed ? p.reduce_offset : 0;
      auto reduced = r.mine.narrow(0, offset, n * p.row_numel).view(p.shard.sizes());
      if (p.grad_at_rest.defined()) {
        p.grad_at_rest.add_(reduced.to(p.grad_at_rest.device()));
        p.param.mutable_grad() = p.grad_at_rest;
      } else if (r.mine_is_gradient) {
        p.param.mutable_grad() = reduced;
      } else {
        // In the shards' dtype and on their device (the CPU when offloaded), where the optimizer
        // steps them (a copy either way: `mine` goes back to the pool).
        p.param.mutable_grad() =
            reduced.to(p.shard.device(), p.shard.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      }
      p.grad_at_rest = at::Tensor();
    }
    // A lent gradient someone else still holds keeps its buffer out of the pool.
    if (r.input_shared) {
      pool.release(r.input);
    } else {
      pool.reclaim(r.input);
    }
    if (shard && !r.mine_is_gradient) pool.reclaim(r.mine);
  }
}

at::Tensor FsdpEngineImpl::whole_value(const ShardedParam& p) {
  torch::NoGradGuard no_grad;
  if (!shard) return p.shard.clone();
  // Gathered on the job's device (NCCL takes no CPU tensors), given back where the shard lives.
  auto options = p.shard.options().device(state.device());
  auto piece = at::zeros({p.shard_rows * p.row_numel}, options);
  const int64_t n = rows_of(p, rank);
  if (n > 0) piece.narrow(0, 0, n * p.row_numel).copy_(p.shard.reshape({-1}));
  auto all = at::empty({piece.numel() * world}, options);
  all_gather_into(state, all, piece, kApi);
  return all.view({world * p.shard_rows, p.row_numel})
      .narrow(0, 0, p.rows)
      .reshape(p.shape)
      .to(p.shard.device(), p.shard.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}

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

}  // namespace

FsdpEngine::FsdpEngine(std::shared_ptr<torch::nn::Module> module, const PartialState& state, FsdpSettings settings,
                       int dp_shard_size)
    : impl_(std::make_shared<FsdpEngineImpl>(shard_state_of(state, shard_group_size(settings, state, dp_shard_size)))) {
  auto& e = *impl_;
  {
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
  e.settings = std::move(settings);
  e.module = std::move(module);
  e.world = e.state.num_processes();
  e.rank = e.state.process_index();
  e.shard = e.settings.sharding_strategy != FsdpShardingStrategy::kNoShard;
  e.offload = e.settings.cpu_offload && !state.device().is_cpu();
  e.overlap_reductions = !state.device().is_cpu() || state.local_num_processes() < state.num_processes();
  auto& root = *e.module;

  // Materialise meta-device tensors (cpu_ram_efficient_loading, or a model built on meta). A
  // process that cannot tells the others, so that every process fails alike instead of waiting.
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

  // Every process must shard the same model the same way.
  {
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
  if (e.settings.sync_module_states && state.num_processes() > 1) {
    std::vector<at::Tensor> tensors = root.parameters();
    auto buffers = root.buffers();
    tensors.insert(tensors.end(), buffers.begin(), buffers.end());
    torch::NoGradGuard no_grad;
    // Small buckets: the flat copies of a large bucket would add the whole model again to the
    // peak memory that sharding is there to cut.
    c10d::broadcast_coalesced(process_group(state, kApi), tensors, 16u * 1024 * 1024, 0);
  }

  std::set<std::string> ignored(e.settings.ignored_modules.begin(), e.settings.ignored_modules.end());
  std::map<std::string, torch::nn::Module*> by_name;
  for (const auto& item : root.named_modules("", /*include_self=*/false)) by_name[item.key()] = item.value().get();
  for (const auto& name : ignored) {
    TORCH_CHECK_VALUE(by_name.count(name), "[", kApi, "] ignored_modules names '", name,
                      "', which is not a submodule of the model");
  }
  std::vector<std::pair<std::string, torch::nn::Module*>> chosen;
  choose_units(e.settings, "", root, /*is_root=*/true, ignored, chosen);
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
  std::map<std::string, size_t> unit_of_module;
  for (size_t i = 1; i < e.units.size(); ++i) unit_of_module[e.units[i].name] = i;
  const auto owner = [&](const std::string& module_name) -> std::optional<size_t> {
    // The nearest enclosing unit; nothing for a module inside an ignored one.
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
  };
  // A parameter reached from two units (tied weights) belongs to the root, which stays gathered
  // through the whole forward and backward pass.
  std::unordered_map<const void*, std::pair<std::string, size_t>> assignment;
  std::vector<std::pair<std::string, at::Tensor>> order;
  std::unordered_set<const void*> ignored_params;
  for (const auto& item : root.named_modules()) {
    auto unit = owner(item.key());
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

  // Flat pieces per dtype, then this process's shards.
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
  // buffer_dtype: floating buffers live in it from now on (upstream's buffers are cast once too),
  // outside ignored modules; state dicts give them back in their own dtype.
  if (e.settings.buffer_dtype) {
    for (const auto& item : root.named_modules()) {
      if (!owner(item.key())) continue;
      for (const auto& b : item.value()->buffers(/*recurse=*/false)) {
        if (!b.defined() || !at::isFloatingType(b.scalar_type()) || b.scalar_type() == *e.settings.buffer_dtype) continue;
        e.buffer_dtypes[b.unsafeGetTensorImpl()] = b.scalar_type();
        at::Tensor handle = b;
        handle.set_data(b.detach().to(*e.settings.buffer_dtype));
      }
    }
  }
  // The pool holds at most what a unit's backward uses at once: its whole parameters and lent
  // gradients, the reduction in flight and the next unit's gather.
  for (const auto& unit : e.units) {
    size_t bytes = 0;
    for (const auto& group : unit.groups) {
      bytes += static_cast<size_t>(group.piece * e.world) * c10::elementSize(group.dtype);
    }
    e.pool.cap = std::max(e.pool.cap, 4 * bytes);
  }
  for (size_t i = 1; i < e.units.size(); ++i) {
    add_hook_to_module(*e.units[i].module, std::make_shared<UnitHook>(impl_, i), /*append=*/true);
  }
  // A gradient reaching a unit that was not gathered for its backward means its forward ran past
  // the unit's hook: the gradient would be neither reduced nor sharded. Say so instead.
  std::weak_ptr<FsdpEngineImpl> weak = impl_;
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
  if (at::GradMode::is_enabled() && !e.forward_order.empty()) {
    e.last_forward_order = std::move(e.forward_order);
    e.forward_order.clear();
  }
  e.gather(e.units[0]);
}

at::Tensor FsdpEngine::cast_forward_input(const at::Tensor& input) const { return impl_->cast_input(input); }

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

std::vector<std::string> FsdpEngine::unit_names() const {
  std::vector<std::string> names;
  for (const auto& u : impl_->units) names.push_back(u.name);
  return names;
}

std::vector<std::pair<std::string, at::Tensor>> FsdpEngine::full_state_dict() {
  auto& e = *impl_;
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& item : e.module->named_parameters()) {
    auto it = e.where.find(item.value().unsafeGetTensorImpl());
    if (it == e.where.end()) {
      out.emplace_back(item.key(), item.value().detach());
      continue;
    }
    out.emplace_back(item.key(), e.whole_value(e.units[it->second.first].params[it->second.second]));
  }
  for (const auto& item : e.module->named_buffers()) out.emplace_back(item.key(), e.buffer_as_saved(item.value()));
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

}  // namespace accelerate::detail

namespace accelerate::detail {

// Note [Sharded checkpoint layout]
// A sharded state (SHARDED_STATE_DICT or LOCAL_STATE_DICT) is a folder of its own inside the
// checkpoint: `pytorch_model_fsdp_<i>` for the i-th model, `optimizer_<i>` for the i-th optimizer
// (upstream's names for its sharded folders). In it:
// - `shard-<r>-of-<n>.safetensors`, one per process r of the n that saved: that process's tensors
//   under their global names (for a row-sharded tensor, its rows, as `rows_held` says: pieces of
//   ceil(rows / n) rows, the last ones shorter or empty), and the state's JSON values in the
//   metadata (as `save_state_dict_file` writes them);
// - `index.json`: {"format": "accelerate-cpp sharded state", "version": 1, "world_size": n,
//   "sharded": {name: whole shape}} — which tensors are split by rows, and their whole shapes.
// A tensor not in "sharded" is whole in every file. Loading with m processes gives each the rows
// `rows_held(rows, m, rank)` of every sharded tensor, copied from whichever files hold them (all
// of them at once when m = n: its own file), and its own file's (else the first file's) values
// and whole tensors. `accelerate merge-weights` joins the rows of every file into whole tensors.

namespace {

constexpr const char* kShardedFormat = "accelerate-cpp sharded state";

std::string shard_file(int rank, int world) {
  return "shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".safetensors";
}

}  // namespace

void save_sharded_state(const PartialState& state, const std::string& folder, const nlohmann::json& values,
                        const std::map<std::string, at::Tensor>& tensors,
                        const std::map<std::string, std::vector<int64_t>>& sharded) {
  const int world = state.num_processes();
  std::filesystem::create_directories(folder);
  StateDict mine{values, {}};
  for (const auto& [name, t] : tensors) mine.tensors.emplace(name, t.detach().contiguous());
  save_state_dict_file(mine, (std::filesystem::path(folder) / shard_file(state.process_index(), world)).string());
  if (state.process_index() == 0) {
    nlohmann::json index = {{"format", kShardedFormat}, {"version", 1}, {"world_size", world}};
    index["sharded"] = nlohmann::json::object();
    for (const auto& [name, shape] : sharded) index["sharded"][name] = shape;
    save_state_dict_file(StateDict{index, {}}, (std::filesystem::path(folder) / "index.json").string());
  }
}

namespace {

nlohmann::json read_sharded_index(const std::filesystem::path& root, const char* api) {
  const auto index_path = (root / "index.json").string();
  TORCH_CHECK_VALUE(std::filesystem::is_regular_file(index_path), "[", api, "] ", root.string(), " has no index.json");
  const auto index = load_state_dict_file(index_path).values;
  TORCH_CHECK_VALUE(index.value("format", "") == kShardedFormat && index.contains("world_size") &&
                        index["world_size"].is_number_integer() && index["world_size"].get<int64_t>() >= 1 &&
                        index["world_size"].get<int64_t>() <= 1000000 && index.contains("sharded") &&
                        index["sharded"].is_object(),
                    "[", api, "] ", index_path, " is not the index of a sharded state");
  for (const auto& [name, shape] : index["sharded"].items()) {
    bool valid = shape.is_array();
    for (const auto& d : shape) valid = valid && d.is_number_integer() && d.get<int64_t>() >= 0;
    TORCH_CHECK_VALUE(valid, "[", api, "] ", index_path, ": the shape of ", name, " is not a list of sizes");
  }
  return index;
}

}  // namespace

TensorMap merge_sharded_state(const std::string& folder) {
  const std::filesystem::path root(folder);
  const auto index = read_sharded_index(root, "merge_weights");
  const int saved = index["world_size"].get<int>();
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  for (int r = 0; r < saved; ++r) {
    const auto path = root / shard_file(r, saved);
    TORCH_CHECK_VALUE(std::filesystem::is_regular_file(path), "[merge_weights] ", folder, " has no ",
                      shard_file(r, saved), " (saved by ", saved, " processes)");
    files.push_back(std::make_unique<SafetensorsFile>(path.string()));
  }
  TensorMap out;
  for (const auto& name : files[0]->keys()) {
    if (!index["sharded"].contains(name)) {
      out.emplace(name, files[0]->get_tensor(name).clone());
      continue;
    }
    const auto shape = index["sharded"][name].get<std::vector<int64_t>>();
    const int64_t rows = shape.empty() ? 1 : shape[0];
    int64_t row_numel = 1;
    for (size_t d = 1; d < shape.size(); ++d) row_numel *= shape[d];
    std::vector<at::Tensor> pieces;
    for (int r = 0; r < saved; ++r) {
      TORCH_CHECK_VALUE(files[r]->contains(name), "[merge_weights] ", shard_file(r, saved), " has no ", name);
      auto piece = files[r]->get_tensor(name);
      const int64_t count = rows_held(rows, saved, r).second;
      TORCH_CHECK_VALUE(piece.numel() == count * row_numel, "[merge_weights] ", shard_file(r, saved), ": ", name,
                        " holds ", piece.numel(), " values where ", count, " rows of ", row_numel, " were expected");
      pieces.push_back(piece.reshape({count, row_numel}));
    }
    out.emplace(name, at::cat(pieces).reshape(shape));
  }
  return out;
}

StateDict load_sharded_state(const PartialState& state, const std::string& folder, bool same_world) {
  const std::filesystem::path root(folder);
  const auto index = read_sharded_index(root, "load_state");
  const int saved = index["world_size"].get<int>();
  const int world = state.num_processes();
  const int rank = state.process_index();
  TORCH_CHECK_VALUE(!same_world || saved == world, "[load_state] ", folder, " was saved by ", saved,
                    " processes as a LOCAL_STATE_DICT, which only loads on as many; this job has ", world,
                    " (SHARDED_STATE_DICT reshards)");
  const auto path_of = [&](int r) {
    const auto path = (root / shard_file(r, saved)).string();
    TORCH_CHECK_VALUE(std::filesystem::is_regular_file(path), "[load_state] ", folder, " has no ", shard_file(r, saved),
                      " (saved by ", saved, " processes)");
    return path;
  };
  StateDict own = load_state_dict_file(path_of(rank < saved ? rank : 0));
  if (saved == world) return own;
  std::map<int, std::unique_ptr<SafetensorsFile>> files;
  for (const auto& [name, shape_json] : index["sharded"].items()) {
    const auto shape = shape_json.get<std::vector<int64_t>>();
    const int64_t rows = shape.empty() ? 1 : shape[0];
    int64_t row_numel = 1;
    for (size_t d = 1; d < shape.size(); ++d) row_numel *= shape[d];
    const auto [first, count] = rows_held(rows, world, rank);
    std::vector<int64_t> local_shape = shape.empty() ? std::vector<int64_t>{count} : shape;
    if (!shape.empty()) local_shape[0] = count;
    at::Tensor out;
    for (int j = 0; j < saved; ++j) {
      const auto [their_first, their_count] = rows_held(rows, saved, j);
      const int64_t begin = std::max(first, their_first), end = std::min(first + count, their_first + their_count);
      auto& file = files[j];
      if (!file) file = std::make_unique<SafetensorsFile>(path_of(j));
      TORCH_CHECK_VALUE(file->contains(name), "[load_state] ", path_of(j), " has no ", name);
      auto theirs = file->get_tensor(name);
      TORCH_CHECK_VALUE(theirs.numel() == their_count * row_numel, "[load_state] ", path_of(j), ": ", name, " holds ",
                        theirs.numel(), " values where ", their_count, " rows of ", row_numel, " were expected");
      if (!out.defined()) out = at::empty({count, row_numel}, theirs.options());
      if (end > begin) {
        out.narrow(0, begin - first, end - begin)
            .copy_(theirs.reshape({their_count, row_numel}).narrow(0, begin - their_first, end - begin));
      }
    }
    own.tensors[name] = out.reshape(local_shape);
  }
  return own;
}

}  // namespace accelerate::detail
