// Small type traits shared by the public headers (which object a `std::shared_ptr` holds).
#pragma once

#include <memory>
#include <type_traits>

namespace accelerate::traits {

/// Whether `T` is a `std::shared_ptr`.
template <typename T>
struct is_shared_ptr : std::false_type {};
template <typename T>
struct is_shared_ptr<std::shared_ptr<T>> : std::true_type {};

/// The element type of a `std::shared_ptr`, or `Otherwise` for any other type.
template <typename T, typename Otherwise>
struct pointee {
  using type = Otherwise;
};
template <typename T, typename Otherwise>
struct pointee<std::shared_ptr<T>, Otherwise> {
  using type = T;
};

}  // namespace accelerate::traits
