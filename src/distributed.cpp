// Data-parallel models over c10d's Reducer; see include/accelerate/distributed.h.
#include "accelerate/distributed.h"

#include "detail/collectives.h"
#include "distributed_impl.h"
#include "fsdp/engine.h"
#include "tensor_parallel/engine.h"
#include "detail/autograd_function.h"
#include "detail/check.h"
#include "detail/collective_watch.h"
#include "detail/half_math.h"
#include "detail/ring_sum.h"
#include "detail/state_impl.h"
#include "detail/torch_compat.h"
#include "detail/warn.h"

#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/default_comm_hooks.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <algorithm>
#include <chrono>
#include <limits>
#include <mutex>
#include <sstream>
#include <unordered_map>

namespace accelerate {
namespace detail {

struct DistributedDataParallelImpl {
  std::shared_ptr<torch::nn::Module> module;
  DistributedDataParallelKwargs kwargs;
  ForwardOptions forward;
  c10::DeviceType device_type = c10::kCPU;
  c10::intrusive_ptr<c10d::ProcessGroup> process_group;
  std::vector<at::Tensor> buffers;
  std::unique_ptr<c10d::Reducer> reducer;
  std::shared_ptr<fsdp::FsdpEngine> fsdp;  // instead of the reducer, for fully sharded models
  std::shared_ptr<tensor_parallel::TensorParallelEngine> tp;  // the layers split by tensor parallelism, if any
  bool require_backward_grad_sync = true;
  bool require_forward_param_sync = true;
  int64_t num_iterations = 0;

  // Join protocol (see Note [Join protocol]).
  c10::Device device{c10::kCPU};                  // where the parameters, and the protocol's flags, live
  std::chrono::milliseconds timeout{};            // of the protocol's collectives
  bool join_enabled = false;
  c10::intrusive_ptr<c10d::Work> running_notice;  // this process's last "still running" allreduce
  int unrecorded_graph_process = -1;              // see Note [Static graph and join]
  std::optional<PartialState> state;              // the processes (for warnings)

  ~DistributedDataParallelImpl() {
    // The reducer's destructor may throw (c10d declares it noexcept(false)) when a backward pass
    // was left unfinished; a dying model must not take the process down with it.
    try {
      reducer.reset();
    } catch (const std::exception&) {
    }
  }
};

}  // namespace detail

namespace {

// Note [Broadcast bucket size]
// PyTorch DDP broadcasts module states in coalesced chunks of 250 MiB; the first gradient bucket
// is kept at 1 MiB so that the gradients produced first start travelling early.
constexpr size_t kBroadcastBucketBytes = 250u * 1024 * 1024;
constexpr size_t kFirstBucketBytes = 1024 * 1024;

// Note [Compression hooks]
// The fp16 and bf16 hooks round each bucket to 16 bits, divide by the world size, sum across
// processes and write the result, rounded to 16 bits, back into the bucket. NCCL and the
// project's MPI group sum 16-bit tensors themselves; over Gloo the sum runs around a ring of the
// library's own (Note [Ring sums of 16-bit buckets]): Gloo's 16-bit sums are slow or refused,
// depending on the LibTorch release. Either way each process sends half the bytes of an fp32
// bucket, and every back-end and release gives the same bits with two processes (the exact
// 16-bit sum). (It derives from the plain interface: LibTorch does not export the result parser
// of the C++ hook template.)
// Note [Watched bucket allreduces]
// The reducer waits for its bucket allreduces inside the backward pass, where no library wait
// can take over: its allreduces go through a communication hook of ours, whose futures the
// collective watch follows (Note [The collective watch]), so that a backward pass on one
// process and, say, a barrier on another are named within seconds instead of hanging. Without a
// hook the reducer multiplies each gradient by 1 / (number of processes) as it copies it into
// its bucket and sums the buckets; the hook does the same multiplication on the bucket, then the
// sum, so the gradients are the same bits. Under NCCL (whose waits do not block the host) or
// with the watch turned off, the same hook only counts each bucket in the communication
// counters (Note [Counting the bytes a process sends]); sparse gradients keep the reducer's own
// path, uncounted.
class WatchedAllreduceHook final : public c10d::CommHookInterface {
 public:
  // `watch`: false where the watch cannot follow the waits (NCCL's do not block the host) or is
  // turned off; the hook then only counts the bucket in the communication counters.
  WatchedAllreduceHook(PartialState state, c10::intrusive_ptr<c10d::ProcessGroup> group, bool watch)
      : state_(std::move(state)), group_(std::move(group)), watch_(watch) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    auto& buffer = bucket.getBufferRef();
    buffer.mul_(1.0 / static_cast<double>(group_->getSize()));
    std::vector<at::Tensor> tensors{buffer};
    const auto ticket =
        detail::enter_collective(state_, "all_reduce", detail::all_reduce_sent(group_->getSize(), detail::bytes_of(buffer)));
    auto future = group_->allreduce(tensors)->getFuture();
    if (!watch_) return future;
    return detail::watch_future(state_, ticket, future, "DistributedDataParallel");
  }

  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensorVector()[0]; }

