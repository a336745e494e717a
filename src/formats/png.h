// A PNG encoder for the images trackers record, without zlib: 8-bit RGB or RGBA, stored
// (uncompressed) deflate blocks.
#pragma once

#include <cstdint>
#include <string>

namespace accelerate::detail::png {

/// An 8-bit RGB or RGBA PNG of `pixels` (rows of width * channels bytes).
std::string encode_png(const std::string& pixels, int64_t height, int64_t width, int64_t channels);

}  // namespace accelerate::detail::png
