// The Accelerator; see include/accelerate/accelerator.h.
#include "accelerate/accelerator.h"

#include "accelerate/big_modeling.h"

#include "accelerate/memory_utils.h"
#include "accelerate/utils/environment.h"
#include "accelerate/nn.h"
#include "accelerate/parallelism_config.h"
#include "accelerator_impl.h"
#include "tensor_parallel/engine.h"
#include "distributed_impl.h"
#include "fsdp/engine.h"
#include "grad_scaler_impl.h"
#include "detail/collective_watch.h"
#include "detail/topology.h"
#include "tracking_impl.h"
#include "detail/warn.h"

#include <c10/util/Exception.h>
#include <torch/nn/utils/clip_grad.h>

#include <algorithm>
#include <mutex>

namespace accelerate {

namespace {

AcceleratorState make_state(const AcceleratorOptions& options) {
  AcceleratorStateOptions state_options;
  state_options.mixed_precision = options.mixed_precision;
  if (options.standalone_state) {
    state_options.partial = *options.standalone_state;
    state_options.partial.cpu = state_options.partial.cpu || options.cpu;
    if (!options.init_process_group_kwargs.backend.empty() || options.init_process_group_kwargs.timeout) {
      state_options.partial.init_kwargs = options.init_process_group_kwargs;
    }
    return AcceleratorState::standalone(state_options);
  }
  state_options.partial.cpu = options.cpu;
  state_options.partial.init_kwargs = options.init_process_group_kwargs;
  return AcceleratorState(state_options);
}

// Upstream reads ACCELERATE_GRADIENT_ACCUMULATION_STEPS over the argument when it is set.
GradientAccumulationPlugin accumulation_plugin(const AcceleratorOptions& options) {
  TORCH_CHECK_VALUE(!(options.gradient_accumulation_plugin && options.gradient_accumulation_steps),
                    "[Accelerator] pass either gradient_accumulation_steps or gradient_accumulation_plugin, not both "
                    "(set num_steps in the plugin)");
  if (options.gradient_accumulation_plugin) return *options.gradient_accumulation_plugin;
  GradientAccumulationPlugin plugin;
  plugin.num_steps =
      get_int_from_env({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS"}, options.gradient_accumulation_steps.value_or(1));
  TORCH_CHECK_VALUE(plugin.num_steps >= 1, "[Accelerator] gradient_accumulation_steps must be at least 1, got ",
                    plugin.num_steps);
  return plugin;
}

void check_options(const AcceleratorOptions& options) {
  for (const auto& type : options.rng_types) {
    TORCH_CHECK_VALUE(type == "torch" || type == "cuda" || type == "generator", "[Accelerator] rng_types: unknown "
                                                                               "generator '", type,
                      "'; expected 'torch', 'cuda' or 'generator'");
  }
}

// The parallelism_config (given, or made from PARALLELISM_CONFIG_* variables), resolved once and
// checked on every process; nothing without one.
std::optional<ParallelismConfig> parallelism_of(const AcceleratorOptions& options, int num_processes) {
  std::optional<ParallelismConfig> config = options.parallelism_config;
  if (!config && (get_env("PARALLELISM_CONFIG_DP_REPLICATE_SIZE") || get_env("PARALLELISM_CONFIG_DP_SHARD_SIZE") ||
                  get_env("PARALLELISM_CONFIG_TP_SIZE") || get_env("PARALLELISM_CONFIG_CP_SIZE"))) {
    config = ParallelismConfig{};
  }
  if (!config) return std::nullopt;
  ParallelismConfig resolved = config->resolved(num_processes);
  if (resolved.tp_enabled()) {
    TORCH_CHECK_VALUE(!options.tp_handler.enable_async_tp, "[Accelerator] parallelism_config: enable_async_tp "
                      "overlaps collectives with matrix products through CUDA's symmetric memory, which LibTorch does "
                      "not offer; leave it false");
  }
  return resolved;
}

// Whether prepared models are sharded, and with which plugin: the given one, or the defaults
// under ACCELERATE_USE_FSDP, or under a parallelism_config whose dp_shard_size is above 1.
// `dp_shard_size` receives the size of a parallelism_config's shard groups (0 without one).
std::optional<FullyShardedDataParallelPlugin> fsdp_plugin_of(const AcceleratorOptions& options,
                                                             const std::optional<ParallelismConfig>& sizes,
                                                             int num_processes, int& dp_shard_size) {
  dp_shard_size = 0;
  std::optional<FullyShardedDataParallelPlugin> plugin = options.fsdp_plugin;
  if (!plugin) {
    if (auto use = get_env("ACCELERATE_USE_FSDP"); use && str_to_bool(*use)) plugin = FullyShardedDataParallelPlugin{};
  }
  if (!sizes) return plugin;
  // Models are sharded over dp_shard x cp (upstream's "dp_shard_cp"); with dp_shard 1 and cp above
  // 1 only when a plugin asks for it, else gradients are averaged over dp_cp as by DDP.
  const int shard = *sizes->dp_shard_size, over = shard * *sizes->cp_size;
  if (shard > 1 && !plugin) plugin = FullyShardedDataParallelPlugin{};
  TORCH_CHECK_VALUE(over > 1 || !options.fsdp_plugin || num_processes == 1,
                    "[Accelerator] parallelism_config: dp_shard_size and cp_size are 1, so nothing is sharded, but an "
                    "fsdp_plugin was given");
  if (over == 1) plugin.reset();
  if (plugin) dp_shard_size = over;
  return plugin;
}

}  // namespace

// ---- SyncGuard ------------------------------------------------------------------------------

SyncGuard::SyncGuard(std::vector<DistributedDataParallel> models, std::optional<bool> sync, bool trigger_now) {
  if (!sync) return;
  saved_.reserve(models.size());
  for (auto& model : models) {
    saved_.push_back({model, model.require_backward_grad_sync(), model.require_forward_param_sync()});
    model.set_require_backward_grad_sync(*sync);
    if (trigger_now) {
      model.set_require_forward_param_sync(true);
      model.prepare_for_backward_now();
    }
  }
}

SyncGuard::~SyncGuard() {
  for (auto& s : saved_) {
    s.model.set_require_backward_grad_sync(s.backward_sync);
    s.model.set_require_forward_param_sync(s.forward_sync);
  }
}

// ---- Accelerator ----------------------------------------------------------------------------

Accelerator::Accelerator(const AcceleratorOptions& options)
    : state_((check_options(options), make_state(options))),
      gradient_state_(options.standalone_state ? GradientState::standalone(accumulation_plugin(options))
                                               : GradientState(accumulation_plugin(options))),
      impl_(std::make_shared<detail::AcceleratorImpl>()) {
  impl_->options = options;
  impl_->standalone = options.standalone_state.has_value();
  impl_->project = options.project_config;
  impl_->iteration_chosen = impl_->project.iteration != 0;
  impl_->project.set_directories(impl_->project.project_dir.empty() ? options.project_dir
                                                                    : impl_->project.project_dir);
  impl_->log_with = detail::filter_trackers(options.log_with, impl_->project.logging_dir, "Accelerator");
  impl_->parallelism = parallelism_of(options, state_.num_processes());
  impl_->fsdp = fsdp_plugin_of(options, impl_->parallelism, state_.num_processes(), impl_->dp_shard_size);
  if (impl_->parallelism) {
    // Every group of the mesh is made now, at the same point on every process.
    impl_->mesh = impl_->parallelism->build_device_mesh(partial());
    impl_->tp_size = *impl_->parallelism->tp_size;
  }
  // As upstream's set_mixed_precision: a plugin without a policy computes, reduces and keeps its
  // buffers in the Accelerator's mixed precision (its autocast stays on as well).
  if (impl_->fsdp && state_.mixed_precision() != PrecisionType::kNo) {
    auto& policy = impl_->fsdp->mixed_precision_policy;
    if (policy.param_dtype.empty() && policy.reduce_dtype.empty() && policy.buffer_dtype.empty()) {
      const std::string dtype = to_string(state_.mixed_precision());
      policy = FsdpMixedPrecisionPolicy{dtype, dtype, dtype};
    }
  }
  // Resolved once (refusing bad settings now); prepare and every later question read the result.
  if (impl_->fsdp) impl_->fsdp_settings = detail::fsdp::resolve_fsdp_plugin(*impl_->fsdp, state_.device());
  if (state_.mixed_precision() == PrecisionType::kFp16 && state_.device().is_cuda()) {
    impl_->scaler = get_grad_scaler(distributed_type(), options.scaler_kwargs);
    if (impl_->fsdp) detail::share_inf_checks(*impl_->scaler, partial());
  }
  if (options.preemption) install_preemption();
}

void Accelerator::set_gradient_accumulation_steps(int steps) const {
  auto plugin = gradient_state_.plugin();
  plugin.num_steps = steps;
  gradient_state_.set_plugin(plugin);
}

bool Accelerator::optimizer_step_was_skipped() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return std::any_of(impl_->optimizers.begin(), impl_->optimizers.end(),
                     [](const AcceleratedOptimizer& o) { return o.step_was_skipped(); });
}

std::optional<FullyShardedDataParallelPlugin> Accelerator::fsdp_plugin() const { return impl_->fsdp; }
std::optional<DeviceMesh> Accelerator::torch_device_mesh() const { return impl_->mesh; }
std::optional<ParallelismConfig> Accelerator::parallelism_config() const { return impl_->parallelism; }
const PartialState& Accelerator::data_parallel_state() const {
  return impl_->parallelism && impl_->parallelism->non_data_parallel_size() > 1 ? impl_->mesh->get_group("dp")
                                                                                : partial();
}
const PartialState& Accelerator::gradient_sync_state() const {
  return impl_->parallelism && impl_->parallelism->non_data_parallel_size() > 1 ? impl_->mesh->get_group("dp_cp")
                                                                                : partial();
}

ContextParallel Accelerator::maybe_context_parallel(const std::vector<at::Tensor>& buffers,
                                                    const std::vector<int64_t>& buffer_seq_dims,
                                                    const std::vector<at::Tensor>& no_restore_buffers) const {
  if (!impl_->parallelism || !impl_->parallelism->cp_enabled()) {
    detail::warn("accelerate.accelerator", "Context parallel training is not enabled. This scope will have no effect. "
                 "To enable it, set parallelism_config.cp_size above 1 in the Accelerator's options.",
                 {.once = true, .state = partial()});
    return ContextParallel();
  }
  return ContextParallel(impl_->mesh->get_group("cp"), buffers, buffer_seq_dims, no_restore_buffers,
                         impl_->parallelism->cp_handler.cp_comm_strategy);
}
DistributedType Accelerator::distributed_type() const {
  return impl_->fsdp && state_.distributed_type() != DistributedType::kNo ? DistributedType::kFsdp
                                                                          : state_.distributed_type();
}
bool Accelerator::is_fsdp2() const {
  return impl_->fsdp_settings && impl_->fsdp_settings->fsdp_version == 2;
}

bool Accelerator::split_batches() const { return impl_->options.dataloader_config.split_batches; }
bool Accelerator::even_batches() const { return impl_->options.dataloader_config.even_batches; }
bool Accelerator::device_placement() const { return impl_->options.device_placement; }
bool Accelerator::step_scheduler_with_optimizer() const { return impl_->options.step_scheduler_with_optimizer; }
int64_t Accelerator::step() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->step;
}
std::string Accelerator::project_dir() const { return impl_->project.project_dir; }
std::string Accelerator::logging_dir() const { return impl_->project.logging_dir; }
ProjectConfiguration Accelerator::project_configuration() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->project;
}
std::optional<GradScaler> Accelerator::scaler() const { return impl_->scaler; }

