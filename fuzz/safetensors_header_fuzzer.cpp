// libFuzzer target for the safetensors header parser (src/formats/safetensors.*): any input
// must either be rejected with std::invalid_argument or be accepted as a file whose tensors tile
// its data exactly; an accepted file's tensors, laid out again by the writer, must parse back to
// the same dtypes, shapes and metadata, each tensor aligned to its element size. Any other
// exception, sanitizer report or broken invariant is a crash.
#include "formats/safetensors.h"

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace format = accelerate::detail::safetensors_format;

namespace {

void require(bool condition, const char* what) {
  if (!condition) {
    std::fprintf(stderr, "invariant broken: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view file(reinterpret_cast<const char*>(data), size);
  format::Header header;
  try {
    header = format::parse(file);
  } catch (const std::invalid_argument&) {
    return 0;
  }

  require(header.data_offset() + header.data_size == size, "the header and the data make up the file");
  const std::string_view text = file.substr(8, header.header_size);
  require(format::is_valid_utf8(text), "an accepted header is UTF-8");
  require(text.find('\0') == std::string_view::npos, "an accepted header has no NUL byte");
  const size_t close = text.find_last_of('}');
  require(close != std::string_view::npos && text.find_first_not_of(" \t\n\r", close + 1) == std::string_view::npos,
          "an accepted header ends with its object and whitespace");
  uint64_t total = 0;
  std::vector<format::TensorSpec> specs;
  bool writable = true;
  for (const auto& [name, entry] : header.entries) {
    require(format::find_dtype(entry.dtype) != nullptr, "accepted dtypes are defined");
    require(entry.begin <= entry.end && entry.end <= header.data_size, "ranges lie in the data");
    total += entry.end - entry.begin;
    for (int64_t dim : entry.shape) require(dim >= 0, "dimensions are non-negative");
    if (name.empty() || name.rfind("__metadata__", 0) == 0) writable = false;
    specs.push_back({name, entry.dtype, entry.shape, entry.end - entry.begin});
  }
  require(total == header.data_size, "the ranges cover the data exactly once");
  if (!writable) return 0;  // names the writer refuses but the format allows

  const format::Layout layout = format::plan(specs, header.metadata);
  require(layout.data_size == header.data_size, "the writer lays out as many bytes");
  require(layout.prefix.size() % 8 == 0, "the writer pads the header to 8 bytes");
  std::string rewritten = layout.prefix;
  rewritten.append(layout.data_size, '\0');
  const format::Header again = format::parse(rewritten);
  require(again.metadata == header.metadata, "metadata survives a round trip");
  require(again.entries.size() == header.entries.size(), "every tensor survives a round trip");
  for (const auto& [name, entry] : header.entries) {
    const auto found = again.entries.find(name);
    require(found != again.entries.end(), "names survive a round trip");
    const auto& copy = found->second;
    require(copy.dtype == entry.dtype && copy.shape == entry.shape, "dtype and shape survive a round trip");
    require(copy.end - copy.begin == entry.end - entry.begin, "sizes survive a round trip");
    const int bits = format::find_dtype(copy.dtype)->bits;
    if (bits >= 8)
      require((again.data_offset() + copy.begin) % static_cast<uint64_t>(bits / 8) == 0,
              "the writer aligns every tensor");
  }
  return 0;
}
