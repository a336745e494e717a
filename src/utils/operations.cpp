// Non-template parts of the operations over nested data; see include/accelerate/utils/operations.h.
#include "accelerate/utils/operations.h"

#include "detail/collectives.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <sstream>

namespace accelerate {

c10::IValue map_ivalue(const c10::IValue& ivalue, const TreeVisitor& visitor) {
  if (ivalue.isTensor()) return visitor.tensor(ivalue.toTensor());
  if (ivalue.isTensorList()) {
    c10::List<at::Tensor> out;
    for (auto&& t : ivalue.toTensorList()) out.push_back(visitor.tensor(t));
    return out;
  }
  if (ivalue.isList()) {
    auto list = ivalue.toList();
    c10::impl::GenericList out(list.elementType());
    out.reserve(list.size());
    for (auto&& e : list) out.push_back(map_ivalue(e, visitor));
    return out;
  }
  if (ivalue.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const auto& e : ivalue.toTupleRef().elements()) elements.push_back(map_ivalue(e, visitor));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  if (ivalue.isGenericDict()) {
    auto dict = ivalue.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& entry : dict) {
      const bool skipped = visitor.skip_keys != nullptr && entry.key().isString() &&
                           std::find(visitor.skip_keys->begin(), visitor.skip_keys->end(),
                                     entry.key().toStringRef()) != visitor.skip_keys->end();
      out.insert(entry.key(), skipped ? entry.value() : map_ivalue(entry.value(), visitor));
    }
    return out;
  }
  if (ivalue.isNone()) return ivalue;
  if (visitor.other) visitor.other(ivalue.tagKind().c_str());
  return ivalue;
}

namespace detail {

// See Note [Debug-mode collective check] in src/detail/collectives.cpp. The whole operation is
// compared at once, as one signature tensor: [count, then per tensor dtype, device, rank, sizes].
void verify_operation(const PartialState& state, const char* api, const std::vector<at::Tensor>& tensors,
                      bool exact_shapes) {
  if (!state.debug() || !state.use_distributed()) return;
  std::ostringstream signature;
  signature << tensors.size() << " tensor(s)";
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    signature << (i == 0 ? ": " : "; ") << "dtype " << t.scalar_type() << " device " << t.device();
    if (exact_shapes) {
      signature << " shape " << t.sizes();
    } else {
      signature << " dims " << t.dim();
    }
  }
  verify_signature(state, api, signature.str(),
                   exact_shapes ? "pass the same number of tensors with the same dtype, device and shape"
                                : "pass the same number of tensors with the same dtype, device and number of dimensions");
}

at::Tensor gather_one(const PartialState& state, const at::Tensor& tensor) {
  const at::Tensor t = tensor.dim() == 0 ? tensor.unsqueeze(0) : tensor;
  if (!state.use_distributed()) return t;
  return all_gather_cat(state, t, "gather");
}

at::Tensor reduce_one(const PartialState& state, const at::Tensor& tensor, const std::string& reduction, double scale) {
  at::Tensor out = all_reduce(state, tensor, parse_reduction(reduction, "reduce"), "reduce");
  if (scale != 1.0) out = out.is_floating_point() ? out.mul_(scale) : out.mul(scale);
  return out;
}

at::Tensor broadcast_one(const PartialState& state, const at::Tensor& tensor, int from_process) {
  return broadcast(state, tensor, from_process, "broadcast");
}

at::Tensor pad_one(const PartialState& state, const at::Tensor& tensor, int64_t dim, double pad_index, bool pad_first) {
  const int64_t ndim = tensor.dim();
  if (dim >= ndim || dim < -ndim) return tensor;
  if (dim < 0) dim += ndim;
  if (!state.use_distributed()) return tensor;
  const auto sizes = all_gather(state, at::tensor(tensor.sizes().vec(), at::kLong), "pad_across_processes");
  int64_t max_size = 0;
  for (const auto& s : sizes) max_size = std::max(max_size, s[dim].item<int64_t>());
  const int64_t old = tensor.size(dim);
  if (max_size == old) return tensor;
  auto new_size = tensor.sizes().vec();
  new_size[dim] = max_size;
  at::Tensor out = at::full(new_size, pad_index, tensor.options());
  out.narrow(dim, pad_first ? max_size - old : 0, old).copy_(tensor);
  return out;
}