// ---- preparation ----------------------------------------------------------------------------

namespace {

// Note [Prepare after reset]
// An accelerator over the process-wide state keeps a handle to it. After
// `AcceleratorState::reset()` / `PartialState::reset()` that state is no longer the process's
// (its process group may be gone), so preparing objects with it is refused instead of
// silently building on a stale state.
void check_state_current(const AcceleratorState& state, bool standalone, const char* api) {
  if (standalone) return;
  const bool current = PartialState::initialized() && PartialState().impl() == state.partial_state().impl();
  TORCH_CHECK(current, "[", api, "] the process-wide state was reset after this Accelerator was created "
                       "(AcceleratorState::reset or PartialState::reset); create a new Accelerator");
}

}  // namespace

bool Accelerator::verify_device_map(const torch::nn::Module& model) const {
  auto split = [](const torch::nn::Module& module) {
    const auto map = hf_device_map(module);
    return map.has_value() && map->size() > 1;
  };
  if (split(model)) return true;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (split(*item.value())) return true;
  }
  return false;
}

std::shared_ptr<detail::tensor_parallel::TensorParallelEngine> Accelerator::apply_tensor_parallelism(
    const std::shared_ptr<torch::nn::Module>& module) const {
  auto plan = impl_->options.tp_handler.tp_plan;
  if (plan.empty()) {
    if (const auto* planned = dynamic_cast<const nn::TensorParallelPlanned*>(module.get())) plan = planned->tp_plan();
  }
  TORCH_CHECK_VALUE(!plan.empty(), "[Accelerator.prepare_model] tp_size is ", impl_->tp_size, ", but the model has no "
                    "tensor-parallel plan: give one in AcceleratorOptions::tp_handler (TorchTensorParallelConfig::tp_plan) "
                    "or derive the model's class from accelerate::nn::TensorParallelPlanned");
  return std::make_shared<detail::tensor_parallel::TensorParallelEngine>(
      module, impl_->mesh->get_group("tp"), detail::tensor_parallel::resolve_tp_plan(*module, plan));
}