 private:
  PartialState state_;
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  bool watch_;
};

class CompressHook final : public c10d::CommHookInterface {
 public:
  CompressHook(const PartialState& state, c10::intrusive_ptr<c10d::ProcessGroup> group, at::ScalarType type,
               std::optional<at::ScalarType> wrapper = std::nullopt)
      : group_(std::move(group)), type_(type), wrapper_(wrapper) {
    if (group_->getBackendName() == "gloo") {
      ring_ = std::make_unique<detail::RingSum>(group_, state.impl()->rings_made.fetch_add(1), state.timeout(),
                                                "DistributedDataParallel");
    }
  }

  at::Tensor parseHookResult(const c10::IValue& result) override { return result.toTensor(); }

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    // comm_wrapper's cast first, then the hook's own (upstream wraps the hook in the wrapper).
    const at::Tensor& buffer = bucket.getBufferRef();
    const at::Tensor source = wrapper_ ? buffer.to(*wrapper_) : buffer;
    at::Tensor compressed;
    if (type_ == at::kHalf && source.is_same(buffer) && buffer.is_cpu() && buffer.scalar_type() == at::kFloat &&
        buffer.is_contiguous()) {
      // Into the bucket's own bytes, and back (Note [fp16 arithmetic of the compression hook]).
      compressed = detail::to_half_divided_in_place(buffer, group_->getSize());
    } else {
      compressed = source.to(type_).div_(group_->getSize());
    }
    compressed = compressed.contiguous().view({-1});
    c10::intrusive_ptr<c10::ivalue::Future> future;
    if (ring_) {
      // Gloo's messages move host memory: a device bucket is summed through a copy.
      future = ring_->sum(compressed.is_cpu() ? compressed : compressed.cpu());
    } else {
      detail::count_unwatched(detail::all_reduce_sent(group_->getSize(), detail::bytes_of(compressed)));
      std::vector<at::Tensor> tensors{compressed};
      future = group_->allreduce(tensors)->getFuture();
    }
    auto destination = bucket.getBufferRef();
    return future->then(
        [destination](c10::ivalue::Future& done) {
          const auto& value = done.value();
          const at::Tensor sum = value.isTensor() ? value.toTensor() : value.toTensorVector()[0];
          if (sum.scalar_type() == at::kHalf && sum.is_cpu() && sum.data_ptr() == destination.data_ptr()) {
            detail::widen_in_place(destination, sum);
          } else {
            destination.copy_(sum.view(destination.sizes()));
          }
          return c10::IValue(destination);
        },
        c10::TensorType::get());
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  at::ScalarType type_;
  std::optional<at::ScalarType> wrapper_;
  std::unique_ptr<detail::RingSum> ring_;  // over Gloo (Note [Ring sums of 16-bit buckets])
};

// Note [Static graph first iteration]
// With `static_graph`, the reducer records during the first backward pass which parameters get
// gradients and reduces everything at the end of that pass; PyTorch DDP routes the outputs
// through an autograd node whose backward queues that delayed reduction. This is that node.
struct StaticGraphSink : torch::autograd::Function<StaticGraphSink> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                std::shared_ptr<detail::DistributedDataParallelImpl> impl) {
    ctx->saved_data["impl"] = c10::IValue(static_cast<int64_t>(reinterpret_cast<intptr_t>(impl.get())));
    torch::autograd::variable_list outputs;
    outputs.reserve(inputs.size());
    for (const auto& t : inputs) outputs.push_back(t.clone());
    return outputs;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* impl = reinterpret_cast<detail::DistributedDataParallelImpl*>(
        static_cast<intptr_t>(ctx->saved_data["impl"].toInt()));
    torch::autograd::Engine::get_default_engine().queue_callback([impl] { impl->reducer->delay_all_reduce(); });
    grads.emplace_back();  // no gradient for the engine argument
    return grads;
  }
};

