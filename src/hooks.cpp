#include "accelerate/hooks.h"

#include "accelerate/utils/device_map.h"
#include "detail/module_table.h"
#include "detail/torch_compat.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/container/any.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace accelerate {

namespace {

// Hooks live beside the modules (Note in detail/module_table.h).
detail::ModuleTable<std::shared_ptr<ModelHook>>& hooks() {
  static detail::ModuleTable<std::shared_ptr<ModelHook>> table;
  return table;
}

bool has_tensors(const torch::nn::Module& module, bool recurse) {
  return !module.named_parameters(recurse).is_empty() || !module.named_buffers(recurse).is_empty();
}

bool in_classes(const torch::nn::Module& module, const std::vector<std::string>& classes) {
  const auto name = module_class_name(module);
  return std::any_of(classes.begin(), classes.end(), [&](const auto& c) { return c == name || c == module.name(); });
}

std::string join_name(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

}  // namespace

// ---- OffloadPrefetcher ----------------------------------------------------------------------

namespace {

// Note [Recycled weight buffers]
// An offloaded module's weights are copied in before it runs and dropped after. Through malloc,
// copies of many megabytes fragment the heap once glibc has raised its mmap threshold to their
// size: small allocations (a hook's bookkeeping, a file header) land in a freed copy's space, the
// next copy no longer fits, and the heap grows by a layer per module (seen: a 256 MB model under a
// 64 MB budget peaked 273 MB above its start instead of ~65). Fresh anonymous mappings per copy fix
// that but pay for zeroed pages and unmapping on every module (W8 fell from 1.0 to 0.82 of the
// in-memory forward). So the prefetcher keeps a small pool: large copies live in mappings of their
// own, and a released one waits (one at most) to hold the next module's weights of the same
// size. The pool lives as long as the prefetcher or the last tensor using it.
struct BufferPool {
  static constexpr size_t kKept = 1;
  std::mutex mutex;
  std::vector<std::pair<size_t, void*>> free;  // (bytes, mapping), at most kKept

  ~BufferPool() {
    for (const auto& [bytes, memory] : free) ::munmap(memory, bytes);
  }
  void* take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      for (auto it = free.begin(); it != free.end(); ++it) {
        if (it->first != bytes) continue;
        void* memory = it->second;
        free.erase(it);
        return memory;
      }
    }
    void* memory = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return memory == MAP_FAILED ? nullptr : memory;
  }
  void give(void* memory, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (free.size() < kKept) {
        free.emplace_back(bytes, memory);
        return;
      }
    }
    ::munmap(memory, bytes);
  }
};

}  // namespace

struct OffloadPrefetcher::Impl {
  std::shared_ptr<BufferPool> pool = std::make_shared<BufferPool>();
  std::mutex mutex;
  std::condition_variable changed;
  std::thread worker;
  bool stopping = false;
  // The order learned during the first pass: hook -> position, and each hook's latest loader.
  std::vector<const void*> order;
  std::unordered_map<const void*, size_t> position;
  std::unordered_map<const void*, Loader> loaders;
  bool learned = false;  // the first hook came round again: order[0] follows the last
  // The one read ahead: queued, then running, then done.
  enum class Job { kNone, kQueued, kRunning, kDone } job = Job::kNone;
  const void* job_key = nullptr;
  Loader job_load;
  std::vector<at::Tensor> job_result;
  bool job_failed = false;
  int64_t hits = 0;

  void run() {
    std::unique_lock<std::mutex> lock(mutex);
    while (true) {
      changed.wait(lock, [&] { return stopping || job == Job::kQueued; });
      if (stopping) return;
      job = Job::kRunning;
      Loader load = std::move(job_load);
      lock.unlock();
      std::vector<at::Tensor> result;
      bool failed = false;
      try {
        result = load();
      } catch (...) {
        failed = true;  // the hook reads its weights itself and raises the error where it belongs
      }
      lock.lock();
      job_result = std::move(result);
      job_failed = failed;
      job = Job::kDone;
      changed.notify_all();
    }
  }