DistributedDataParallel Accelerator::prepare_module(const std::shared_ptr<torch::nn::Module>& module,
                                                    std::optional<bool> device_placement,
                                                    bool evaluation_mode) const {
  check_state_current(state_, impl_->standalone, "Accelerator.prepare_model");
  TORCH_CHECK_VALUE(module != nullptr, "[Accelerator.prepare_model] expected a module, got null");
  detail::CallingApi calling("prepare");
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    for (const auto& prepared : impl_->models) {
      if (prepared.module() == module) return prepared;
    }
  }
  // A model dispatched over several devices stays where its device map put it, and cannot be
  // replicated by several processes (each would need every device of the map).
  const bool split = verify_device_map(*module);
  TORCH_CHECK_VALUE(!split || distributed_type() == DistributedType::kNo ||
                        get_env("ACCELERATE_BYPASS_DEVICE_MAP").value_or("false") == "true",
                    "[Accelerator.prepare_model] you can't train a model that has been dispatched over several devices "
                    "(a device map such as device_map=\"auto\") in any distributed mode; run it with one process "
                    "(--num_processes 1), or set ACCELERATE_BYPASS_DEVICE_MAP=true to prepare it anyway");
  // A model on the meta device (cpu_ram_efficient_loading) is materialised by the sharded engine.
  const auto on_meta = [&] {
    for (const auto& p : module->parameters()) {
      if (p.is_meta()) return true;
    }
    return false;
  };
  const bool materialised_later = impl_->fsdp && use_distributed() && !evaluation_mode && on_meta();
  if (impl_->fsdp && !evaluation_mode) {
    // Upstream's check that the classes to wrap occur in the model, before anything changes.
    auto plugin = *impl_->fsdp;
    plugin.set_auto_wrap_policy(*module);
  }
  if (device_placement.value_or(impl_->options.device_placement) && !split && !materialised_later) {
    module->to(state_.device());
  }
  ForwardOptions forward{state_.mixed_precision(), impl_->options.autocast_kwargs};
  // Tensor parallelism first (the layers of the plan keep their pieces), then data parallelism
  // over the processes that share a tensor-parallel rank.
  std::shared_ptr<detail::tensor_parallel::TensorParallelEngine> tensor_parallel;
  if (impl_->tp_size > 1) tensor_parallel = apply_tensor_parallelism(module);
  const PartialState& data = gradient_sync_state();
  // Evaluation-only models are not synchronised: a one-process engine does no communication.
  std::optional<detail::fsdp::FsdpSettings> fsdp;
  if (impl_->fsdp) {
    fsdp = *impl_->fsdp_settings;
    if (tensor_parallel) {  // the size-based policy counts a split parameter whole, as upstream a DTensor
      fsdp->param_numel = [split = tensor_parallel.get()](const at::Tensor& p) {
        return split->is_sharded(p) ? p.numel() * split->group().num_processes() : p.numel();
      };
    }
  }
  DistributedDataParallel ddp = evaluation_mode ? DistributedDataParallel::local(module, state_.device(), forward)
                                : fsdp ? detail::fully_sharded(module, data, *fsdp, forward, impl_->dp_shard_size)
                                       : DistributedDataParallel(module, data, impl_->options.ddp_kwargs, forward);
  if (tensor_parallel) detail::attach_tensor_parallel(ddp, tensor_parallel);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->models.push_back(ddp);
  return ddp;
}

