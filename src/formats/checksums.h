// The CRC-32 family the file formats need, table-driven.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace accelerate::detail::checksums {

// A table-driven CRC-32 over the reflected polynomial `Poly`, starting from all ones and inverted at
// the end: 0xEDB88320 is zlib's CRC-32 (PNG chunks), 0x82F63B78 is CRC-32C (TFRecord framing).
template <uint32_t Poly>
inline uint32_t reflected_crc32(const unsigned char* data, size_t size) {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t n = 0; n < 256; ++n) {
      uint32_t c = n;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? Poly ^ (c >> 1) : c >> 1;
      t[n] = c;
    }
    return t;
  }();
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < size; ++i) c = table[(c ^ data[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

}  // namespace accelerate::detail::checksums