// One line per parameter and buffer: name, shape, dtype. Every process compares every process's
// description with process 0's, so all of them raise the same error naming the first difference.
void check_same_model(const PartialState& state, const torch::nn::Module& module) {
  std::ostringstream description;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    description << "parameter " << item.key() << " " << item.value().sizes() << " " << item.value().scalar_type()
                << (item.value().requires_grad() ? "" : " frozen") << "\n";
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    description << "buffer " << item.key() << " " << item.value().sizes() << " " << item.value().scalar_type() << "\n";
  }
  const std::string mine = description.str();
  auto all = detail::all_gather_bytes(state, std::vector<char>(mine.begin(), mine.end()), "DistributedDataParallel");
  auto lines = [](const std::vector<char>& bytes) {
    std::vector<std::string> out;
    std::istringstream in(std::string(bytes.begin(), bytes.end()));
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  };
  const auto reference = lines(all[0]);
  for (size_t rank = 1; rank < all.size(); ++rank) {
    const auto other = lines(all[rank]);
    for (size_t i = 0; i < std::max(reference.size(), other.size()); ++i) {
      const std::string a = i < reference.size() ? reference[i] : "(nothing)";
      const std::string b = i < other.size() ? other[i] : "(nothing)";
      TORCH_CHECK_VALUE(a == b, "[DistributedDataParallel] the model differs between processes: process 0 has ", a,
                        " where process ", rank, " has ", b);
    }
  }
}

std::vector<at::Tensor> trainable_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> params;
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    if (p.requires_grad()) params.push_back(p);
  }
  return params;
}

// Note [Join protocol]
// PyTorch DDP's answer to uneven inputs (its `_DDPJoinHook` and `Join`), over our Reducer. While
// `join` runs, every forward pass of a process that is still running first allreduces
// [1, grad enabled, grad enabled and synchronising] (asynchronously: it needs no answer), then,
// before its buffer broadcast, agrees with the others on a root for it by a MAX allreduce of the
// ranks still running. A process whose body returned loops instead: it allreduces [0, 0, 0] and
// reads how many processes are still running, whether they run with gradients (then they may
// rebuild their buckets: so does it) and whether their backward pass synchronises. If none is
// running, the loop ends; else it shadows one iteration: the buffer broadcast (offering -1 as
// root), then for a synchronising iteration one allreduce of zeros per gradient bucket, in the
// reducer's bucket order and through its comm hook (so compression hooks match), and the
// allreduce of the used-parameter map when the reducer runs one. The running processes divide
// by the full number of processes, as PyTorch's default `divide_by_initial_world_size=True`.
// After the loop a MAX allreduce names the last process to finish; every process takes its
// parameters and buffers (PyTorch's `_sync_final_model`).
// PyTorch sends the "still running" and "synchronise" flags as two allreduces; one carries both
// here, and it also says whether gradients are on, so that a finished process matches the bucket
// rebuild (a broadcast) of the others' first forward pass after their first backward pass.

// Note [Static graph and join]
// With `static_graph` the reducer reduces everything at the end of the first synchronising
// backward pass (used-parameter map first, then the buckets) and collects the bucket order in
// the second one. A finished process mirrors both. But a process that finished before the
// first synchronising iteration never recorded which parameters the graph uses, and its reducer
// cannot learn it afterwards: the final agreement carries that fact, and every process then
// refuses to train the model further (instead of one process failing and the others hanging).

// Waits for a collective of the join protocol with the state's timeout.
void wait_for(const detail::DistributedDataParallelImpl& impl, const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->wait(impl.timeout);
  } catch (const std::exception& e) {
    C10_THROW_ERROR(Error, c10::str("[DistributedDataParallel.join] a collective of the join protocol failed on "
                                    "process ", impl.process_group->getRank(), " of ", impl.process_group->getSize(),
                                    " (a peer died or did not arrive within ", impl.timeout.count() / 1000.0,
                                    "s): ", detail::error_text(e)));
  }
}

// An allreduce of the join protocol's small tensors, counted in the process's communication
// counters (its waits are the protocol's own).
c10::intrusive_ptr<c10d::Work> counted_allreduce(const detail::DistributedDataParallelImpl& impl,
                                                 std::vector<at::Tensor>& tensors,
                                                 const c10d::AllreduceOptions& options = {}) {
  uint64_t bytes = 0;
  for (const auto& t : tensors) bytes += detail::bytes_of(t);
  detail::count_unwatched(detail::all_reduce_sent(impl.process_group->getSize(), bytes));
  return impl.process_group->allreduce(tensors, options);
}

