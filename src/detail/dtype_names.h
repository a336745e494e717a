// Dtype names as PyTorch and NumPy spell them ("float32", "bfloat16", …): the dtypes of offload
// `index.json` files (NumPy's names), and the names messages give a dtype. Shared by the offload
// folder code (utils/offload.cpp), loading into a module and checkpoint loading.
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

namespace accelerate::detail {

/// NumPy's name of `type`; a ValueError for dtypes an offload folder cannot hold.
std::string numpy_dtype_name(c10::ScalarType type);
/// The dtype's name as PyTorch and NumPy spell it ("float32", "int32", "bfloat16"; LibTorch's
/// name for a dtype neither has), for messages.
std::string dtype_name(c10::ScalarType type);
/// The dtype NumPy calls `name`; a ValueError naming `where` for an unknown name.
c10::ScalarType numpy_dtype(const std::string& name, const std::string& where);

}  // namespace accelerate::detail
