// Raising and describing errors in the sources the launcher shares with the library; see
// Note [The launcher without LibTorch] in src/launch/CMakeLists.txt.
//
// These sources are compiled once and linked twice: into the library, where the two functions
// below throw LibTorch's c10::ValueError and c10::Error as the rest of the library does, and into
// the `accelerate` executable, which does not link LibTorch, where they throw
// std::invalid_argument and std::runtime_error. Each binary links exactly one definition
// (check_torch.cpp or check_plain.cpp).
#pragma once

#include <exception>
#include <sstream>
#include <string>

namespace accelerate::detail {

/// Throws the error of a bad value given by the user (c10::ValueError in the library).
[[noreturn]] void raise_value_error(const std::string& message);

/// Throws the error of a failed operation (c10::Error in the library).
[[noreturn]] void raise_error(const std::string& message);

/// The message of `e` as users see it (without LibTorch's C++ backtrace).
std::string error_text(const std::exception& e);

/// The parts written one after the other, as `std::ostream` writes them.
template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

}  // namespace accelerate::detail

/// Throws a value error made of the message parts unless `condition` holds.
#define ACCELERATE_CHECK_VALUE(condition, ...)                                                            \
  do {                                                                                                    \
    if (!(condition)) ::accelerate::detail::raise_value_error(::accelerate::detail::concat(__VA_ARGS__)); \
  } while (false)

/// Throws an error made of the message parts unless `condition` holds.
#define ACCELERATE_CHECK(condition, ...)                                                            \
  do {                                                                                              \
    if (!(condition)) ::accelerate::detail::raise_error(::accelerate::detail::concat(__VA_ARGS__)); \
  } while (false)