// MAX allreduce of `values` (ranks, or -1 for "not me").
std::vector<int64_t> max_over_processes(const detail::DistributedDataParallelImpl& impl, std::vector<int64_t> values) {
  std::vector<at::Tensor> tensors{at::tensor(values, at::kLong).to(impl.device)};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::MAX;
  wait_for(impl, counted_allreduce(impl, tensors, options));
  auto result = tensors[0].cpu();
  return std::vector<int64_t>(result.data_ptr<int64_t>(), result.data_ptr<int64_t>() + result.numel());
}

// The root of a buffer broadcast while joining: the highest rank still running.
int buffer_root(const detail::DistributedDataParallelImpl& impl, bool running) {
  const int64_t root = max_over_processes(impl, {running ? impl.process_group->getRank() : -1})[0];
  TORCH_INTERNAL_ASSERT(root >= 0, "[DistributedDataParallel.join] no running process offered its buffers");
  return static_cast<int>(root);
}

// c10d's coalesced broadcast of module states from `root`, counted in the process's communication
// counters (it is not watched: Note [The collective watch]).
void broadcast_states(const c10::intrusive_ptr<c10d::ProcessGroup>& group, std::vector<at::Tensor>& states, int root) {
  uint64_t bytes = 0;
  for (const auto& t : states) bytes += detail::bytes_of(t);
  detail::count_unwatched(detail::broadcast_sent(group->getSize(), group->getRank() == root, bytes));
  c10d::broadcast_coalesced(group, states, kBroadcastBucketBytes, root);
}

void sync_buffers_from(detail::DistributedDataParallelImpl& impl, int root) {
  torch::NoGradGuard no_grad;
  broadcast_states(impl.process_group, impl.buffers, root);
}

// An allreduce of a zero used-parameter map, matching the reducer's `all_reduce_local_used_map`.
void shadow_used_map(const detail::DistributedDataParallelImpl& impl) {
  std::vector<at::Tensor> tensors{at::zeros_like(impl.reducer->get_local_used_map_on_device())};
  wait_for(impl, counted_allreduce(impl, tensors));
}