AcceleratedOptimizer Accelerator::prepare_optimizer(const std::shared_ptr<torch::optim::Optimizer>& optimizer,
                                                    std::optional<bool> device_placement) const {
  check_state_current(state_, impl_->standalone, "Accelerator.prepare_optimizer");
  TORCH_CHECK_VALUE(optimizer != nullptr, "[Accelerator.prepare_optimizer] expected an optimizer, got null");
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (const auto& prepared : impl_->optimizers) {
    if (prepared.optimizer() == optimizer) return prepared;
  }
  // A fully sharded model's parameters hold this process's shards after prepare, so state made
  // for the whole parameters (an optimizer stepped or loaded before prepare) no longer fits them.
  TORCH_CHECK_VALUE(distributed_type() != DistributedType::kFsdp || optimizer->state().empty(),
                    "[Accelerator.prepare_optimizer] the optimizer already holds state for ", optimizer->state().size(),
                    " parameter(s): it stepped, or loaded a state dict, before prepare. Under fully sharded data "
                    "parallelism prepare replaces each parameter's data with this process's shard, which that state "
                    "does not fit: create the optimizer's state after prepare (step it, or restore a checkpoint with "
                    "load_state)");
  std::optional<c10::Device> device;
  if (device_placement.value_or(impl_->options.device_placement)) device = state_.device();
  AcceleratedOptimizer wrapped(optimizer, gradient_state_, impl_->scaler, device);
  impl_->optimizers.push_back(wrapped);
  return wrapped;
}

