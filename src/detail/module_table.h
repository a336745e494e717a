// Values kept beside modules, keyed by the module's address (LibTorch modules have no room for
// the attributes upstream sets on Python modules: `_hf_hook`, `hf_device_map`). A weak pointer
// tells a module that died, and whose address was reused, from the one the value was set for.
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

namespace accelerate::detail {

template <typename T>
class ModuleTable {
 public:
  /// Sets the value of `module`.
  void set(torch::nn::Module& module, T value) {
    std::weak_ptr<torch::nn::Module> owner;
    try {
      owner = module.shared_from_this();
    } catch (const std::bad_weak_ptr&) {
      // A module outside a shared_ptr: it cannot be told from a successor at its address.
    }
    const bool shared = !owner.expired();
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.insert_or_assign(&module, Entry{std::move(owner), shared, std::move(value)});
  }

  /// The value of `module`, if one was set and the module is still the one it was set for.
  std::optional<T> get(const torch::nn::Module& module) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(&module);
    if (it == entries_.end()) return std::nullopt;
    if (it->second.shared) {
      auto owner = it->second.owner.lock();
      if (owner == nullptr || owner.get() != &module) {
        entries_.erase(it);
        return std::nullopt;
      }
    }
    return it->second.value;
  }

  /// Forgets the value of `module`.
  void erase(const torch::nn::Module& module) {
    std::lock_guard<std::mutex> lock(mutex_);
    entries_.erase(&module);
  }

 private:
  struct Entry {
    std::weak_ptr<torch::nn::Module> owner;
    bool shared = false;  // whether `owner` was set
    T value;
  };
  std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, Entry> entries_;
};

}  // namespace accelerate::detail
