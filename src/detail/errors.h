// Small helpers for turning exceptions into the one-line messages users see.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace accelerate::detail {

/// The message of an exception without LibTorch's C++ backtrace.
inline std::string error_message(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

}  // namespace accelerate::detail