AcceleratedScheduler Accelerator::prepare_scheduler(const std::shared_ptr<LRScheduler>& scheduler) const {
  check_state_current(state_, impl_->standalone, "Accelerator.prepare_scheduler");
  TORCH_CHECK_VALUE(scheduler != nullptr, "[Accelerator.prepare_scheduler] expected a scheduler, got null");
  std::lock_guard<std::mutex> lock(impl_->mutex);
  for (const auto& prepared : impl_->schedulers) {
    if (prepared.scheduler() == scheduler) return prepared;
  }
  std::vector<AcceleratedOptimizer> followed;
  for (const auto& optimizer : impl_->optimizers) {
    if (optimizer.optimizer() == scheduler->optimizer()) followed = {optimizer};
  }
  if (followed.empty()) followed = impl_->optimizers;
  AcceleratedSchedulerOptions options;
  options.step_with_optimizer = impl_->options.step_scheduler_with_optimizer;
  options.split_batches = impl_->options.dataloader_config.split_batches;
  options.num_processes = state_.num_processes();
  AcceleratedScheduler wrapped(scheduler, std::move(followed), gradient_state_, options);
  impl_->schedulers.push_back(wrapped);
  return wrapped;
}

DataLoader Accelerator::prepare_data_loader(const DataLoader& loader, std::optional<bool> device_placement) const {
  check_state_current(state_, impl_->standalone, "Accelerator.prepare_data_loader");
  if (loader.prepared()) return loader;
  auto options = PrepareDataLoaderOptions::from_config(impl_->options.dataloader_config);
  options.put_on_device = device_placement.value_or(impl_->options.device_placement);
  options.rng_types = impl_->options.rng_types;
  options.device = state_.device();
  DataLoader prepared = accelerate::prepare_data_loader(loader, data_parallel_state(), gradient_state_, options);
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->data_loaders.push_back(prepared);
  return prepared;
}

// ---- training step --------------------------------------------------------------------------

