// The library's definitions of detail/check.h: LibTorch's exceptions, as everywhere else in it.
#include "detail/check.h"

#include <c10/util/Exception.h>

namespace accelerate::detail {

void raise_value_error(const std::string& message) { C10_THROW_ERROR(ValueError, message); }

void raise_error(const std::string& message) { C10_THROW_ERROR(Error, message); }

std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

}  // namespace accelerate::detail