  // Waits for the read ahead to finish and takes it off the slot.
  std::optional<std::vector<at::Tensor>> finish(std::unique_lock<std::mutex>& lock) {
    changed.wait(lock, [&] { return job == Job::kDone; });
    std::optional<std::vector<at::Tensor>> out;
    if (!job_failed) out = std::move(job_result);
    job_result.clear();
    job = Job::kNone;
    job_key = nullptr;
    return out;
  }
};

OffloadPrefetcher::OffloadPrefetcher() : impl_(std::make_unique<Impl>()) {
  impl_->worker = std::thread([impl = impl_.get()] { impl->run(); });
}

OffloadPrefetcher::~OffloadPrefetcher() {
  {
    std::unique_lock<std::mutex> lock(impl_->mutex);
    impl_->stopping = true;
    impl_->changed.notify_all();
  }
  impl_->worker.join();
}

std::optional<std::vector<at::Tensor>> OffloadPrefetcher::arrive(const void* key, Loader load) {
  auto& d = *impl_;
  std::unique_lock<std::mutex> lock(d.mutex);
  auto found = d.position.find(key);
  if (found == d.position.end()) {
    if (d.learned) {  // a module never seen: the model's path changed, learn it again
      d.order.clear();
      d.position.clear();
      d.loaders.clear();
      d.learned = false;
    }
    found = d.position.emplace(key, d.order.size()).first;
    d.order.push_back(key);
  } else if (!d.learned && found->second == 0 && d.order.size() > 1) {
    d.learned = true;
  }
  d.loaders.insert_or_assign(key, std::move(load));

  std::optional<std::vector<at::Tensor>> ready;
  if (d.job != Impl::Job::kNone) {
    const bool mine = d.job_key == key;
    if (d.job == Impl::Job::kQueued && !mine) {  // not started and not needed: drop it
      d.job = Impl::Job::kNone;
      d.job_key = nullptr;
      d.job_load = nullptr;
    } else {
      auto result = d.finish(lock);  // a wrong guess still finishes, so at most two modules are held
      if (mine) ready = std::move(result);
    }
  }
  if (ready) ++d.hits;

  const size_t next = found->second + 1;
  const void* successor = next < d.order.size() ? d.order[next] : (d.learned ? d.order.front() : nullptr);
  if (successor != nullptr && successor != key) {
    d.job_key = successor;
    d.job_load = d.loaders.at(successor);
    d.job = Impl::Job::kQueued;
    d.changed.notify_all();
  }
  return ready;
}

at::Tensor OffloadPrefetcher::own(const at::Tensor& weight) const {
  constexpr size_t kPooled = size_t{1} << 20;
  const size_t bytes = weight.nbytes();
  if (bytes < kPooled || !weight.device().is_cpu() || !weight.is_contiguous()) return weight.clone();
  auto pool = impl_->pool;
  void* memory = pool->take(bytes);
  if (memory == nullptr) return weight.clone();
  std::memcpy(memory, weight.data_ptr(), bytes);
  return at::from_blob(
      memory, weight.sizes(), weight.strides(), [pool, bytes](void* p) { pool->give(p, bytes); }, weight.options());
}

int64_t OffloadPrefetcher::hits() const {
  std::unique_lock<std::mutex> lock(impl_->mutex);
  return impl_->hits;
}

// ---- SequentialHook ------------------------------------------------------------------------

SequentialHook::SequentialHook(std::vector<std::shared_ptr<ModelHook>> hooks) : hooks_(std::move(hooks)) {
  for (const auto& h : hooks_) TORCH_CHECK_VALUE(h != nullptr, "[SequentialHook] a hook is null");
}

void SequentialHook::init_hook(torch::nn::Module& module) {
  for (auto& h : hooks_) h->init_hook(module);
}
void SequentialHook::pre_forward(torch::nn::Module& module, std::vector<at::Tensor>& inputs) {
  for (auto& h : hooks_) h->pre_forward(module, inputs);
}
void SequentialHook::post_forward(torch::nn::Module& module, std::vector<at::Tensor>& outputs) {
  for (auto& h : hooks_) h->post_forward(module, outputs);
}
void SequentialHook::detach_hook(torch::nn::Module& module) {
  for (auto& h : hooks_) h->detach_hook(module);
}

