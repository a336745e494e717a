// Dtype names of offload folders and messages; see dtype_names.h.
#include "detail/dtype_names.h"

#include <c10/util/Exception.h>

namespace accelerate::detail {

namespace {

struct OffloadDtypeName {
  c10::ScalarType type;
  const char* name;
};

constexpr OffloadDtypeName kDtypes[] = {
    {c10::kFloat, "float32"},
    {c10::kDouble, "float64"},
    {c10::kHalf, "float16"},
    {c10::kBFloat16, "bfloat16"},
    {c10::kLong, "int64"},
    {c10::kInt, "int32"},
    {c10::kShort, "int16"},
    {c10::kChar, "int8"},
    {c10::kByte, "uint8"},
    {c10::kBool, "bool"},
    {c10::kComplexFloat, "complex64"},
    {c10::kComplexDouble, "complex128"},
};

}  // namespace

std::string numpy_dtype_name(c10::ScalarType type) {
  for (const auto& d : kDtypes) {
    if (d.type == type) return d.name;
  }
  TORCH_CHECK_VALUE(false, "[offload] dtype ", type, " cannot be offloaded");
}

std::string dtype_name(c10::ScalarType type) {
  for (const auto& d : kDtypes) {
    if (d.type == type) return d.name;
  }
  return c10::toString(type);
}

c10::ScalarType numpy_dtype(const std::string& name, const std::string& where) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.type;
  }
  TORCH_CHECK_VALUE(false, "[offload] ", where, ": unknown dtype '", name, "'");
}

}  // namespace accelerate::detail
