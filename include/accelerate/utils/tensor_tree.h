// Nested data made of tensors: the user's own static types walked at compile time, or
// `c10::IValue` walked at run time (upstream: `recursively_apply` and the "nested list/tuple/dict
// of tensors" that every operation accepts).
//
// Supported: `at::Tensor`; `std::vector`, `std::array`, `std::tuple`, `std::pair`,
// `std::optional`, `std::map`, `torch::OrderedDict`, `torch::data::Example` of supported types;
// `c10::IValue` (tensors, lists, tuples, dicts); any user struct with a `TensorTree`
// specialisation. Other values (numbers, strings, …) are leaves that operations leave alone (or
// refuse, on request). Unordered maps are refused at compile time: their iteration order differs
// between processes, and every process must visit tensors in the same order.
//
// Example (a user struct):
//   struct Batch { at::Tensor input; at::Tensor target; int64_t step; };
//   template <> struct accelerate::TensorTree<Batch> {
//     template <typename F> static Batch map(const Batch& b, F&& f) {
//       return {f(b.input), f(b.target), f(b.step)};
//     }
//   };
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/data/example.h>
#include <torch/ordered_dict.h>
#include <c10/util/Type.h>

#include <array>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

namespace accelerate {

/// Specialise for a user struct: `map(value, f)` returns a copy with `f` applied to every member
/// that may hold tensors (members of any supported type, tensors included).
template <typename T>
struct TensorTree;

namespace tree_detail {

template <typename T> struct is_vector : std::false_type {};
template <typename T, typename A> struct is_vector<std::vector<T, A>> : std::true_type {};
template <typename T> struct is_array : std::false_type {};
template <typename T, size_t N> struct is_array<std::array<T, N>> : std::true_type {};
template <typename T> struct is_tuple_like : std::false_type {};
template <typename... Ts> struct is_tuple_like<std::tuple<Ts...>> : std::true_type {};
template <typename A, typename B> struct is_tuple_like<std::pair<A, B>> : std::true_type {};
template <typename T> struct is_optional : std::false_type {};
template <typename T> struct is_optional<std::optional<T>> : std::true_type {};
template <typename T> struct is_std_map : std::false_type {};
template <typename K, typename V, typename C, typename A> struct is_std_map<std::map<K, V, C, A>> : std::true_type {};
template <typename T> struct is_unordered_map : std::false_type {};
template <typename K, typename V, typename H, typename E, typename A>
struct is_unordered_map<std::unordered_map<K, V, H, E, A>> : std::true_type {};
template <typename T> struct is_ordered_dict : std::false_type {};
template <typename K, typename V> struct is_ordered_dict<torch::OrderedDict<K, V>> : std::true_type {};
template <typename T> struct is_example : std::false_type {};
template <typename D, typename T> struct is_example<torch::data::Example<D, T>> : std::true_type {};
template <typename T, typename = void> struct has_tree : std::false_type {};
template <typename T> struct has_tree<T, std::void_t<decltype(sizeof(TensorTree<T>))>> : std::true_type {};
template <typename> inline constexpr bool dependent_false = false;

template <typename K>
bool key_skipped(const K& key, const std::vector<std::string>* skip_keys) {
  if constexpr (std::is_convertible_v<const K&, std::string>) {
    if (skip_keys == nullptr) return false;
    for (const auto& s : *skip_keys) {
      if (s == std::string(key)) return true;
    }
  }
  return false;
}

}  // namespace tree_detail

/// What a walk does with each leaf: `tensor` transforms tensors; `other` is told about every
/// non-tensor leaf (by type name) and may throw; `skip_keys` leaves map entries with those
/// string keys untouched.
struct TreeVisitor {
  std::function<at::Tensor(const at::Tensor&)> tensor;
  std::function<void(const char* type_name)> other;
  const std::vector<std::string>* skip_keys = nullptr;
};

/// Applies `visitor` to every leaf of `ivalue`, returning the same structure with tensors replaced.
c10::IValue map_ivalue(const c10::IValue& ivalue, const TreeVisitor& visitor);

/// Applies `visitor` to every leaf of `data` in a fixed order, returning the same type with every
/// tensor replaced by `visitor.tensor(tensor)`.
template <typename T>
T map_tree(const T& data, const TreeVisitor& visitor) {
  using namespace tree_detail;
  using U = std::remove_cv_t<std::remove_reference_t<T>>;
  if constexpr (std::is_same_v<U, at::Tensor>) {
    return visitor.tensor(data);
  } else if constexpr (std::is_same_v<U, c10::IValue>) {
    return map_ivalue(data, visitor);
  } else if constexpr (is_unordered_map<U>::value) {
    static_assert(dependent_false<U>,
                  "accelerate: unordered maps cannot be nested data: their order differs between processes, and "
                  "every process must visit tensors in the same order. Use std::map or torch::OrderedDict.");
  } else if constexpr (is_vector<U>::value) {
    U out;
    out.reserve(data.size());
    for (const auto& e : data) out.push_back(map_tree(e, visitor));
    return out;
  } else if constexpr (is_array<U>::value) {
    U out;
    for (size_t i = 0; i < data.size(); ++i) out[i] = map_tree(data[i], visitor);
    return out;
  } else if constexpr (is_tuple_like<U>::value) {
    return std::apply([&](const auto&... e) { return U{map_tree(e, visitor)...}; }, data);
  } else if constexpr (is_optional<U>::value) {
    return data ? U(map_tree(*data, visitor)) : U();
  } else if constexpr (is_std_map<U>::value) {
    U out;
    for (const auto& [k, v] : data) out.emplace(k, key_skipped(k, visitor.skip_keys) ? v : map_tree(v, visitor));
    return out;
  } else if constexpr (is_ordered_dict<U>::value) {
    U out(data.key_description());
    for (const auto& item : data) {
      out.insert(item.key(), key_skipped(item.key(), visitor.skip_keys) ? item.value() : map_tree(item.value(), visitor));
    }
    return out;
  } else if constexpr (is_example<U>::value) {
    if constexpr (std::is_void_v<typename U::TargetType>) {
      return U(map_tree(data.data, visitor));
    } else {
      return U(map_tree(data.data, visitor), map_tree(data.target, visitor));
    }
  } else if constexpr (has_tree<U>::value) {
    return TensorTree<U>::map(data, [&](const auto& member) { return map_tree(member, visitor); });
  } else {
    if (visitor.other) visitor.other(c10::demangle(typeid(U).name()).c_str());
    return data;
  }
}

/// Calls `fn` on every tensor of `data`, in the order every operation visits them.
template <typename T>
void for_each_tensor(const T& data, const std::function<void(const at::Tensor&)>& fn) {
  TreeVisitor visitor;
  visitor.tensor = [&](const at::Tensor& t) {
    fn(t);
    return t;
  };
  (void)map_tree(data, visitor);
}

/// Every tensor of `data`, in visiting order.
template <typename T>
std::vector<at::Tensor> flatten_tensors(const T& data) {
  std::vector<at::Tensor> out;
  for_each_tensor(data, [&](const at::Tensor& t) { out.push_back(t); });
  return out;
}

/// `data` with its tensors replaced, in visiting order, by `tensors` (which must have as many).
template <typename T>
T unflatten_tensors(const T& data, const std::vector<at::Tensor>& tensors) {
  size_t next = 0;
  TreeVisitor visitor;
  visitor.tensor = [&](const at::Tensor&) {
    TORCH_CHECK_INDEX(next < tensors.size(), "[unflatten_tensors] the structure holds more tensors than the ",
                      tensors.size(), " given");
    return tensors[next++];
  };
  T out = map_tree(data, visitor);
  TORCH_CHECK_VALUE(next == tensors.size(), "[unflatten_tensors] the structure holds ", next, " tensors, but ",
                    tensors.size(), " were given");
  return out;
}

/// Applies `fn` to every tensor of `data`, raising a `TypeError` that names `api` on any
/// non-tensor leaf.
template <typename T>
T map_tensors_strict(const char* api, const std::function<at::Tensor(const at::Tensor&)>& fn, const T& data) {
  TreeVisitor visitor;
  visitor.tensor = fn;
  visitor.other = [api](const char* type_name) {
    C10_THROW_ERROR(TypeError, c10::str("[", api, "] unsupported type (", type_name,
                                        ") in nested data: only tensors nested in vectors, arrays, tuples, pairs, "
                                        "optionals, maps and TensorTree structs are accepted"));
  };
  return map_tree(data, visitor);
}

/// Applies `fn` to every tensor of `data` and returns the same structure (upstream:
/// `recursively_apply`). With `error_on_other_type`, a non-tensor leaf raises a `TypeError`.
template <typename T>
T recursively_apply(const std::function<at::Tensor(const at::Tensor&)>& fn, const T& data,
                    bool error_on_other_type = false) {
  if (error_on_other_type) return map_tensors_strict("recursively_apply", fn, data);
  TreeVisitor visitor;
  visitor.tensor = fn;
  return map_tree(data, visitor);
}

}  // namespace accelerate
