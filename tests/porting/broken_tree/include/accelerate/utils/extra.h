// A second public header for tests/porting/check_refusal.cmake.
#pragma once

namespace accelerate::utils_like {

struct Indexed {};
struct MissingType {};

}  // namespace accelerate::utils_like
