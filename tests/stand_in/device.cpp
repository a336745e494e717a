// The stand-in accelerator; see device.h.
//
// Note [The stand-in device]
// PyTorch tests its device-generic code on a device registered through the PrivateUse1 extension
// point; this is the same for LibTorch 1.13, 2.6 and 2.14, built from four parts:
// - an allocator over host memory whose data pointers are tagged (kTag) so that the processor
//   refuses them: host code that reads or writes a tensor's data_ptr() directly (a memcpy into a
//   parameter, a from_blob over it) fails here as it fails on a GPU, instead of working by luck
//   because the memory happens to be host memory. Only this file's copy kernel untags them;
// - a device guard with kDevices devices and one (default) stream each;
// - the kernels that cannot run through a fallback, because they allocate, copy between
//   devices or make views that must share storage: empty, empty_strided, _copy_from,
//   _copy_from_and_resize, resize_, as_strided, view and _reshape_alias;
// - a boxed fallback for every other operator: it refuses tensors of two devices (CPU scalars
//   that are read, not written, apart)
//   with the message CUDA kernels give, hands random kernels that name no generator this device's
//   own generator, and runs the operator's CPU kernel on copies (LibTorch's cpu_fallback, which
//   writes in-place and out= results back).
// View operators without a kernel here are refused by cpu_fallback rather than silently copied.
#include "stand_in/device.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/native/CPUFallback.h>
#if __has_include(<ATen/detail/PrivateUse1HooksInterface.h>)
#include <ATen/detail/PrivateUse1HooksInterface.h>
#endif
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>
#include <torch/version.h>

#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <sstream>

namespace accelerate::testing::stand_in {
namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
// Bit 55 makes an x86-64 address non-canonical and an AArch64 one a kernel address: either way
// the processor faults on it, whatever lies at the untagged address.
constexpr uintptr_t kTag = uintptr_t{1} << 55;

std::atomic<int64_t> g_bytes{0};
std::atomic<int64_t> g_copies{0};
thread_local c10::DeviceIndex t_current = 0;

void* untag(const void* p) { return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) & ~kTag); }
void* tag(void* p) { return p == nullptr ? nullptr : reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) | kTag); }

struct Block {
  void* memory;
  size_t bytes;
};

void free_block(void* context) {
  auto* block = static_cast<Block*>(context);
  g_bytes -= static_cast<int64_t>(block->bytes);
  std::free(block->memory);
  delete block;
}

// ---- memory ----------------------------------------------------------------------------------

class Allocator final : public c10::Allocator {
 public:
  c10::DataPtr make(size_t bytes) const {
    const c10::Device device(kType, t_current);
    if (bytes == 0) return {nullptr, nullptr, &c10::detail::deleteNothing, device};
    void* memory = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    TORCH_CHECK(memory != nullptr, "stand-in device: out of memory allocating ", bytes, " bytes");
    g_bytes += static_cast<int64_t>(bytes);
    return {tag(memory), new Block{memory, bytes}, &free_block, device};
  }
#if TORCH_VERSION_MAJOR >= 2 && (TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 3)
  // LibTorch 2.3 made allocate non-const and added copy_data.
  c10::DataPtr allocate(size_t bytes) override { return make(bytes); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(untag(dest), untag(src), count);
  }
#else
  c10::DataPtr allocate(size_t bytes) const override { return make(bytes); }
#endif
};

Allocator g_allocator;

// ---- the device guard ------------------------------------------------------------------------

class Guard final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {kType, t_current}; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.type() == kType && d.index() >= 0 && d.index() < kDevices, "stand-in device: no device ", d);
    t_current = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override { t_current = d.index(); }
  c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream getDefaultStream(c10::Device d) const override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return kDevices; }
};

// ---- kernels that cannot fall back -----------------------------------------------------------

c10::DispatchKeySet keys() { return c10::DispatchKeySet(c10::DispatchKey::PrivateUse1); }

at::Tensor empty_memory_format(c10::IntArrayRef size, c10::optional<c10::ScalarType> dtype,
                               c10::optional<c10::Layout> layout, c10::optional<c10::Device> device,
                               c10::optional<bool> pin_memory, c10::optional<c10::MemoryFormat> memory_format) {
  (void)layout;
  (void)pin_memory;
  const c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_generic(size, &g_allocator, keys(), c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, c10::optional<c10::ScalarType> dtype,
                         c10::optional<c10::Layout> layout, c10::optional<c10::Device> device,
                         c10::optional<bool> pin_memory) {
  (void)layout;
  (void)pin_memory;
  const c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_strided_generic(size, stride, &g_allocator, keys(), c10::dtype_or_default(dtype));
}

// A CPU tensor over the same bytes: the only place stand-in memory is read or written.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().type() != kType) return t;
  if (t.numel() == 0) return at::empty(t.sizes(), t.options().device(c10::kCPU));
  return at::from_blob(untag(t.data_ptr()), t.sizes(), t.strides(), t.options().device(c10::kCPU));
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  (void)non_blocking;
  ++g_copies;
  at::NoGradGuard no_grad;
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

const at::Tensor& resize_storage(const at::Tensor& self, c10::IntArrayRef size,
                         c10::optional<c10::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  int64_t numel = 1;
  for (const auto s : size) numel *= s;
  const auto needed = static_cast<size_t>((self.storage_offset() + numel) * static_cast<int64_t>(self.itemsize()));
  auto* storage = self.storage().unsafeGetStorageImpl();
  if (storage->nbytes() < needed) {
    const c10::DeviceGuard guard(self.device());
    c10::DataPtr fresh = g_allocator.make(needed);
    if (storage->nbytes() > 0) std::memcpy(untag(fresh.get()), untag(storage->data()), storage->nbytes());
    storage->set_data_ptr_noswap(std::move(fresh));
    storage->set_nbytes(needed);
  }
  impl->set_sizes_contiguous(size);
  if (memory_format) impl->empty_tensor_restride(*memory_format);
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) resize_storage(dst, self.sizes(), c10::nullopt);
  return copy_from(self, dst, false);
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      c10::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) { return at::native::view(self, size); }

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