bool SequentialHook::checkpoints_activations() const {
  return std::any_of(hooks_.begin(), hooks_.end(), [](const auto& h) { return h->checkpoints_activations(); });
}

AlignDevicesHook::AlignDevicesHook(AlignDevicesOptions options) : options_(std::move(options)) {}

std::vector<std::string> AlignDevicesHook::offloaded_names(const torch::nn::Module& module) const {
  std::vector<std::string> names;
  for (const auto& [name, tensor] : named_module_tensors(module, options_.offload_buffers, options_.place_submodules)) {
    names.push_back(name);
  }
  return names;
}

void AlignDevicesHook::init_hook(torch::nn::Module& module) {
  const bool recurse = options_.place_submodules;
  if (!options_.offload) {
    if (options_.execution_device) {
      for (const auto& [name, tensor] : named_module_tensors(module, true, recurse)) {
        set_module_tensor_to_device(module, name, *options_.execution_device);
      }
    }
    return;
  }
  original_devices_.clear();
  for (const auto& [name, tensor] : named_module_tensors(module, true, recurse)) {
    original_devices_.emplace_back(name, tensor.device());
  }
  if (!options_.weights_map) {
    TensorMap copies;
    for (const auto& [name, tensor] : named_module_tensors(module, options_.offload_buffers, recurse)) {
      copies[name] = tensor.detach().to(c10::kCPU);
    }
    options_.weights_map = std::make_shared<OffloadedWeightsLoader>(std::move(copies), std::nullopt, OffloadIndex{});
  }
  for (const auto& name : offloaded_names(module)) {
    TORCH_CHECK_VALUE(options_.weights_map->contains(name), "[AlignDevicesHook] the weights map has no '", name,
                      "' for ", module.name());
    set_module_tensor_to_device(module, name, c10::kMeta);
  }
  if (!options_.offload_buffers && options_.execution_device) {
    for (const auto& b : module.named_buffers(recurse)) {
      set_module_tensor_to_device(module, b.key(), *options_.execution_device);
    }
  }
}

void AlignDevicesHook::pre_forward(torch::nn::Module& module, std::vector<at::Tensor>& inputs) {
  if (options_.io_same_device) {
    input_device_.reset();
    for (const auto& t : inputs) {
      if (t.defined()) {
        input_device_ = t.device();
        break;
      }
    }
  }
  if (options_.offload) {
    const auto device = options_.execution_device.value_or(c10::Device(c10::kCPU));
    auto names = offloaded_names(module);
    // A copy: the module must not keep depending on an offload file once the hook is gone.
    // The prefetcher by plain pointer: it stores this function, so a shared pointer would keep it
    // (and its thread) alive forever; it outlives every call (the hook or its own thread makes them).
    auto read = [map = options_.weights_map, device,
                 prefetcher = options_.prefetcher.get()](const std::vector<std::string>& names) {
      std::vector<at::Tensor> out;
      out.reserve(names.size());
      for (const auto& name : names) {
        const auto t = map->get(name);
        if (t.device() != device) {
          out.push_back(t.to(device));
        } else {
          out.push_back(prefetcher ? prefetcher->own(t) : t.clone());
        }
      }
      return out;
    };
    std::optional<std::vector<at::Tensor>> ready;
    if (options_.prefetcher) ready = options_.prefetcher->arrive(this, [read, names] { return read(names); });
    const auto weights = ready && ready->size() == names.size() ? std::move(*ready) : read(names);
    for (size_t i = 0; i < names.size(); ++i) set_module_tensor_to_device(module, names[i], device, weights[i]);
  }
  if (options_.execution_device) {
    for (auto& t : inputs) {
      if (t.defined() && t.device() != *options_.execution_device) t = t.to(*options_.execution_device);
    }
  }
}

