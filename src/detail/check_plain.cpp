// The `accelerate` executable's definitions of detail/check.h: standard exceptions, since it
// does not link LibTorch.
#include "detail/check.h"

#include <stdexcept>

namespace accelerate::detail {

void raise_value_error(const std::string& message) { throw std::invalid_argument(message); }

void raise_error(const std::string& message) { throw std::runtime_error(message); }

std::string error_text(const std::exception& e) { return e.what(); }

}  // namespace accelerate::detail