void Accelerator::backward(const at::Tensor& loss, std::optional<bool> retain_graph, bool create_graph) const {
  TORCH_CHECK_VALUE(loss.defined(), "[Accelerator.backward] expected a loss tensor, got an undefined tensor");
  detail::CallingApi calling("backward");
  // Dividing by 1 would change nothing but add an autograd node to every step.
  const int steps = gradient_accumulation_steps();
  at::Tensor scaled = steps == 1 ? loss : loss / steps;
  if (impl_->scaler) scaled = impl_->scaler->scale(scaled);
  scaled.backward({}, retain_graph ? c10::optional<bool>(*retain_graph) : c10::nullopt, create_graph);
}

std::optional<bool> Accelerator::begin_accumulation_step() const {
  bool sync = false;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (gradient_state_.sync_with_dataloader() && gradient_state_.end_of_dataloader()) {
      impl_->step = 0;
      sync = true;
    } else {
      impl_->step += 1;
      sync = impl_->step % gradient_state_.num_steps() == 0;
    }
  }
  gradient_state_.set_sync_gradients(sync);
  // Models keep synchronising on steps that must (or with sync_each_batch on several processes).
  const bool allow = sync || (use_distributed() && gradient_state_.sync_each_batch());
  if (allow) return std::nullopt;
  return false;
}

AutocastGuard Accelerator::autocast(const std::optional<AutocastKwargs>& kwargs) const {
  return AutocastGuard(device().type(), state_.mixed_precision(), kwargs.value_or(impl_->options.autocast_kwargs));
}

void Accelerator::unscale_gradients(const std::optional<AcceleratedOptimizer>& optimizer) const {
  if (!impl_->scaler) return;
  std::vector<AcceleratedOptimizer> targets;
  if (optimizer) {
    targets.push_back(*optimizer);
  } else {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    targets = impl_->optimizers;
  }
  for (auto& target : targets) {
    if (!impl_->scaler->is_unscaled(*target)) impl_->scaler->unscale_(*target);
  }
}

double Accelerator::clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                                    double norm_type) const {
  TORCH_CHECK_VALUE(max_norm >= 0, "[Accelerator.clip_grad_norm_] max_norm must not be negative, got ", max_norm);
  detail::CallingApi calling("clip_grad_norm_");
  unscale_gradients();
  detail::fsdp::FsdpEngine* sharded = nullptr;
  detail::tensor_parallel::TensorParallelEngine* split = nullptr;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    for (const auto& model : impl_->models) {
      if (!sharded) sharded = detail::fsdp_engine(model);
      if (!split) split = detail::tensor_parallel_engine(model);
    }
  }
  if (!sharded && !split) return torch::nn::utils::clip_grad_norm_(parameters, max_norm, norm_type);
  // The norm over every process's shards and pieces (upstream: FSDP's own clip_grad_norm_, and
  // DTensor's norm over the mesh under tensor parallelism).
  const auto norm_of = [&](const std::vector<at::Tensor>& subset) -> double {
    if (sharded) return sharded->total_grad_norm(subset, norm_type);
    std::vector<at::Tensor> norms;
    for (const auto& p : subset) {
      if (p.grad().defined()) norms.push_back(p.grad().detach().to(at::kDouble).norm(norm_type));
    }
    return norms.empty() ? 0.0 : at::stack(norms).norm(norm_type).item<double>();
  };
  const double total = split ? split->total_grad_norm(parameters, norm_type, norm_of) : norm_of(parameters);
  const double coefficient = max_norm / (total + 1e-6);
  if (coefficient < 1) {
    torch::NoGradGuard no_grad;
    for (const auto& p : parameters) {
      if (p.grad().defined()) p.grad().mul_(coefficient);
    }
  }
  return total;
}

void Accelerator::clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value) const {
  TORCH_CHECK_VALUE(clip_value >= 0, "[Accelerator.clip_grad_value_] clip_value must not be negative, got ",
                    clip_value);
  unscale_gradients();
  torch::nn::utils::clip_grad_value_(parameters, clip_value);
}

