// LibTorch release differences; see Note [LibTorch releases] in torch_compat.h.
#include "detail/torch_compat.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <ATen/Functions.h>

#include <type_traits>

#if TORCH_VERSION_MAJOR < 2
#include <c10/util/string_utils.h>
#endif

namespace accelerate::detail::compat {

c10::intrusive_ptr<c10d::ProcessGroup> as_process_group(c10::intrusive_ptr<BackendBase> backend,
                                                        const c10::intrusive_ptr<c10d::Store>& store,
                                                        const std::string& name,
                                                        std::initializer_list<c10::DeviceType> devices) {
#if TORCH_VERSION_MAJOR >= 2
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, backend->getRank(), backend->getSize());
  const auto type = c10d::ProcessGroup::strToBackendType(name);
  for (const auto device : devices) group->setBackend(device, type, backend);
  group->setDefaultBackend(type);
  return group;
#else
  (void)store;
  (void)name;
  (void)devices;
  return backend;
#endif
}

namespace {

// Reducer's constructor lost the initial per-bucket limits and gained three arguments between
// 2.6 and 2.14; which one this LibTorch has is asked of the type itself, so every release in
// between builds too.
template <typename R>
std::unique_ptr<R> construct_reducer(std::vector<at::Tensor> params, std::vector<std::vector<size_t>> bucket_indices,
                                     std::vector<size_t> per_bucket_limits,
                                     c10::intrusive_ptr<c10d::ProcessGroup> group, std::vector<bool> sparse,
                                     int64_t bucket_bytes, bool find_unused, bool as_view,
                                     std::unordered_map<size_t, std::string> names, int64_t first_bucket_bytes) {
  constexpr bool kWithLimits =
      std::is_constructible_v<R, std::vector<at::Tensor>, std::vector<std::vector<size_t>>, std::vector<size_t>,
                              c10::intrusive_ptr<c10d::ProcessGroup>, std::vector<bool>, int64_t, bool, bool,
                              std::unordered_map<size_t, std::string>, int64_t>;
  if constexpr (kWithLimits) {
    return std::make_unique<R>(std::move(params), std::move(bucket_indices), std::move(per_bucket_limits),
                               std::move(group), std::move(sparse), bucket_bytes, find_unused, as_view,
                               std::move(names), first_bucket_bytes);
  } else {
    // The initial limits only ever served logging; with an empty list of caps, rebuilt buckets
    // follow the first-bucket and bucket caps, as before.
    (void)per_bucket_limits;
    return std::make_unique<R>(std::move(params), std::move(bucket_indices), std::move(group), std::move(sparse),
                               bucket_bytes, find_unused, as_view, std::move(names), first_bucket_bytes,
                               /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false,
                               /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
  }
}

template <typename Group>
c10::intrusive_ptr<c10d::Work> gather_flat(Group& group, at::Tensor& output, at::Tensor& input) {
  if constexpr (requires { group.all_gather_single(output, input); }) {
    return group.all_gather_single(output, input);
  } else {
    return group._allgather_base(output, input);
  }
}

template <typename Group>
c10::intrusive_ptr<c10d::Work> scatter_flat(Group& group, at::Tensor& output, at::Tensor& input) {
  if constexpr (requires { group.reduce_scatter_single(output, input); }) {
    return group.reduce_scatter_single(output, input);
  } else {
    return group._reduce_scatter_base(output, input);
  }
}

template <typename Group>
c10::intrusive_ptr<c10d::Work> exchange_flat(Group& group, at::Tensor& output, at::Tensor& input,
                                             std::vector<int64_t>& output_splits, std::vector<int64_t>& input_splits) {
  if constexpr (requires { group.all_to_all_single(output, input, output_splits, input_splits); }) {
    return group.all_to_all_single(output, input, output_splits, input_splits);
  } else {
    return group.alltoall_base(output, input, output_splits, input_splits);
  }
}

}  // namespace

c10::intrusive_ptr<c10d::Work> all_to_all_single(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input,
                                                 std::vector<int64_t>& output_splits,
                                                 std::vector<int64_t>& input_splits) {
  return exchange_flat(group, output, input, output_splits, input_splits);
}

c10::intrusive_ptr<c10d::Work> all_gather_single(c10d::ProcessGroup& group, at::Tensor& output, at::Tensor& input) {
  return gather_flat(group, output, input);
}
c10::intrusive_ptr<c10d::Work> reduce_scatter_single(c10d::ProcessGroup& group, at::Tensor& output,
                                                     at::Tensor& input) {
  return scatter_flat(group, output, input);
}

bool has_flat_collectives(const c10d::ProcessGroup& group) {
#if TORCH_VERSION_MAJOR < 2
  return group.getBackendName() != "gloo";
#else
  (void)group;
  return true;
#endif
}

std::unique_ptr<c10d::Reducer> make_reducer(std::vector<at::Tensor> params,
                                            std::vector<std::vector<size_t>> bucket_indices,
                                            std::vector<size_t> per_bucket_limits,
                                            c10::intrusive_ptr<c10d::ProcessGroup> group,
                                            std::vector<bool> expect_sparse_gradients, int64_t bucket_bytes,
                                            bool find_unused_parameters, bool gradient_as_bucket_view,
                                            std::unordered_map<size_t, std::string> param_names,
                                            int64_t first_bucket_bytes) {
  return construct_reducer<c10d::Reducer>(std::move(params), std::move(bucket_indices), std::move(per_bucket_limits),
                                          std::move(group), std::move(expect_sparse_gradients), bucket_bytes,
                                          find_unused_parameters, gradient_as_bucket_view, std::move(param_names),
                                          first_bucket_bytes);
}

c10::Error make_error(std::string message) {
#if TORCH_VERSION_MAJOR >= 2
  return c10::Error(std::move(message), /*backtrace=*/nullptr);
#else
  return c10::Error(std::move(message), /*backtrace=*/"");
#endif
}

#if TORCH_VERSION_MAJOR < 2
std::string optimizer_state_key(const at::Tensor& param) { return c10::guts::to_string(param.unsafeGetTensorImpl()); }
#endif

#if TORCH_VERSION_MAJOR >= 2
bool is_autocast_enabled(c10::DeviceType device) { return at::autocast::is_autocast_enabled(device); }
c10::ScalarType get_autocast_dtype(c10::DeviceType device) { return at::autocast::get_autocast_dtype(device); }
void set_autocast_enabled(c10::DeviceType device, bool enabled) { at::autocast::set_autocast_enabled(device, enabled); }
void set_autocast_dtype(c10::DeviceType device, c10::ScalarType dtype) { at::autocast::set_autocast_dtype(device, dtype); }

int64_t event_start_us(const torch::autograd::profiler::KinetoEvent& event) {
  return static_cast<int64_t>(event.startNs() / 1000);
}
int64_t event_duration_us(const torch::autograd::profiler::KinetoEvent& event) {
  return static_cast<int64_t>(event.durationNs() / 1000);
}
#else
bool is_autocast_enabled(c10::DeviceType device) {
  return device == c10::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
}
c10::ScalarType get_autocast_dtype(c10::DeviceType device) {
  return device == c10::kCUDA ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
}
void set_autocast_enabled(c10::DeviceType device, bool enabled) {
  if (device == c10::kCUDA) {
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_cpu_enabled(enabled);
  }
}
void set_autocast_dtype(c10::DeviceType device, c10::ScalarType dtype) {
  if (device == c10::kCUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
}

int64_t event_start_us(const torch::autograd::profiler::KinetoEvent& event) {
  return static_cast<int64_t>(event.startUs());
}
int64_t event_duration_us(const torch::autograd::profiler::KinetoEvent& event) {
  return static_cast<int64_t>(event.durationUs());
}
#endif

std::optional<at::Generator> backend_generator(c10::Device device) {
#if TORCH_VERSION_MAJOR >= 2
  if (!at::isPrivateUse1HooksRegistered()) return std::nullopt;
  try {
    return at::globalContext().defaultGenerator(device);
  } catch (const c10::Error&) {
    return std::nullopt;  // the backend's hooks provide no generator
  }
#else
  (void)device;
  return std::nullopt;
#endif
}

std::optional<at::Tensor> fused_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                          const std::optional<at::Tensor>& mask, double dropout_p, bool is_causal,
                                          std::optional<double> scale) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  return at::scaled_dot_product_attention(query, key, value, mask, dropout_p, is_causal, scale);
#else
  (void)query, (void)key, (void)value, (void)mask, (void)dropout_p, (void)is_causal, (void)scale;
  return std::nullopt;
#endif
}

}  // namespace accelerate::detail::compat
