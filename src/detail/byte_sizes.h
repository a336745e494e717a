// Sizes in bytes as the project's messages write them: "1 GiB", "512 MiB", "64 KiB", "1000 bytes".
#pragma once

#include <cstddef>
#include <string>

namespace accelerate::detail {

/// `bytes` in the largest of GiB, MiB and KiB that divides it exactly, else in bytes.
inline std::string bytes_text(size_t bytes) {
  if (bytes >= (size_t{1} << 30) && bytes % (size_t{1} << 30) == 0) return std::to_string(bytes >> 30) + " GiB";
  if (bytes >= (size_t{1} << 20) && bytes % (size_t{1} << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (size_t{1} << 10) && bytes % (size_t{1} << 10) == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " bytes";
}

}  // namespace accelerate::detail