// One iteration of the processes still running, seen from a finished one.
void shadow_iteration(detail::DistributedDataParallelImpl& impl, bool grad, bool sync, int64_t& shadowed_syncs) {
  if (grad) impl.reducer->rebuild_buckets();
  if (impl.require_forward_param_sync && impl.kwargs.broadcast_buffers && !impl.buffers.empty()) {
    sync_buffers_from(impl, buffer_root(impl, /*running=*/false));
  }
  impl.require_forward_param_sync = sync;
  if (!sync) return;
  const auto& k = impl.kwargs;
  const bool static_first = k.static_graph && impl.num_iterations + shadowed_syncs == 0;
  ++shadowed_syncs;
  if (static_first) shadow_used_map(impl);  // see Note [Static graph and join]
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> pending;
  for (auto& bucket : impl.reducer->get_grad_buckets(/*return_zero_tensors=*/true)) {
    pending.push_back(impl.reducer->run_comm_hook(bucket));
  }
  for (auto& future : pending) {
    future->wait();
    TORCH_CHECK(!future->hasError(), "[DistributedDataParallel.join] the gradient allreduce matching the running "
                                     "processes failed: ", future->tryRetrieveErrorMessage());
  }
  if (k.find_unused_parameters && !k.static_graph) shadow_used_map(impl);
  // The bucket order is collected by the first synchronising backward pass (the second with a
  // static graph); a finished process offers the natural order, rank 0's order wins anyway.
  if (!static_first) impl.reducer->push_rebuilt_params_for_all_indices();
}

}  // namespace

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> module, const PartialState& state,
                                                 const DistributedDataParallelKwargs& kwargs,
                                                 const ForwardOptions& forward)
    : impl_(std::make_shared<detail::DistributedDataParallelImpl>()) {
  TORCH_CHECK_VALUE(module != nullptr, "[DistributedDataParallel] expected a module, got null");
  TORCH_CHECK_VALUE(kwargs.bucket_cap_mb > 0, "[DistributedDataParallel] bucket_cap_mb must be positive, got ",
                    kwargs.bucket_cap_mb);
  TORCH_CHECK_VALUE(kwargs.dim == 0, "[DistributedDataParallel] dim ", kwargs.dim, " is not supported: each process ",
                    "drives one device, so no input is scattered along any dimension");
  TORCH_CHECK_VALUE(kwargs.comm_wrapper == DDPCommunicationHookType::kNo ||
                        kwargs.comm_hook != DDPCommunicationHookType::kNo,
                    "[DistributedDataParallel] comm_wrapper \"", to_string(kwargs.comm_wrapper),
                    "\" wraps comm_hook, which is \"no\": set comm_hook to \"fp16\" or \"bf16\"");
  if (kwargs.check_reduction) {
    detail::warn("accelerate.distributed",
                 "The `check_reduction` argument of DistributedDataParallel is deprecated (it does nothing); "
                 "please avoid using it",
                 {.once = true, .state = state});
  }
  impl_->module = std::move(module);
  impl_->kwargs = kwargs;
  impl_->forward = forward;
  impl_->device_type = state.device().type();
  impl_->state = state;
  if (!state.use_distributed()) return;

  auto group = detail::process_group(state, "DistributedDataParallel");
  impl_->process_group = group;
  impl_->timeout = state.timeout();
  auto params = trainable_parameters(*impl_->module);
  TORCH_CHECK_VALUE(!params.empty(),
                    "[DistributedDataParallel] the module has no parameter that requires a gradient: there is "
                    "nothing to synchronise (prepare it without gradient synchronisation, or unfreeze a parameter)");
  check_same_model(state, *impl_->module);
  impl_->device = params.front().device();

  // Every process starts from process 0's parameters and buffers.
  impl_->buffers = impl_->module->buffers(/*recurse=*/true);
  {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> states = impl_->module->parameters(/*recurse=*/true);
    states.insert(states.end(), impl_->buffers.begin(), impl_->buffers.end());
    if (!states.empty()) broadcast_states(group, states, 0);
  }

  // Note [First buckets as the rebuild makes them]
  // Without the search for unused parameters, the reducer rebuilds its buckets once, after the
  // first synchronising backward pass, in the order the gradients became ready. PyTorch DDP
  // starts from one bucket in registration order, so the first synchronised step of every
  // process lays the gradients out differently from every later one. On three or more
  // processes that changes the bits of the sum: Gloo's ring splits a bucket into chunks by
  // offset, and each chunk's sum starts on a different process. A run resumed from a checkpoint
  // then takes one step in the start layout where the uninterrupted run took it in the rebuilt
  // one, and does not end bit for bit where that run ends. So the start layout is the one the
  // rebuild makes when gradients arrive in reverse registration order, as in a feed-forward
  // model: the rebuild then changes nothing. (A model whose gradients arrive in another order
  // still gets its buckets rebuilt in that order.) With the search for unused parameters
  // nothing is rebuilt, and the buckets are PyTorch DDP's.
  const size_t cap = static_cast<size_t>(kwargs.bucket_cap_mb) * 1024 * 1024;
  const std::vector<size_t> limits{kFirstBucketBytes, cap};
  std::vector<bool> sparse(params.size(), false);
  std::vector<std::vector<size_t>> bucket_indices;
  std::vector<size_t> per_bucket_limits;
  if (kwargs.static_graph || !kwargs.find_unused_parameters) {
    const std::vector<at::Tensor> ready(params.rbegin(), params.rend());
    std::vector<int64_t> order(params.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(params.size() - 1 - i);
    std::tie(bucket_indices, per_bucket_limits) = c10d::compute_bucket_assignment_by_size(ready, limits, sparse, order);
  } else {
    std::tie(bucket_indices, per_bucket_limits) = c10d::compute_bucket_assignment_by_size(params, limits, sparse);
    std::reverse(bucket_indices.begin(), bucket_indices.end());
    std::reverse(per_bucket_limits.begin(), per_bucket_limits.end());
  }

  std::unordered_map<size_t, std::string> names;
  size_t index = 0;
  for (const auto& item : impl_->module->named_parameters(/*recurse=*/true)) {
    if (item.value().requires_grad()) names.emplace(index++, item.key());
  }
  impl_->reducer = detail::compat::make_reducer(params, std::move(bucket_indices), std::move(per_bucket_limits), group,
                                                sparse, static_cast<int64_t>(cap), kwargs.find_unused_parameters,
                                                kwargs.gradient_as_bucket_view, std::move(names),
                                                static_cast<int64_t>(kFirstBucketBytes));
  if (kwargs.static_graph) impl_->reducer->set_static_graph();
  std::optional<at::ScalarType> wrapper;
  if (kwargs.comm_wrapper == DDPCommunicationHookType::kFp16) wrapper = at::kHalf;
  if (kwargs.comm_wrapper == DDPCommunicationHookType::kBf16) wrapper = at::kBFloat16;
  switch (kwargs.comm_hook) {
    case DDPCommunicationHookType::kNo:
      // Sparse gradients keep the reducer's own path (hooks get their buckets dense).
      if (std::find(sparse.begin(), sparse.end(), true) == sparse.end()) {
        const bool watch = group->getBackendName() != "nccl" && state.impl()->check_delay.count() > 0;
        impl_->reducer->register_comm_hook(std::make_unique<WatchedAllreduceHook>(state, group, watch));
      }
      break;
    case DDPCommunicationHookType::kFp16:
      impl_->reducer->register_comm_hook(std::make_unique<CompressHook>(state, group, at::kHalf, wrapper));
      break;
    case DDPCommunicationHookType::kBf16:
      impl_->reducer->register_comm_hook(std::make_unique<CompressHook>(state, group, at::kBFloat16, wrapper));
      break;
  }
}

DistributedDataParallel DistributedDataParallel::fully_sharded(std::shared_ptr<torch::nn::Module> module,
                                                               const PartialState& state,
                                                               const FullyShardedDataParallelPlugin& plugin,
                                                               const ForwardOptions& forward, int dp_shard_size) {
  return detail::fully_sharded(std::move(module), state, detail::fsdp::resolve_fsdp_plugin(plugin, state.device()), forward,
                               dp_shard_size);
}

namespace detail {

DistributedDataParallel fully_sharded(std::shared_ptr<torch::nn::Module> module, const PartialState& state,
                                      fsdp::FsdpSettings settings, const ForwardOptions& forward, int dp_shard_size) {
  TORCH_CHECK_VALUE(module != nullptr, "[FullyShardedDataParallel] expected a module, got null");
  TORCH_CHECK_VALUE(dp_shard_size >= 0, "[FullyShardedDataParallel] dp_shard_size must not be negative, got ",
                    dp_shard_size);
  auto impl = std::make_shared<DistributedDataParallelImpl>();
  impl->module = module;
  impl->forward = forward;
  impl->device_type = state.device().type();
  impl->state = state;
  if (state.use_distributed()) {
    impl->process_group = process_group(state, "FullyShardedDataParallel");
    impl->timeout = state.timeout();
    impl->device = state.device();
    impl->fsdp = std::make_shared<fsdp::FsdpEngine>(std::move(module), state, std::move(settings), dp_shard_size);
  }
  return DistributedDataParallel(std::move(impl));
}

fsdp::FsdpEngine* fsdp_engine(const DistributedDataParallel& model) { return model.impl()->fsdp.get(); }
tensor_parallel::TensorParallelEngine* tensor_parallel_engine(const DistributedDataParallel& model) { return model.impl()->tp.get(); }
void attach_tensor_parallel(DistributedDataParallel& model, std::shared_ptr<tensor_parallel::TensorParallelEngine> engine) {
  model.impl()->tp = std::move(engine);
}

}  // namespace detail

DistributedDataParallel DistributedDataParallel::without_synchronisation(bool keep_mixed_precision) const {
  // A sharded model cannot run without its engine: its parameters hold shards between calls.
  if (impl_->fsdp) return *this;
  auto out = local(impl_->module, c10::Device(impl_->device_type),
                   keep_mixed_precision ? impl_->forward : ForwardOptions{});
  out.impl_->tp = impl_->tp;  // split layers keep communicating: their pieces alone are not the model
  return out;
}

DistributedDataParallel DistributedDataParallel::local(std::shared_ptr<torch::nn::Module> module, c10::Device device,
                                                       const ForwardOptions& forward) {
  TORCH_CHECK_VALUE(module != nullptr, "[DistributedDataParallel] expected a module, got null");
  auto impl = std::make_shared<detail::DistributedDataParallelImpl>();
  impl->module = std::move(module);
  impl->forward = forward;
  impl->device_type = device.type();
  return DistributedDataParallel(std::move(impl));
}

const std::shared_ptr<torch::nn::Module>& DistributedDataParallel::module() const { return impl_->module; }
bool DistributedDataParallel::is_distributed() const { return impl_->reducer != nullptr || impl_->fsdp != nullptr; }
bool DistributedDataParallel::is_fully_sharded() const { return impl_->fsdp != nullptr; }
bool DistributedDataParallel::is_tensor_parallel() const { return impl_->tp != nullptr; }
void DistributedDataParallel::check_tensor_parallel_pass(const std::vector<at::Tensor>& outputs) const {
  if (impl_->tp) impl_->tp->check_pass(outputs);
}
at::Tensor DistributedDataParallel::cast_forward_input(const at::Tensor& input) const {
  return impl_->fsdp ? impl_->fsdp->cast_forward_input(input) : input;
}

const DistributedDataParallelKwargs& DistributedDataParallel::kwargs() const { return impl_->kwargs; }
const ForwardOptions& DistributedDataParallel::forward_options() const { return impl_->forward; }
bool DistributedDataParallel::require_backward_grad_sync() const { return impl_->require_backward_grad_sync; }
void DistributedDataParallel::set_require_backward_grad_sync(bool sync) const {
  impl_->require_backward_grad_sync = sync;
  if (impl_->fsdp) impl_->fsdp->set_require_backward_grad_sync(sync);
}
bool DistributedDataParallel::require_forward_param_sync() const { return impl_->require_forward_param_sync; }
void DistributedDataParallel::set_require_forward_param_sync(bool sync) const {
  impl_->require_forward_param_sync = sync;
}
int64_t DistributedDataParallel::num_iterations() const { return impl_->num_iterations; }
bool DistributedDataParallel::join_enabled() const { return impl_->join_enabled; }

DistributedDataParallel::JoinScope::JoinScope(const DistributedDataParallel& ddp) : ddp_(ddp) {
  TORCH_CHECK(!ddp_.impl()->join_enabled, "[DistributedDataParallel.join] the model is already inside join");
  TORCH_CHECK_VALUE(!ddp_.impl()->fsdp, "[DistributedDataParallel.join] joining uneven inputs is not supported for "
                                        "fully sharded models yet");
  ddp_.impl()->join_enabled = true;
}

DistributedDataParallel::JoinScope::~JoinScope() {
  ddp_.impl()->join_enabled = false;
  ddp_.impl()->running_notice.reset();
}

void DistributedDataParallel::join_until_all_finished() const {
  auto& impl = *impl_;
  if (impl.running_notice) wait_for(impl, impl.running_notice);
  constexpr int64_t kSkewWarning = 1000;
  bool last_to_finish = true;
  int64_t shadowed_syncs = 0;
  for (int64_t round = 0;; ++round) {
    std::vector<at::Tensor> flags{at::zeros({3}, at::TensorOptions().dtype(at::kFloat).device(impl.device))};
    wait_for(impl, counted_allreduce(impl, flags));
    const auto running = flags[0].cpu();
    const float* f = running.data_ptr<float>();
    if (f[0] == 0) break;
    last_to_finish = false;
    if (round == kSkewWarning) {
      detail::warn("accelerate.distributed",
                   c10::str("[DistributedDataParallel.join] process ", impl.process_group->getRank(),
                            " has run out of inputs ", kSkewWarning,
                            " iterations before others: such a skew slows training down"),
                   {.every_process = true, .state = impl.state});
    }
    shadow_iteration(impl, f[1] > 0, f[2] > 0, shadowed_syncs);
  }

  const int rank = impl.process_group->getRank();
  const bool unrecorded = impl.kwargs.static_graph && impl.num_iterations == 0 && shadowed_syncs > 0;
  const auto agreed = max_over_processes(impl, {last_to_finish ? rank : -1, unrecorded ? rank : -1});
  TORCH_INTERNAL_ASSERT(agreed[0] >= 0, "[DistributedDataParallel.join] no process finished last");
  if (agreed[1] >= 0) impl.unrecorded_graph_process = static_cast<int>(agreed[1]);
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> states = impl.module->parameters(/*recurse=*/true);
  auto buffers = impl.module->buffers(/*recurse=*/true);
  states.insert(states.end(), buffers.begin(), buffers.end());
  broadcast_states(impl.process_group, states, static_cast<int>(agreed[0]));
}

void DistributedDataParallel::prepare_for_backward_now() const {
  if (impl_->reducer) impl_->reducer->prepare_for_backward({});
}

// Note [Units called without their hook]
// LibTorch cannot intercept `child(x)`: a unit's hook runs only through `accelerate::forward`, a
// Sequential, or a member declared with a holder of accelerate/nn.h. A unit called any other way
// computes with what its parameters hold at rest, this process's shard, which nearly always
// ends in a shape error deep inside LibTorch ("mat1 and mat2 shapes cannot be multiplied"). The
// engine counts the prepared model's forward passes and each unit records the pass its hook last
// ran in; when the module's forward throws, the error is raised again with the units whose hook
// has not run in this pass and the fix. (A unit that got its gradient without its hook is
// refused in the backward pass, Note [Fully sharded engine].)
void DistributedDataParallel::rethrow_forward_error() const {
  std::vector<std::string> units;
  if (impl_->fsdp) units = impl_->fsdp->units_without_hook();
  if (impl_->tp) {
    for (auto& name : impl_->tp->modules_without_hook()) units.push_back(std::move(name));
  }
  if (units.empty()) throw;
  std::string error;
  try {
    throw;
  } catch (const c10::Error& e) {
    error = e.what_without_backtrace();
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::string names;
  for (size_t i = 0; i < units.size() && i < 8; ++i) names += (i ? ", " : "") + units[i];
  if (units.size() > 8) names += ", … (" + std::to_string(units.size()) + " in all)";
  C10_THROW_ERROR(Error, c10::str("[", impl_->fsdp ? "FullyShardedDataParallel" : "TensorParallel",
              "] the model's forward pass failed while ", units.size(), " wrapped unit(s) had not run their hook in it: ",
              names, ". A unit's parameters hold only this process's shard until its hook gathers them (or, split by "
              "tensor parallelism, communicates around it), and the hook runs only when the unit is called through "
              "accelerate::forward(child, x), from a torch::nn::Sequential, or through a member declared with a "
              "holder of accelerate/nn.h (accelerate::nn::Linear, accelerate::nn::Hooked<M>); a direct call "
              "(child(x), child->forward(x)) or a functional use of its weights skips it. Declare the unit's "
              "member with those holders, or choose units whose callers use them. The error was: ", error));
}

DistributedDataParallel::ForwardScope::ForwardScope(const DistributedDataParallel& ddp) {
  auto& impl = *ddp.impl();
  if (impl.tp) impl.tp->begin_pass();
  if (impl.fsdp) impl.fsdp->root_pre_forward();
  if (impl.reducer) {
    const bool grad = at::GradMode::is_enabled();
    const bool sync = grad && impl.require_backward_grad_sync;
    if (sync) {
      TORCH_CHECK(impl.unrecorded_graph_process < 0, "[DistributedDataParallel] process ",
                  impl.unrecorded_graph_process, " ran out of inputs inside join before the first synchronising "
                  "iteration of this static_graph model, so its reducer never recorded the graph and the model "
                  "cannot synchronise gradients any more; prepare the module again, or give every process at "
                  "least one batch");
      ++impl.num_iterations;
      impl.reducer->prepare_for_forward();
    }
    if (impl.join_enabled) {  // see Note [Join protocol]
      std::vector<at::Tensor> flags{at::tensor({1.0f, grad ? 1.0f : 0.0f, sync ? 1.0f : 0.0f}).to(impl.device)};
      impl.running_notice = counted_allreduce(impl, flags);
    }
    // Once, after the first synchronised pass: buckets follow the order gradients arrived in.
    if (grad) impl.reducer->rebuild_buckets();
    if (impl.require_forward_param_sync && impl.kwargs.broadcast_buffers && !impl.buffers.empty()) {
      sync_buffers_from(impl, impl.join_enabled ? buffer_root(impl, /*running=*/true) : 0);
    }
  }
  if (impl.forward.mixed_precision != PrecisionType::kNo) {
    autocast_.emplace(impl.device_type, impl.forward.mixed_precision, impl.forward.autocast);
  }
}

bool DistributedDataParallel::wants_outputs() const {
  if (impl_->fsdp) return true;
  const auto& k = impl_->kwargs;
  return (k.find_unused_parameters && !k.static_graph) || (k.static_graph && impl_->num_iterations == 1);
}

std::vector<at::Tensor> DistributedDataParallel::after_forward(const std::vector<at::Tensor>& outputs) const {
  auto& impl = *impl_;
  if (impl.fsdp) {
    impl.fsdp->root_post_forward(outputs);
    return {};
  }
  if (!(at::GradMode::is_enabled() && impl.require_backward_grad_sync)) {
    impl.require_forward_param_sync = false;
    return {};
  }
  impl.require_forward_param_sync = true;
  const auto& k = impl.kwargs;
  impl.reducer->prepare_for_backward(k.find_unused_parameters && !k.static_graph ? outputs
                                                                                 : std::vector<at::Tensor>{});
  if (k.static_graph && impl.num_iterations == 1) {
    std::vector<at::Tensor> differentiable;
    for (const auto& t : outputs) {
      if (t.requires_grad()) differentiable.push_back(t);
    }
    TORCH_CHECK_VALUE(!differentiable.empty(), "[DistributedDataParallel] static_graph needs the first forward pass to "
                                               "return at least one tensor that requires a gradient");
    return detail::apply_function<StaticGraphSink>(at::TensorList(outputs), impl_);
  }
  return {};
}

}  // namespace accelerate
