// The safetensors format without LibTorch: validating a file's header and laying out a new one.
// Everything here depends only on the standard library and nlohmann_json, so the fuzz target
// (fuzz/) builds it alone in seconds; src/utils/safetensors.cpp wraps it for tensors. Rejections
// are std::invalid_argument with a message naming the broken rule (the caller adds the path).
// See Note [Safetensors validation] in safetensors.cpp for the rules.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace accelerate::detail::safetensors_format {

/// The largest header the format accepts, in bytes (the reference implementation's limit).
inline constexpr uint64_t kMaxHeaderSize = 100'000'000;

/// A dtype the format defines.
struct DtypeInfo {
  std::string_view name;  ///< e.g. "F32"
  int bits;               ///< bits per element: 4, 6, 8, 16, 32 or 64
  int rank;               ///< position in the reference implementation's order (grows with `bits`)
};

/// The format's definition of `name`, or nullptr when the format has no such dtype.
const DtypeInfo* find_dtype(std::string_view name);

/// One tensor of a header.
struct Entry {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  ///< byte offset in the data section
  uint64_t end = 0;    ///< one past the last byte
};

/// A validated header.
struct Header {
  std::map<std::string, Entry> entries;
  std::map<std::string, std::string> metadata;
  uint64_t header_size = 0;  ///< the header's length in bytes, padding included
  uint64_t data_size = 0;    ///< bytes after the header; the entries tile them exactly

  /// Offset of the data section in the file.
  uint64_t data_offset() const { return 8 + header_size; }
};

/// Validates a whole file held in memory: header length, UTF-8, JSON schema, dtypes, shapes,
/// offsets and the file size. Throws std::invalid_argument naming the broken rule.
Header parse(std::string_view file);

/// Whether `text` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
bool is_valid_utf8(std::string_view text);

/// `text` in single quotes for an error message: control bytes (and every byte of a string that
/// is not UTF-8) escaped as \xNN, cut after 120 characters.
std::string printable(std::string_view text);

/// One tensor to be written.
struct TensorSpec {
  std::string name;
  std::string dtype;  ///< a name `find_dtype` knows
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;
};

/// Where the tensors of a new file go.
struct Layout {
  std::string prefix;         ///< the 8-byte header length followed by the padded header
  std::vector<size_t> order;  ///< indices into the specs, in the order their bytes follow the prefix
  uint64_t data_size = 0;     ///< total bytes of tensor data
};

/// Lays out a new file: tensors by decreasing dtype rank then name (so every tensor is aligned to
/// its element size), a compact JSON header with "__metadata__" first when non-empty, padded with
/// spaces so that the data starts at a multiple of 8. Throws std::invalid_argument for an empty,
/// duplicate or reserved name, a string that is not UTF-8, an unknown dtype, a size that does
/// not match the shape, or a header past `kMaxHeaderSize`.
Layout plan(const std::vector<TensorSpec>& tensors, const std::map<std::string, std::string>& metadata);

}  // namespace accelerate::detail::safetensors_format