void AlignDevicesHook::post_forward(torch::nn::Module& module, std::vector<at::Tensor>& outputs) {
  if (options_.offload) {
    for (const auto& name : offloaded_names(module)) set_module_tensor_to_device(module, name, c10::kMeta);
  }
  const bool meta_run = (options_.execution_device && options_.execution_device->is_meta()) ||
                        (input_device_ && input_device_->is_meta());
  if (!meta_run) {
    for (const auto& t : outputs) {
      TORCH_CHECK(!t.defined() || !t.is_meta(), "[AlignDevicesHook] the forward of ", module.name(),
                  " returned a tensor on the meta device: a submodule whose weights are offloaded ran without its "
                  "hook. Call children through accelerate::forward(child, …) or list the module's class in "
                  "preload_module_classes");
    }
  }
  if (options_.io_same_device && input_device_) {
    for (auto& t : outputs) {
      if (t.defined() && t.device() != *input_device_) t = t.to(*input_device_);
    }
  }
}

void AlignDevicesHook::detach_hook(torch::nn::Module& module) {
  if (!options_.offload) return;
  for (const auto& [name, device] : original_devices_) {
    if (device.is_meta()) continue;
    if (options_.weights_map && options_.weights_map->contains(name)) {
      // A copy: the module must not keep depending on an offload file once the hook is gone.
      set_module_tensor_to_device(module, name, device, options_.weights_map->get(name).clone());
    }
  }
}

void add_hook_to_module(torch::nn::Module& module, std::shared_ptr<ModelHook> hook, bool append) {
  TORCH_CHECK_VALUE(hook != nullptr, "[add_hook_to_module] the hook is null");
  if (append) {
    if (auto old = get_hook(module)) {
      remove_hook_from_module(module);
      hook = std::make_shared<SequentialHook>(std::vector<std::shared_ptr<ModelHook>>{old, hook});
    }
  }
  hook->init_hook(module);
  hooks().set(module, std::move(hook));
}

std::shared_ptr<ModelHook> get_hook(const torch::nn::Module& module) { return hooks().get(module).value_or(nullptr); }

void remove_hook_from_module(torch::nn::Module& module, bool recurse) {
  if (auto hook = get_hook(module)) {
    hook->detach_hook(module);
    hooks().erase(module);
  }
  if (recurse) {
    for (auto& child : module.children()) remove_hook_from_module(*child, true);
  }
}

void remove_hook_from_submodules(torch::nn::Module& module) {
  for (auto& child : module.children()) remove_hook_from_module(*child, true);
}

void attach_align_device_hook(torch::nn::Module& module, std::optional<c10::Device> execution_device, bool offload,
                              std::shared_ptr<const WeightsMap> weights_map, bool offload_buffers,
                              const std::string& module_name, const std::vector<std::string>& preload_module_classes,
                              std::shared_ptr<OffloadPrefetcher> prefetcher) {
  const bool preload = in_classes(module, preload_module_classes);
  const bool direct =
      !module.named_parameters(false).is_empty() || (offload_buffers && !module.named_buffers(false).is_empty());
  if ((direct || preload) && has_tensors(module, preload)) {
    AlignDevicesOptions options;
    options.execution_device = execution_device;
    options.offload = offload;
    options.offload_buffers = offload_buffers;
    options.place_submodules = preload;
    if (offload) options.prefetcher = prefetcher;
    if (weights_map) {
      options.weights_map =
          module_name.empty() ? weights_map : std::make_shared<PrefixedWeightsMap>(weights_map, module_name + ".");
    }
    add_hook_to_module(module, std::make_shared<AlignDevicesHook>(std::move(options)), /*append=*/true);
  }
  if (preload) return;
  for (const auto& child : module.named_children()) {
    attach_align_device_hook(*child.value(), execution_device, offload, weights_map, offload_buffers,
                             join_name(module_name, child.key()), preload_module_classes, prefetcher);
  }
}

