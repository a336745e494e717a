// Reading and writing the safetensors format (https://github.com/huggingface/safetensors): an
// 8-byte little-endian header length, a UTF-8 JSON header mapping each tensor name to its dtype,
// shape and byte range (plus an optional "__metadata__" object of strings), then the raw
// little-endian bytes of every tensor, back to back. Files written here load in Python's
// `safetensors.torch.load_file` and the other way round.
//
// The reader maps the file into memory and returns tensors as zero-copy views of the mapping
// where the dtype's alignment allows (the mapping stays alive while any view does); it checks
// every rule of the format before handing out a byte, and rejects a malformed file with a
// ValueError naming the rule that was broken. Nothing in a file is executed.
//
// Example:
//   accelerate::save_file({{"weight", w}, {"bias", b}}, "model.safetensors", {{"format", "pt"}});
//   auto tensors = accelerate::load_file("model.safetensors");          // name -> tensor
//   accelerate::SafetensorsFile file("model.safetensors");             // lazy access
//   for (const auto& name : file.keys()) use(file.get_tensor(name));
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace accelerate {

namespace detail {
struct SafetensorsMapping;
}  // namespace detail

/// Name -> tensor, ordered by name (upstream: the `dict` of `save_file` / `load_file`).
using TensorMap = std::map<std::string, at::Tensor>;
/// The file's "__metadata__": string keys to string values.
using SafetensorsMetadata = std::map<std::string, std::string>;

/// The safetensors name of a LibTorch dtype ("F32", "BF16", "BOOL", …, "C64" for complex float).
/// Raises a ValueError for dtypes the format has no name for (complex double and half, the
/// quantized types).
std::string safetensors_dtype_name(c10::ScalarType dtype);
/// The LibTorch dtype of a safetensors dtype name. Raises a ValueError for names the format does
/// not define and for those LibTorch cannot represent (e.g. "U16", "F8_E4M3").
c10::ScalarType safetensors_dtype(const std::string& name);

/// Where one tensor lies in a file.
struct SafetensorsEntry {
  std::string dtype;               ///< safetensors dtype name, e.g. "F32"
  std::vector<int64_t> shape;      ///< empty for a 0-dim tensor
  uint64_t begin = 0;              ///< byte offset in the data section (after the header)
  uint64_t end = 0;                ///< one past the last byte
};

/// The bytes of a safetensors file: `save_file` writes them, Python's `safetensors.torch.save`
/// returns the same (metadata keys come sorted here; Python orders several of them arbitrarily,
/// which readers ignore). Tensors are written contiguous and little-endian, sorted by decreasing
/// element size (equal sizes in the reference implementation's dtype order: I64, F64, C64, then
/// F32, I32, …) then name, so that every tensor's data starts at a multiple of its element
/// size; the header is padded with spaces to a multiple of 8 bytes. Tensors may live on any device (they
/// are copied to the CPU). Raises a ValueError for an unsupported dtype (naming the tensor), a
/// sparse or quantized tensor, or an empty name or one starting with "__metadata__".
std::string save(const TensorMap& tensors, const SafetensorsMetadata& metadata = {});
/// Writes `save(tensors, metadata)` to `path`. With `fsync` the file is flushed to the disk
/// before returning. Raises a std::runtime_error naming the path and the system error when the
/// file cannot be written (nothing is left behind under `path` then — the bytes go to a
/// temporary file in the same folder that is renamed into place).
void save_file(const TensorMap& tensors, const std::string& path, const SafetensorsMetadata& metadata = {},
               bool fsync = true);
/// The tensors of an in-memory file (copies, owned by the result).
TensorMap load(const std::string& bytes);
/// The tensors of a file, on `device` (upstream: `load_file`). On the CPU these are what
/// `SafetensorsFile::get_tensor` returns: views of the mapped file where aligned (they
/// keep it mapped), copies otherwise; on other devices, copies.
TensorMap load_file(const std::string& path, const c10::Device& device = c10::kCPU);

/// A safetensors file opened for lazy access (upstream: `safe_open(path, framework="pt")`).
/// Opening validates the whole header and the file size; tensors are read on request.
/// Cheap to copy; copies share the mapping.
class SafetensorsFile {
 public:
  /// Opens and validates `path`. Raises a ValueError naming the path and the broken rule.
  explicit SafetensorsFile(const std::string& path);
  /// Validates an in-memory file (the bytes are copied).
  static SafetensorsFile from_bytes(std::string bytes);

  /// Tensor names, sorted.
  std::vector<std::string> keys() const;
  /// Whether the file holds a tensor `name`.
  bool contains(const std::string& name) const;
  /// The "__metadata__" object (empty when the file has none).
  const SafetensorsMetadata& metadata() const;
  /// Dtype, shape and byte range of `name`; raises a ValueError for an unknown name.
  const SafetensorsEntry& entry(const std::string& name) const;
  /// The tensor `name` on `device`. On the CPU this is a view of the mapped file when the data
  /// is aligned for its dtype and a copy otherwise. The mapping is private: writing into a view
  /// copies the pages touched and never changes the file. Raises a ValueError for an unknown name.
  at::Tensor get_tensor(const std::string& name, const c10::Device& device = c10::kCPU) const;
  /// Owned copies of the tensors `names` (every tensor when empty) on `device`: what
  /// `get_tensor(name).clone()` gives, read in bulk (several threads for large batches, without
  /// filling the caches). Raises a ValueError for an unknown name.
  TensorMap read_tensors(const std::vector<std::string>& names = {}, const c10::Device& device = c10::kCPU) const;
  /// Copies the tensors named by the keys of `targets` into them, as `target.copy_(get_tensor(name))`
  /// would (the dtype is converted), but in bulk: a contiguous CPU target of the file's dtype is
  /// filled straight from the file, several threads sharing large batches. Every name, shape and
  /// target is checked before anything is written; a mismatch raises a ValueError naming the tensor.
  ///
  /// Example:
  ///   accelerate::SafetensorsFile file("model.safetensors");
  ///   file.read_into({{"weight", linear->weight}, {"bias", linear->bias}});
  void read_into(const TensorMap& targets) const;
  /// Size of the file in bytes.
  uint64_t file_size() const;
  /// The path given to the constructor ("<memory>" for `from_bytes`).
  const std::string& path() const;

 private:
  explicit SafetensorsFile(std::shared_ptr<const detail::SafetensorsMapping> mapping);
  std::shared_ptr<const detail::SafetensorsMapping> mapping_;
};

}  // namespace accelerate
