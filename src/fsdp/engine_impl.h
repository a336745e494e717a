// The engine's inside, shared by its files: engine.cpp (construction and the state dicts),
// gather.cpp (whole parameters before a unit runs), reduce.cpp (gradients after its backward)
// and unit_hooks.cpp (what runs around each unit).
#pragma once

#include "accelerate/hooks.h"
#include "detail/buffer_pool.h"
#include "detail/collectives.h"
#include "fsdp/engine.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace accelerate::detail::fsdp {

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

inline constexpr const char* kApi = "FullyShardedDataParallel";
// A parameter at least this large, padded, is gathered and reduced in collectives of its own
// (Note [Gathering large parameters in place], Note [Reducing large gradients where autograd
// wrote them]).
inline constexpr size_t kOwnCollectiveBytes = size_t{1} << 20;

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

  // How many of its rows process `rank` holds.
  int64_t rows_on(int rank) const { return std::clamp<int64_t>(rows - rank * shard_rows, 0, shard_rows); }
};

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
  int64_t hooked_pass = -1;     // the last forward pass of the model in which its hook ran
};

struct FsdpEngineImpl : std::enable_shared_from_this<FsdpEngineImpl> {
  BufferPool pool;  // Note [Reusing the engine's buffers] in detail/buffer_pool.cpp
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
  int64_t pass = 0;  // forward passes of the prepared model (Note [Units called without their hook])
  bool require_sync = true;  // false inside no_sync
  bool overlap_reductions = true;  // Note [When a reduction overlaps the backward pass]
  // What the gradient entering the model's backward pass is divided by, and what every reduction
  // therefore divides the sum by less (Note [Dividing an fp16 sum]); 1 unless a group reduces in fp16.
  double gradient_divisor = 1;
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
  // After `unit`'s backward: its whole gradients set aside (accumulated inside no_sync), then
  // reduced into the shards, one collective per dtype group and one per large parameter.
  void reduce(Unit& unit);
  void collect_whole_gradients(Unit& unit, bool sync);
  void start_group_reduction(Unit& unit, DtypeGroup& group);
  // The reduction of the group's `j`-th parameter in a collective of its own, from the buffer
  // autograd wrote its gradient into; whether it had a gradient. `pre`: what the gradients
  // arrived divided by (gradient_divisor).
  bool start_own_reduction(Unit& unit, DtypeGroup& group, size_t j, double total, double pre,
                           const at::TensorOptions& options);
  // The packed reduction of the group's other parameters (`packed`: positions in the group),
  // followed by one flag per parameter of the group (`had`).
  void start_packed_reduction(Unit& unit, DtypeGroup& group, std::vector<size_t> packed,
                              const std::vector<float>& had, double total, double pre,
                              const at::TensorOptions& options);
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

/// Registers hooks on `outputs`' gradients that gather `unit` for its backward.
void arm_outputs(const std::shared_ptr<FsdpEngineImpl>& impl, size_t unit, const std::vector<at::Tensor>& outputs);
/// The hook that runs around the forward of unit `unit` (not the root).
std::shared_ptr<ModelHook> unit_hook(std::weak_ptr<FsdpEngineImpl> engine, size_t unit);

}  // namespace accelerate::detail::fsdp