void attach_execution_device_hook(torch::nn::Module& module, const c10::Device& execution_device,
                                  const std::vector<std::string>& preload_module_classes) {
  if (!get_hook(module) && has_tensors(module, true)) {
    AlignDevicesOptions options;
    options.execution_device = execution_device;
    add_hook_to_module(module, std::make_shared<AlignDevicesHook>(std::move(options)));
  }
  if (in_classes(module, preload_module_classes)) return;
  for (auto& child : module.children()) attach_execution_device_hook(*child, execution_device, preload_module_classes);
}

void attach_align_device_hook_on_blocks(torch::nn::Module& module,
                                        const std::map<std::string, c10::Device>& execution_device,
                                        const std::map<std::string, bool>& offload,
                                        std::shared_ptr<const WeightsMap> weights_map, bool offload_buffers,
                                        const std::string& module_name,
                                        const std::vector<std::string>& preload_module_classes,
                                        std::shared_ptr<OffloadPrefetcher> prefetcher) {
  const auto device = execution_device.find(module_name);
  const auto off = offload.find(module_name);
  if (device != execution_device.end() && off != offload.end() && !off->second) {
    AlignDevicesOptions options;
    options.execution_device = device->second;
    options.offload_buffers = offload_buffers;
    options.io_same_device = module_name.empty();
    options.place_submodules = true;
    add_hook_to_module(module, std::make_shared<AlignDevicesHook>(std::move(options)));
    attach_execution_device_hook(module, device->second, preload_module_classes);
  } else if (device != execution_device.end() && off != offload.end()) {
    attach_align_device_hook(module, device->second, true, weights_map, offload_buffers, module_name,
                             preload_module_classes, prefetcher);
    if (!get_hook(module)) {
      AlignDevicesOptions options;
      options.execution_device = device->second;
      options.io_same_device = module_name.empty();
      add_hook_to_module(module, std::make_shared<AlignDevicesHook>(std::move(options)));
    }
    attach_execution_device_hook(module, device->second, preload_module_classes);
  } else if (module_name.empty()) {
    AlignDevicesOptions options;
    if (auto root = execution_device.find(""); root != execution_device.end()) options.execution_device = root->second;
    options.io_same_device = true;
    add_hook_to_module(module, std::make_shared<AlignDevicesHook>(std::move(options)));
  }
  for (const auto& child : module.named_children()) {
    attach_align_device_hook_on_blocks(*child.value(), execution_device, offload, weights_map, offload_buffers,
                                       join_name(module_name, child.key()), preload_module_classes, prefetcher);
  }
}

namespace detail {

void run_pre_hook(ModelHook& hook, torch::nn::Module& module, std::vector<at::Tensor>& tensors) {
  hook.pre_forward(module, tensors);
}

void run_post_hook(ModelHook& hook, torch::nn::Module& module, std::vector<at::Tensor>& tensors) {
  hook.post_forward(module, tensors);
}

void rethrow_forward_error(const torch::nn::Module& module) {
  bool meta = false;
  for (const auto& [name, tensor] : named_module_tensors(module, true, true)) meta = meta || tensor.is_meta();
  if (!meta) throw;
  try {
    throw;
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "[accelerate::forward] the forward of ", module.name(),
                " failed while some of its weights are on the meta device: a submodule whose weights are offloaded "
                "ran without its hook. Call children through accelerate::forward(child, …) or list the module's "
                "class in preload_module_classes. The error was: ",
                e.what_without_backtrace());
  }
}

