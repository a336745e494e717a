// A loader's generator state as its `DataLoaderState` holds it: hexadecimal text.
#pragma once

#include <ATen/core/Generator.h>

#include <string>

namespace accelerate::detail::data {

/// The state of `generator`, as hex digits.
std::string generator_state_hex(at::Generator generator);
/// Sets `generator` from `hex` (written by `generator_state_hex`); errors start with `api`.
void set_generator_state_hex(at::Generator generator, const std::string& hex, const char* api);

}  // namespace accelerate::detail::data