// Whether `self` may take `from`'s data in place (Module::to's set_data): LibTorch 1.13 allows
// it between dense CPU and GPU tensors only.
bool compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.device().type() == kType || t.device().is_cpu());
  };
  return dense(self) && dense(from);
}

// ---- generators ------------------------------------------------------------------------------

std::array<at::Generator, kDevices>& generators() {
  static std::array<at::Generator, kDevices> all = [] {
    std::array<at::Generator, kDevices> made;
    for (int i = 0; i < kDevices; ++i) made[i] = at::make_generator<at::CPUGeneratorImpl>(67280421310721ULL + i);
    return made;
  }();
  return all;
}

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 6)
// LibTorch 2.x asks a PrivateUse1 backend through these hooks for its generators (the
// context's defaultGenerator) and whether it is the accelerator (autograd's streams).
struct Hooks final : at::PrivateUse1HooksInterface {
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return generators().at(index < 0 ? t_current : index);
  }
  at::Device getDeviceFromPtr(void* data) const override {
    (void)data;
    return {kType, t_current};
  }
  bool hasPrimaryContext(c10::DeviceIndex index) const override { return index >= 0 && index < kDevices; }
  c10::DeviceIndex deviceCount() const override { return kDevices; }
#if TORCH_VERSION_MINOR >= 14 || TORCH_VERSION_MAJOR > 2
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
#endif
};
#define ACCELERATE_STAND_IN_HOOKS 1
#endif

// ---- the fallback ----------------------------------------------------------------------------

// Every tensor argument, including those inside lists.
template <typename F>
void for_each_tensor(const c10::IValue& value, F&& f) {
  if (value.isTensor()) {
    f(value.toTensor());
  } else if (value.isTensorList()) {
    for (const at::Tensor& t : value.toTensorList().vec()) f(t);
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) {
      if (item.isTensor()) f(item.toTensor());
    }
  }
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t count = schema.arguments().size();
  auto arguments = torch::jit::last(*stack, count);
  c10::optional<c10::Device> accelerator;
  c10::optional<c10::Device> other;
  for (size_t i = 0; i < count; ++i) {
    // A CPU scalar may be read with tensors of the device, as CUDA kernels allow, not written.
    const auto* alias = schema.arguments()[i].alias_info();
    const bool written = alias != nullptr && alias->isWrite();
    for_each_tensor(arguments[i], [&](const at::Tensor& t) {
      if (!t.defined()) return;
      if (t.device().type() == kType) {
        if (accelerator && *accelerator != t.device()) other = t.device();
        accelerator = t.device();
      } else if (written || !(t.device().is_cpu() && t.dim() == 0)) {
        other = t.device();
      }
    });
  }
  if (accelerator && other) {
    std::ostringstream message;
    message << "Expected all tensors to be on the same device, but found at least two devices, " << *accelerator
            << " and " << *other << "! (in " << schema.operator_name() << " on the stand-in device)";
    TORCH_CHECK(false, message.str());
  }
  if (accelerator) {
    for (size_t i = 0; i < count; ++i) {
      const auto& argument = schema.arguments()[i];
      auto& value = (*stack)[stack->size() - count + i];
      if (argument.name() == "generator" && value.isNone()) value = c10::IValue(generators()[accelerator->index()]);
    }
  }
  at::native::cpu_fallback(op, stack);
}

}  // namespace

void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::SetAllocator(kType, &g_allocator);
    static c10::impl::DeviceGuardImplRegistrar guard_registrar(kType, new Guard());
    static auto* kernels = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                              __FILE__, __LINE__);
    kernels->impl("empty.memory_format", TORCH_FN(empty_memory_format));
    kernels->impl("empty_strided", TORCH_FN(empty_strided));
    kernels->impl("_copy_from", TORCH_FN(copy_from));
    kernels->impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
    kernels->impl("resize_", TORCH_FN(resize_storage));
    kernels->impl("as_strided", TORCH_FN(as_strided));
    kernels->impl("view", TORCH_FN(view));
    kernels->impl("_reshape_alias", TORCH_FN(reshape_alias));
    kernels->impl("_has_compatible_shallow_copy_type", TORCH_FN(compatible_shallow_copy_type));
    // A kernel of its own hides the composite one from autograd's key too, so it is there as well.
    static auto* autograd = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::AutogradPrivateUse1,
                                               __FILE__, __LINE__);
    autograd->impl("_has_compatible_shallow_copy_type", TORCH_FN(compatible_shallow_copy_type));
    static auto* fallbacks = new torch::Library(torch::Library::IMPL, "_", c10::DispatchKey::PrivateUse1,
                                                __FILE__, __LINE__);
    fallbacks->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
#ifdef ACCELERATE_STAND_IN_HOOKS
    c10::register_privateuse1_backend("privateuseone");
    at::RegisterPrivateUse1HooksInterface(new Hooks());
#endif
  });
}

c10::Device device(int index) { return {kType, static_cast<c10::DeviceIndex>(index)}; }

int64_t bytes_in_use() { return g_bytes.load(); }

int64_t copies() { return g_copies.load(); }

at::Generator default_generator(int index) {
  TORCH_CHECK(index >= 0 && index < kDevices, "stand-in device: no device ", index);
  return generators()[index];
}

}  // namespace accelerate::testing::stand_in