// Note [Activation checkpointing]
// A checkpointed module runs twice: once in the forward pass, without recording gradients, so
// that none of its intermediate tensors outlive the call (only its inputs are kept, saved by the
// autograd node its outputs hang from), and again when the backward pass reaches that node, with
// gradients recorded, from the saved inputs detached. The node then back-propagates the output
// gradients through the recomputed graph with a nested backward pass, which accumulates the
// gradients of the module's parameters (and of any other leaf it used) into their `.grad` as the
// ordinary graph would, and hands the gradients of the detached inputs on as its own. This is
// PyTorch's checkpointing; the parameters' gradients arrive through their own hooks, so engines
// that act on them (the fully sharded engine's reductions) see the same events as without.
// The recomputation must compute what the first run did: the default random generators of the
// devices involved are set back to their state before the first run (and restored afterwards),
// and autocast is set as it was, with its cast cache off so that no cast outlives the recompute.
// When no input requires a gradient (token ids into an embedding) the node still has to exist
// for the parameters' sake: an empty leaf that requires a gradient is passed along as an anchor,
// and receives none.
namespace {

thread_local int recompute_depth = 0;

struct DeviceRandomState {
  at::Generator generator;
  at::Tensor state;
};

std::vector<DeviceRandomState> random_states(const std::vector<at::Tensor>& inputs) {
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  for (const auto& t : inputs) {
    if (t.defined() && !t.is_cpu() && !t.is_meta() &&
        std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  std::vector<DeviceRandomState> states;
  for (const auto& device : devices) {
    at::Generator generator = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(generator.mutex());
    states.push_back({generator, generator.get_state()});
  }
  return states;
}

void set_random_states(const std::vector<DeviceRandomState>& states) {
  for (const auto& s : states) {
    at::Generator generator = s.generator;
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(s.state);
  }
}

struct AutocastState {
  bool enabled;
  c10::ScalarType dtype;
};

AutocastState autocast_state(c10::DeviceType device) {
  return {compat::is_autocast_enabled(device), compat::get_autocast_dtype(device)};
}

void set_autocast_state(c10::DeviceType device, const AutocastState& state) {
  compat::set_autocast_enabled(device, state.enabled);
  compat::set_autocast_dtype(device, state.dtype);
}

// Where the defined tensors of `tensors` sit.
std::vector<size_t> defined_positions(const std::vector<at::Tensor>& tensors) {
  std::vector<size_t> at;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].defined()) at.push_back(i);
  }
  return at;
}

// What a checkpointed call keeps for its recomputation. Undefined tensors (an optional argument
// left empty, an output that is absent) cannot pass through an autograd function, so the node
// sees only the defined ones; `inputs_at`/`outputs_at` say where they sit among all of them.
struct Recompute final : torch::CustomClassHolder {
  FlatForward run;
  std::vector<DeviceRandomState> random;
  AutocastState cpu{};
  AutocastState cuda{};
  std::vector<size_t> inputs_at;
  size_t input_count = 0;
  std::vector<size_t> outputs_at;
  size_t output_count = 0;

  std::vector<at::Tensor> all_inputs(const std::vector<at::Tensor>& defined) const {
    std::vector<at::Tensor> all(input_count);
    for (size_t k = 0; k < defined.size(); ++k) all[inputs_at[k]] = defined[k];
    return all;
  }
};

// Turns autocast's cache of casts off for its lifetime. A cast cached during a run without
// gradients would carry no history, and a later use of the same weight in the same autocast
// region, with gradients, would take it and lose its gradient; the recomputation must not leave
// casts behind either.
class CastCacheOff {
 public:
  CastCacheOff() : was_(at::autocast::is_autocast_cache_enabled()) { at::autocast::set_autocast_cache_enabled(false); }
  ~CastCacheOff() { at::autocast::set_autocast_cache_enabled(was_); }
  CastCacheOff(const CastCacheOff&) = delete;
  CastCacheOff& operator=(const CastCacheOff&) = delete;

 private:
  bool was_;
};

// Sets the autocast state of a first run for a recomputation and puts the caller's back after.
class AutocastAsBefore {
 public:
  explicit AutocastAsBefore(const Recompute& r) : cpu_(autocast_state(c10::kCPU)), cuda_(autocast_state(c10::kCUDA)) {
    set_autocast_state(c10::kCPU, r.cpu);
    set_autocast_state(c10::kCUDA, r.cuda);
  }
  ~AutocastAsBefore() {
    set_autocast_state(c10::kCPU, cpu_);
    set_autocast_state(c10::kCUDA, cuda_);
  }
  AutocastAsBefore(const AutocastAsBefore&) = delete;
  AutocastAsBefore& operator=(const AutocastAsBefore&) = delete;

 private:
  AutocastState cpu_;
  AutocastState cuda_;
};

