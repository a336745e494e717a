// The metadata of torch.distributed.checkpoint (DCP) folders without LibTorch: the pickled
// `.metadata` file read into what a loader needs (each tensor's whole shape and dtype, its chunks
// and where each chunk's bytes lie; each non-tensor value's bytes; each key's path in the nested
// state dict), and written back so that PyTorch's `dcp.load` reads it. The items' bytes are
// torch.save archives, read by checkpoint/dcp_state.cpp. See Note [DCP folders] in dcp.cpp.
// Rejections are ValueErrors (detail/check.h); the fuzz target builds this file alone with the
// pickle reader.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace accelerate::detail::dcp {

/// Where an item's bytes lie: a file of the folder, an offset and a length in it.
struct Location {
  std::string file;
  uint64_t offset = 0;
  uint64_t length = 0;
};

/// A box of a tensor saved by one process: its offset and size in each dimension, and its bytes.
struct Chunk {
  std::vector<int64_t> offsets, sizes;
  Location where;
};

/// A tensor of the state dict: its dtype (PyTorch's name without "torch.": "float32"), whole
/// shape and chunks (which cover it exactly once).
struct TensorEntry {
  std::string dtype;
  std::vector<int64_t> size;
  std::vector<Chunk> chunks;
};

/// One step of a key's path in the nested state dict: a dict key or a list index.
using PathStep = std::variant<std::string, int64_t>;

/// What a `.metadata` file says. Keys are the flattened state dict's ("model.0.weight",
/// "optimizer.param_groups.0.lr").
struct Metadata {
  std::map<std::string, TensorEntry> tensors;
  std::map<std::string, Location> values;           ///< non-tensor values, each a torch.save archive
  std::map<std::string, std::vector<PathStep>> paths;  ///< each key's path (planner_data); may be empty
};

/// The largest `.metadata` file read, in bytes.
inline constexpr uint64_t kMaxMetadataSize = uint64_t{1} << 30;

/// Reads a `.metadata` pickle (PyTorch 2.0 to 2.14's `Metadata`). Only the classes of
/// torch.distributed.checkpoint's metadata, torch.Size, dtypes, the strided layout, memory formats
/// and pathlib's paths (in `storage_meta`, not read) are accepted; anything else is refused by
/// name. Refuses a chunk outside its tensor, chunks that do not add up to the tensor, a chunk or
/// value without its bytes' location, a file name that is not a plain name in the folder, and
/// items written through transforms (DCP's compression extensions).
Metadata read_metadata(std::string_view pickled);

/// Checks that every item lies within its file, given the size of each file of the folder
/// (refusing a file that is named but absent).
void check_locations(const Metadata& metadata, const std::map<std::string, uint64_t>& file_sizes);

/// `metadata` as the pickle PyTorch writes (protocol 2), readable by `dcp.load`: Metadata,
/// TensorStorageMetadata, BytesStorageMetadata, MetadataIndex, _StorageInfo objects.
std::string write_metadata(const Metadata& metadata);

/// The file process `rank` writes its items to: "__<rank>_0.distcp".
std::string data_file(int rank);

}  // namespace accelerate::detail::dcp
