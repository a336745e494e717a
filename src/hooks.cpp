// Hooks around a module's forward (hooks.h): weights moved in just before a submodule runs and out
// after it, inputs and outputs moved between devices.
#include "accelerate/hooks.h"

#include "accelerate/utils/device_map.h"
#include "detail/buffer_pool.h"
#include "detail/module_table.h"
#include "detail/torch_compat.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/container/any.h>

#include <algorithm>
#include <cstring>
#include <condition_variable>
#include <exception>
#include <limits>
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

// Note [Recycled weight buffers]
// An offloaded module's weights are copied in before it runs and dropped after. Through malloc,
// copies of many megabytes fragment the heap once glibc has raised its mmap threshold to their
// size: small allocations (a hook's bookkeeping, a file header) land in a freed copy's space, the
// next copy no longer fits, and the heap grows by a layer per module (seen: a 256 MB model under a
// 64 MB budget peaked 273 MB above its start instead of ~65). Fresh anonymous mappings per copy fix
// that but pay for zeroed pages and unmapping on every module (W8 fell from 1.0 to 0.82 of the
// in-memory forward). So the prefetcher keeps a small pool: large copies live in mappings of their
// own, and a released one waits (one at most) to hold the next module's weights of the same
// size. The pool (detail::BufferPool) lives as long as the prefetcher or the last tensor using it.

struct OffloadPrefetcher::Impl {
  std::shared_ptr<detail::BufferPool> pool =
      std::make_shared<detail::BufferPool>(std::numeric_limits<size_t>::max(), /*max_buffers=*/1);
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
  auto data = std::make_shared<at::DataPtr>(pool->take(bytes, detail::mapped_host_buffer));
  if (!*data) return weight.clone();
  void* memory = data->get();
  std::memcpy(memory, weight.data_ptr(), bytes);
  return at::from_blob(
      memory, weight.sizes(), weight.strides(), [pool, data, bytes](void*) { pool->give(bytes, std::move(*data)); },
      weight.options());
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