// The random generators of a first run for a recomputation; the caller's come back after, and
// the recomputation depth goes down, even when the recomputation throws.
class RandomAsBefore {
 public:
  explicit RandomAsBefore(const Recompute& r) {
    for (const auto& before : r.random) {
      at::Generator generator = before.generator;
      std::lock_guard<std::mutex> lock(generator.mutex());
      callers_.push_back({generator, generator.get_state()});
    }
    ++recompute_depth;
    try {
      set_random_states(r.random);
    } catch (...) {
      --recompute_depth;
      set_random_states(callers_);
      throw;
    }
  }
  ~RandomAsBefore() {
    --recompute_depth;
    set_random_states(callers_);
  }
  RandomAsBefore(const RandomAsBefore&) = delete;
  RandomAsBefore& operator=(const RandomAsBefore&) = delete;

 private:
  std::vector<DeviceRandomState> callers_;
};

struct CheckpointNode : torch::autograd::Function<CheckpointNode> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                at::TensorList anchor, c10::intrusive_ptr<Recompute> recompute) {
    (void)anchor;
    ctx->save_for_backward(inputs.vec());
    const auto outputs = recompute->run(recompute->all_inputs(inputs.vec()));
    recompute->output_count = outputs.size();
    recompute->outputs_at = defined_positions(outputs);
    std::vector<at::Tensor> defined;
    for (const size_t i : recompute->outputs_at) defined.push_back(outputs[i]);
    ctx->saved_data["recompute"] = c10::IValue::make_capsule(std::move(recompute));
    return defined;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    // The nested backward pass accumulates into `.grad`, as `backward()` does; it cannot serve a
    // pass that must leave `.grad` alone or build a graph of its own (as PyTorch's reentrant
    // checkpoint, which refuses the same).
    TORCH_CHECK(torch::autograd::Engine::get_default_engine().is_checkpoint_valid(),
                "[activation checkpointing] the gradients of a checkpointed module can only be computed by "
                "backward() without `inputs`: torch::autograd::grad and backward(..., inputs) are not supported");
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "[activation checkpointing] backward with create_graph=true (gradients of gradients) through a "
                "checkpointed module is not supported");
    const auto saved = ctx->get_saved_variables();
    auto recompute = c10::static_intrusive_pointer_cast<Recompute>(ctx->saved_data["recompute"].toCapsule());
    std::vector<at::Tensor> leaves;
    leaves.reserve(saved.size());
    for (const auto& t : saved) {
      leaves.push_back(t.detach());
      if (t.requires_grad()) leaves.back().requires_grad_(true);
    }
    std::vector<at::Tensor> outputs;
    {
      RandomAsBefore random(*recompute);
      AutocastAsBefore autocast(*recompute);
      CastCacheOff no_cache;
      at::AutoGradMode record(true);
      outputs = recompute->run(recompute->all_inputs(leaves));
    }
    const auto now_at = defined_positions(outputs);
    TORCH_CHECK(outputs.size() == recompute->output_count && now_at == recompute->outputs_at,
                "[activation checkpointing] the recomputed forward returned ", outputs.size(), " tensors (",
                outputs.size() - now_at.size(), " undefined) where the first run returned ", recompute->output_count, " (",
                recompute->output_count - recompute->outputs_at.size(),
                " undefined): a checkpointed module must compute the same thing when it runs again");
    std::vector<at::Tensor> roots;
    std::vector<at::Tensor> root_grads;
    for (size_t k = 0; k < recompute->outputs_at.size(); ++k) {
      const auto& out = outputs[recompute->outputs_at[k]];
      if (out.requires_grad() && grads[k].defined()) {
        roots.push_back(out);
        root_grads.push_back(grads[k]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    torch::autograd::variable_list result;
    result.reserve(leaves.size() + 2);
    for (const auto& leaf : leaves) result.push_back(leaf.requires_grad() ? leaf.grad() : at::Tensor());
    result.emplace_back();  // the anchor, when there is one (extra undefined gradients are allowed)
    result.emplace_back();  // the recompute
    return result;
  }
};

}  // namespace