void Accelerator::free_memory() const {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->models.clear();
    impl_->optimizers.clear();
    impl_->schedulers.clear();
    impl_->data_loaders.clear();
    impl_->step = 0;
  }
  clear_device_cache();
}

const ProfileKwargs& Accelerator::profile_kwargs() const { return impl_->options.profile_kwargs; }
// ---- uneven inputs ----------------------------------------------------------------------------

void Accelerator::join_uneven_inputs_erased(std::vector<DistributedDataParallel> joinables,
                                            const std::function<void()>& fn, std::optional<bool> even_batches) const {
  if (!use_distributed()) {
    if (distributed_type() != DistributedType::kNo) {
      detail::warn("accelerate.accelerator",
                   "[Accelerator.join_uneven_inputs] joining uneven inputs needs several processes: with one it "
                   "has no effect",
                   {.once = true, .state = state().partial_state()});
    }
    fn();
    return;
  }
  if (distributed_type() == DistributedType::kFsdp) {
    // As upstream: PyTorch's Join needs DDP models, so under FSDP joining is skipped with a warning.
    detail::warn("accelerate.accelerator",
                 "[Accelerator.join_uneven_inputs] joining uneven inputs is only supported for DDP models: with "
                 "fully sharded models it has no effect, so every process must run as many batches (even_batches)",
                 {.once = true, .state = state().partial_state()});
    fn();
    return;
  }

  // Models prepared for evaluation never communicate; the same model listed twice joins once.
  std::vector<DistributedDataParallel> models;
  for (const auto& model : joinables) {
    const bool seen = std::any_of(models.begin(), models.end(),
                                  [&](const DistributedDataParallel& m) { return m.impl() == model.impl(); });
    if (model.is_distributed() && !seen) models.push_back(model);
  }
  const bool enable = !even_batches.value_or(this->even_batches());
  TORCH_CHECK_VALUE(!enable || !joinables.empty(), "[Accelerator.join_uneven_inputs] expected at least one prepared "
                                                   "model to join, got none");
  TORCH_CHECK_VALUE(!enable || models.size() <= 1, "[Accelerator.join_uneven_inputs] one prepared model can be "
                                                   "joined at a time, got ", models.size(), " (the backward passes "
                                                   "of several models interleave their collectives in an order a "
                                                   "finished process cannot reproduce)");

  // Upstream overrides `even_batches` of the batch samplers of map-style loaders only.
  struct Override {
    std::shared_ptr<BatchSamplerShard> sampler;
    bool even_batches;
  };
  struct Restore {
    std::vector<Override> saved;
    ~Restore() {
      for (auto& o : saved) o.sampler->set_even_batches(o.even_batches);
    }
  } restore;
  if (even_batches) {
    bool kept = false;
    for (const auto& loader : prepared_data_loaders()) {
      auto shard = std::dynamic_pointer_cast<BatchSamplerShard>(loader.batch_sampler());
      if (!shard || loader.dispatch_batches()) {
        kept = true;
        continue;
      }
      restore.saved.push_back({shard, shard->even_batches()});
      shard->set_even_batches(*even_batches);
    }
    if (kept) {
      detail::warn("accelerate.accelerator",
                   "[Accelerator.join_uneven_inputs] even_batches can only be overridden for map-style data loaders "
                   "that are not dispatched; some prepared loaders keep their own setting",
                   {.once = true, .state = state().partial_state()});
    }
  }

  if (!enable || models.empty()) {
    fn();
    return;
  }
  // Processes with fewer batches leave their loops early: the step-boundary check, a collective,
  // would meet nothing there (Note [Preemption]).
  struct Joining {
    std::atomic<int>& count;
    explicit Joining(std::atomic<int>& c) : count(c) { ++count; }
    ~Joining() { --count; }
  } joining(impl_->joining);
  models.front().join(fn);
}

std::vector<DataLoader> Accelerator::prepared_data_loaders() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->data_loaders;
}
std::vector<DistributedDataParallel> Accelerator::prepared_models() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->models;
}
std::vector<AcceleratedOptimizer> Accelerator::prepared_optimizers() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->optimizers;
}
std::vector<AcceleratedScheduler> Accelerator::prepared_schedulers() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->schedulers;
}

}  // namespace accelerate
