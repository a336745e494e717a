// Collectives and transformations over nested data (upstream: accelerate/utils/operations.py):
// gather, gather_object, reduce, broadcast, broadcast_object_list, pad_across_processes,
// concatenate, send_to_device, listify, slice_tensors, convert_to_fp32, find_batch_size,
// copy_tensor_to_devices, gather_for_metrics. Data is anything `tensor_tree.h` walks.
//
// Every collective has two forms: one on the process-wide `PartialState()` (as upstream) and one
// taking a state first, for code holding its own (e.g. ranks running as threads). In debug mode
// (`ACCELERATE_DEBUG_MODE=1`, `accelerate launch --debug`) every process first compares the
// operation, the number of tensors and each tensor's dtype, device and shape with the others,
// and on a mismatch every process raises with the values of each process. Without debug mode a
// mismatch or a missing process ends in an error within the process-group timeout.
//
// Example:
//   auto all = accelerate::gather(predictions);             // on every process: all predictions
//   auto padded = accelerate::pad_across_processes(tokens, /*dim=*/1, /*pad_index=*/0);
#pragma once

#include "accelerate/state.h"
#include "accelerate/utils/tensor_tree.h"

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <string>
#include <vector>

namespace accelerate {

namespace detail {
/// Debug-mode check of a whole operation: the operation name, the tensor count and each
/// tensor's dtype and device must agree on every process, and shapes too when `exact_shapes`.
void verify_operation(const PartialState& state, const char* api, const std::vector<at::Tensor>& tensors,
                      bool exact_shapes);
at::Tensor gather_one(const PartialState& state, const at::Tensor& tensor);
at::Tensor reduce_one(const PartialState& state, const at::Tensor& tensor, const std::string& reduction, double scale);
at::Tensor broadcast_one(const PartialState& state, const at::Tensor& tensor, int from_process);
at::Tensor pad_one(const PartialState& state, const at::Tensor& tensor, int64_t dim, double pad_index, bool pad_first);
std::vector<c10::IValue> gather_ivalues(const PartialState& state, const c10::IValue& value);
c10::IValue broadcast_ivalue_from(const PartialState& state, const c10::IValue& value, int from_process);
}  // namespace detail

// ---- gather -------------------------------------------------------------------------------------

/// Every process's tensors concatenated along the first dimension, on every process; 0-dim
/// tensors become 1-dim. Shapes must agree across processes (see `pad_across_processes`).
/// Like every collective here, non-tensor values in `data` raise a `TypeError` (use
/// `gather_object` for them).
template <typename T>
T gather(const PartialState& state, const T& data) {
  if (state.debug()) detail::verify_operation(state, "gather", flatten_tensors(data), /*exact_shapes=*/true);
  return map_tensors_strict("gather", [&](const at::Tensor& t) { return detail::gather_one(state, t); }, data);
}
/// `gather` on the process-wide state.
template <typename T>
T gather(const T& data) {
  return gather(PartialState(), data);
}

/// Every process's list of objects, concatenated in process order (upstream: `gather_object`).
/// Elements must convert to and from `c10::IValue` (numbers, strings, tensors, lists, …).
template <typename T>
std::vector<T> gather_object(const PartialState& state, const std::vector<T>& objects) {
  if (!state.use_distributed()) return objects;
  std::vector<T> out;
  for (const auto& ivalue : detail::gather_ivalues(state, c10::IValue(objects))) {
    auto part = ivalue.to<std::vector<T>>();
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}
/// `gather_object` on the process-wide state.
template <typename T>
std::vector<T> gather_object(const std::vector<T>& objects) {
  return gather_object(PartialState(), objects);
}
/// Every process's value, in process order; a value that is a list contributes its elements.
std::vector<c10::IValue> gather_object(const PartialState& state, const c10::IValue& object);

// ---- reduce and broadcast -----------------------------------------------------------------------

/// Every tensor reduced elementwise across processes by "sum", "mean", "max", "min" or "prod",
/// then multiplied by `scale`. The utility's default is "mean" (`Accelerator::reduce`'s is "sum").
template <typename T>
T reduce(const PartialState& state, const T& data, const std::string& reduction = "mean", double scale = 1.0) {
  if (state.debug()) detail::verify_operation(state, "reduce", flatten_tensors(data), /*exact_shapes=*/true);
  return map_tensors_strict(
      "reduce", [&](const at::Tensor& t) { return detail::reduce_one(state, t, reduction, scale); }, data);
}
/// `reduce` on the process-wide state.
template <typename T>
T reduce(const T& data, const std::string& reduction = "mean", double scale = 1.0) {
  return reduce(PartialState(), data, reduction, scale);
}

/// The tensors of process `from_process`, on every process (shapes and dtypes must agree).
template <typename T>
T broadcast(const PartialState& state, const T& data, int from_process = 0) {
  if (state.debug()) detail::verify_operation(state, "broadcast", flatten_tensors(data), /*exact_shapes=*/true);
  return map_tensors_strict(
      "broadcast", [&](const at::Tensor& t) { return detail::broadcast_one(state, t, from_process); }, data);
}
/// `broadcast` on the process-wide state.
template <typename T>
T broadcast(const T& data, int from_process = 0) {
  return broadcast(PartialState(), data, from_process);
}

/// Replaces `objects` in place with those of process `from_process` and returns them
/// (upstream: `broadcast_object_list`). Elements must convert to and from `c10::IValue`.
template <typename T>
std::vector<T>& broadcast_object_list(const PartialState& state, std::vector<T>& objects, int from_process = 0) {
  if (!state.use_distributed()) return objects;
  objects = detail::broadcast_ivalue_from(state, c10::IValue(objects), from_process).template to<std::vector<T>>();
  return objects;
}
/// `broadcast_object_list` on the process-wide state.
template <typename T>
std::vector<T>& broadcast_object_list(std::vector<T>& objects, int from_process = 0) {
  return broadcast_object_list(PartialState(), objects, from_process);
}

/// Copies a tensor that exists on one process only (an undefined tensor elsewhere) to every
/// process, which need not know its shape or dtype (upstream: `copy_tensor_to_devices`).
at::Tensor copy_tensor_to_devices(const PartialState& state, const at::Tensor& tensor);
/// `copy_tensor_to_devices` on the process-wide state.
inline at::Tensor copy_tensor_to_devices(const at::Tensor& tensor) {
  return copy_tensor_to_devices(PartialState(), tensor);
}

// ---- padding and concatenation ------------------------------------------------------------------

/// Pads every tensor along `dim` to the largest size any process has there, with `pad_index`,
/// at the end (or the front with `pad_first`). Tensors with fewer than `dim`+1 dims are left alone.
template <typename T>
T pad_across_processes(const PartialState& state, const T& data, int64_t dim = 0, double pad_index = 0,
                       bool pad_first = false) {
  if (state.debug()) detail::verify_operation(state, "pad_across_processes", flatten_tensors(data), /*exact_shapes=*/false);
  return map_tensors_strict(
      "pad_across_processes", [&](const at::Tensor& t) { return detail::pad_one(state, t, dim, pad_index, pad_first); },
      data);
}
/// `pad_across_processes` on the process-wide state.
template <typename T>
T pad_across_processes(const T& data, int64_t dim = 0, double pad_index = 0, bool pad_first = false) {
  return pad_across_processes(PartialState(), data, dim, pad_index, pad_first);
}

/// Concatenates a list of structures of the same shape into one structure whose tensors are
/// concatenated along `dim` (upstream: `concatenate`).
template <typename T>
T concatenate(const std::vector<T>& data, int64_t dim = 0) {
  TORCH_CHECK_VALUE(!data.empty(), "[concatenate] expected at least one element, got an empty list");
  std::vector<std::vector<at::Tensor>> columns;
  for (const auto& element : data) {
    auto tensors = flatten_tensors(element);
    if (columns.empty()) columns.resize(tensors.size());
    TORCH_CHECK_VALUE(tensors.size() == columns.size(), "[concatenate] every element must hold the same number of "
                      "tensors; the first holds ", columns.size(), ", another ", tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) columns[i].push_back(tensors[i]);
  }
  std::vector<at::Tensor> joined;
  joined.reserve(columns.size());
  for (const auto& column : columns) joined.push_back(at::cat(column, dim));
  return unflatten_tensors(data.front(), joined);
}

// ---- local transformations ----------------------------------------------------------------------

/// Moves every tensor to `device`; map entries whose key is in `skip_keys` stay where they are.
template <typename T>
T send_to_device(const T& data, c10::Device device, bool non_blocking = false,
                 const std::vector<std::string>& skip_keys = {}) {
  TreeVisitor visitor;
  visitor.tensor = [&](const at::Tensor& t) { return t.to(device, non_blocking); };
  visitor.skip_keys = &skip_keys;
  return map_tree(data, visitor);
}

/// Every tensor sliced to rows [start, end) of its first dimension (upstream: `slice_tensors`).
template <typename T>
T slice_tensors(const T& data, int64_t start, int64_t end) {
  return recursively_apply([&](const at::Tensor& t) { return t.slice(0, start, end); }, data);
}

/// fp16 and bf16 tensors converted to fp32; others unchanged (upstream: `convert_to_fp32`).
template <typename T>
T convert_to_fp32(const T& data) {
  return recursively_apply(
      [](const at::Tensor& t) {
        return (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16) ? t.to(at::kFloat) : t;
      },
      data);
}

/// Wraps `fn` so that the fp16 and bf16 tensors of its result come back as fp32 (upstream:
/// `convert_outputs_to_fp32`, what a prepared model's forward pass wears under mixed precision).
/// The wrapper takes `fn`'s arguments and returns `convert_to_fp32` of its result, by value.
///
/// Example of use: auto forward = accelerate::convert_outputs_to_fp32([&](const at::Tensor& x) { return net(x); });
template <typename Fn>
auto convert_outputs_to_fp32(Fn fn) {
  return [fn = std::move(fn)](auto&&... args) {
    return convert_to_fp32(std::invoke(fn, std::forward<decltype(args)>(args)...));
  };
}

/// The size of the first dimension of the first tensor found (upstream: `find_batch_size`).
template <typename T>
int64_t find_batch_size(const T& data) {
  const auto tensors = flatten_tensors(data);
  TORCH_CHECK_VALUE(!tensors.empty(), "[find_batch_size] can only find the batch size of tensors, but the data holds none");
  TORCH_CHECK_VALUE(tensors.front().dim() >= 1, "[find_batch_size] the first tensor is 0-dim and has no batch size");
  return tensors.front().size(0);
}

/// A tensor as nested lists of numbers, in `c10::IValue` form (upstream: `listify`).
c10::IValue listify(const at::Tensor& tensor);
/// Every tensor of an `IValue` structure converted to nested lists of numbers.
c10::IValue listify(const c10::IValue& data);

// ---- metrics ------------------------------------------------------------------------------------

/// `gather`, then, on the last batch of a data loader, drops the samples that the loader added
/// to make every process's batch equal (upstream: `Accelerator::gather_for_metrics`, using
/// `GradientState::remainder`).
template <typename T>
T gather_for_metrics(const PartialState& state, const GradientState& gradient_state, const T& data) {
  T gathered = gather(state, data);
  const int64_t remainder = gradient_state.remainder();
  if (!gradient_state.end_of_dataloader() || remainder <= 0) return gathered;
  return slice_tensors(gathered, 0, remainder);
}
/// `gather_for_metrics` for non-tensor values (upstream's `use_gather_object=True`).
template <typename T>
std::vector<T> gather_object_for_metrics(const PartialState& state, const GradientState& gradient_state,
                                         const std::vector<T>& objects) {
  auto gathered = gather_object(state, objects);
  const int64_t remainder = gradient_state.remainder();
  if (gradient_state.end_of_dataloader() && remainder > 0 && static_cast<int64_t>(gathered.size()) > remainder) {
    gathered.resize(static_cast<size_t>(remainder));
  }
  return gathered;
}

}  // namespace accelerate