bool should_checkpoint(const ModelHook& hook) { return hook.checkpoints_activations() && at::GradMode::is_enabled(); }

bool recomputing_activations() { return recompute_depth > 0; }

std::vector<at::Tensor> checkpointed_forward(torch::nn::Module& module, std::vector<at::Tensor> inputs,
                                             FlatForward run) {
  const bool input_grad = std::any_of(inputs.begin(), inputs.end(),
                                      [](const at::Tensor& t) { return t.defined() && t.requires_grad(); });
  bool param_grad = false;
  for (const auto& p : module.parameters()) param_grad = param_grad || p.requires_grad();
  if (!input_grad && !param_grad) return run(inputs);
  auto recompute = c10::make_intrusive<Recompute>();
  recompute->random = random_states(inputs);
  recompute->cpu = autocast_state(c10::kCPU);
  recompute->cuda = autocast_state(c10::kCUDA);
  recompute->run = std::move(run);
  recompute->input_count = inputs.size();
  recompute->inputs_at = defined_positions(inputs);
  std::vector<at::Tensor> defined;
  for (const size_t i : recompute->inputs_at) defined.push_back(std::move(inputs[i]));
  std::vector<at::Tensor> anchor;
  if (!input_grad) anchor.push_back(at::empty({0}).requires_grad_(true));
  const Recompute& shape = *recompute;
  std::vector<at::Tensor> outputs;
  {
    CastCacheOff no_cache;
    // Note [GCC 14 and autograd::Function::apply]
    // GCC 14's release build (Debian 13) reports -Warray-bounds and -Wstringop-overflow ("writing
    // between 9 and ... bytes into a region of size 8") in std::vector<bool>::reserve, which
    // LibTorch's Function<T>::apply template calls for its inputs, once inlined here: GCC's known
    // false positive on vector<bool>'s word copy. GCC 12 and 16 see nothing, and the sanitizer
    // runs of these paths find no access out of bounds. Silenced for this call only (and the FSDP
    // engine's, src/detail/fsdp.cpp).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
    outputs = CheckpointNode::apply(at::TensorList(defined), at::TensorList(anchor), recompute);
#pragma GCC diagnostic pop
  }
  std::vector<at::Tensor> all(shape.output_count);
  for (size_t k = 0; k < outputs.size(); ++k) all[shape.outputs_at[k]] = std::move(outputs[k]);
  return all;
}

// The elements of a Sequential in turn, each with its hook.
at::Tensor run_elements(torch::nn::SequentialImpl& sequential, at::Tensor x) {
  for (auto& element : sequential) {
    // (LibTorch's AnyModule cannot hold a Sequential, so elements are never Sequentials.)
    auto child = element.ptr();
    auto hook = get_hook(*child);
    if (!hook) {
      x = element.forward(x);
      continue;
    }
    std::vector<at::Tensor> inputs{x};
    hook->pre_forward(*child, inputs);
    std::vector<at::Tensor> outputs;
    if (should_checkpoint(*hook)) {
      outputs = checkpointed_forward(*child, std::move(inputs), [element](const std::vector<at::Tensor>& in) mutable {
        return std::vector<at::Tensor>{element.forward(in.front())};
      });
    } else {
      outputs = {element.forward(inputs.front())};
    }
    hook->post_forward(*child, outputs);
    x = outputs.front();
  }
  return x;
}

at::Tensor forward_sequential(torch::nn::SequentialImpl& sequential, at::Tensor input) {
  auto own = get_hook(sequential);
  std::vector<at::Tensor> io{std::move(input)};
  if (!own) return run_elements(sequential, io.front());
  own->pre_forward(sequential, io);
  if (should_checkpoint(*own)) {
    std::shared_ptr<torch::nn::Module> keep = sequential.weak_from_this().lock();
    auto* seq = &sequential;
    io = checkpointed_forward(sequential, std::move(io), [keep, seq](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{run_elements(*seq, in.front())};
    });
  } else {
    io = {run_elements(sequential, io.front())};
  }
  own->post_forward(sequential, io);
  return io.front();
}

}  // namespace detail

}  // namespace accelerate
