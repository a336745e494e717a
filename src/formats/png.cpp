// The PNG encoder; see png.h.
#include "formats/png.h"

#include "formats/checksums.h"

#include <algorithm>

namespace accelerate::detail::png {
namespace {

uint32_t crc32_png(const std::string& bytes) {
  return checksums::reflected_crc32<0xEDB88320u>(reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
}

void put_be32(std::string& out, uint32_t v) {
  for (int i = 3; i >= 0; --i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void png_chunk(std::string& out, const char* type, const std::string& data) {
  put_be32(out, static_cast<uint32_t>(data.size()));
  std::string typed = std::string(type, 4) + data;
  out += typed;
  put_be32(out, crc32_png(typed));
}

}  // namespace

// An 8-bit RGB or RGBA PNG of `pixels` (rows of width * channels bytes), compressed with zlib
// "stored" blocks: valid deflate, readable everywhere, no compression.
std::string encode_png(const std::string& pixels, int64_t height, int64_t width, int64_t channels) {
  std::string raw;
  const auto row = static_cast<size_t>(width * channels);
  raw.reserve(static_cast<size_t>(height) * (row + 1));
  for (int64_t y = 0; y < height; ++y) {
    raw.push_back('\0');  // filter type None
    raw.append(pixels, static_cast<size_t>(y) * row, row);
  }
  std::string zlib = {'\x78', '\x01'};
  size_t done = 0;
  do {
    const size_t n = std::min<size_t>(65535, raw.size() - done);
    zlib.push_back(done + n == raw.size() ? '\x01' : '\x00');
    zlib.push_back(static_cast<char>(n & 0xff));
    zlib.push_back(static_cast<char>(n >> 8));
    zlib.push_back(static_cast<char>(~n & 0xff));
    zlib.push_back(static_cast<char>((~n >> 8) & 0xff));
    zlib.append(raw, done, n);
    done += n;
  } while (done < raw.size());
  uint32_t a = 1, b = 0;
  for (unsigned char c : raw) {
    a = (a + c) % 65521;
    b = (b + a) % 65521;
  }
  put_be32(zlib, (b << 16) | a);

  std::string ihdr;
  put_be32(ihdr, static_cast<uint32_t>(width));
  put_be32(ihdr, static_cast<uint32_t>(height));
  ihdr += {'\x08', channels == 4 ? '\x06' : '\x02', '\x00', '\x00', '\x00'};
  std::string png = "\x89PNG\r\n\x1a\n";
  png_chunk(png, "IHDR", ihdr);
  png_chunk(png, "IDAT", zlib);
  png_chunk(png, "IEND", "");
  return png;
}

}  // namespace accelerate::detail::png