std::vector<c10::IValue> gather_ivalues(const PartialState& state, const c10::IValue& value) {
  return all_gather_ivalue(state, value, "gather_object");
}

c10::IValue broadcast_ivalue_from(const PartialState& state, const c10::IValue& value, int from_process) {
  TORCH_CHECK_INDEX(from_process >= 0 && from_process < state.num_processes(), "[broadcast_object_list] from_process ",
                    from_process, " is outside [0, ", state.num_processes(), ")");
  return broadcast_ivalue(state, value, from_process, "broadcast_object_list");
}

}  // namespace detail

std::vector<c10::IValue> gather_object(const PartialState& state, const c10::IValue& object) {
  std::vector<c10::IValue> out;
  for (const auto& v : detail::all_gather_ivalue(state, object, "gather_object")) {
    if (v.isList()) {
      for (const auto& e : v.toList()) out.push_back(e);
    } else {
      out.push_back(v);
    }
  }
  return out;
}

at::Tensor copy_tensor_to_devices(const PartialState& state, const at::Tensor& tensor) {
  if (!state.use_distributed()) {
    TORCH_CHECK_VALUE(tensor.defined(), "[copy_tensor_to_devices] the only process has no tensor to copy");
    return tensor;
  }
  const auto owners = detail::all_gather(state, at::tensor({tensor.defined() ? 1 : 0}, at::kInt),
                                         "copy_tensor_to_devices");
  int owner = -1;
  int count = 0;
  for (int i = 0; i < static_cast<int>(owners.size()); ++i) {
    if (owners[i].item<int>() == 1) {
      owner = owner < 0 ? i : owner;
      ++count;
    }
  }
  TORCH_CHECK_VALUE(count == 1, "[copy_tensor_to_devices] exactly one process must hold the tensor (the others pass "
                    "an undefined tensor), but ", count, " processes hold one");
  const auto value = detail::broadcast_ivalue(state, tensor.defined() ? c10::IValue(tensor) : c10::IValue(), owner,
                                              "copy_tensor_to_devices");
  return value.toTensor().to(state.device());
}

c10::IValue listify(const at::Tensor& tensor) {
  const at::Tensor t = tensor.cpu();
  if (t.dim() == 0) {
    if (t.is_floating_point()) return t.item<double>();
    if (t.scalar_type() == at::kBool) return t.item<bool>();
    return t.item<int64_t>();
  }
  if (t.dim() == 1) {
    if (t.is_floating_point()) {
      auto d = t.to(at::kDouble).contiguous();
      return c10::List<double>(std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel()));
    }
    if (t.scalar_type() == at::kBool) {
      c10::List<bool> out;
      for (int64_t i = 0; i < t.size(0); ++i) out.push_back(t[i].item<bool>());
      return out;
    }
    auto l = t.to(at::kLong).contiguous();
    return c10::List<int64_t>(std::vector<int64_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel()));
  }
  c10::impl::GenericList out(c10::AnyType::get());
  for (int64_t i = 0; i < t.size(0); ++i) out.push_back(listify(t[i]));
  return out;
}

c10::IValue listify(const c10::IValue& data) {
  if (data.isTensor()) return listify(data.toTensor());
  if (data.isTensorList() || data.isList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    for (auto&& e : data.toList()) out.push_back(listify(e));
    return out;
  }
  if (data.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const auto& e : data.toTupleRef().elements()) elements.push_back(listify(e));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  if (data.isGenericDict()) {
    auto dict = data.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), c10::AnyType::get());
    for (const auto& entry : dict) out.insert(entry.key(), listify(entry.value()));
    return out;
  }
  return data;
}

}  // namespace accelerate
