// torch.distributed.checkpoint (DCP) folders, the tensors' side: reading the part of each tensor
// a process holds (any number of processes, any mesh) from the chunks every process of the saving
// job wrote, the non-tensor values, and writing a folder from the processes of a sharded job so
// that PyTorch's `dcp.load` and upstream Accelerate's `load_state` read it. The metadata is
// formats/dcp's; see Note [DCP folders] there and Note [DCP states] in dcp_state.cpp.
#pragma once

#include "accelerate/checkpointing.h"
#include "accelerate/state.h"
#include "checkpoint/sharded_format.h"
#include "formats/dcp.h"

#include <ATen/core/Tensor.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace accelerate::detail::checkpoint {

/// Whether `folder` is a DCP folder (it holds `.metadata`).
bool is_dcp_folder(const std::filesystem::path& folder);

/// A DCP folder whose metadata is read and whose items are checked to lie within its files.
class DcpReader {
 public:
  explicit DcpReader(std::filesystem::path folder);

  const dcp::Metadata& metadata() const { return metadata_; }
  const std::filesystem::path& folder() const { return folder_; }

  /// The part `box` of tensor `key`, copied from every chunk that overlaps it; refuses a part
  /// that the chunks do not cover exactly once, and a chunk whose bytes are not its tensor's.
  at::Tensor read(const std::string& key, const ShardBox& box) const;
  /// The whole tensor `key`.
  at::Tensor read_whole(const std::string& key) const;
  /// The non-tensor value `key` (a torch.save archive of a plain value) as JSON.
  nlohmann::json value(const std::string& key) const;

 private:
  std::filesystem::path folder_;
  dcp::Metadata metadata_;
};

/// Which part of a tensor a process reads, given its name (dotted, below the top level) and
/// whole shape: `std::nullopt` for all of it.
using BoxOf = std::function<std::optional<ShardBox>(const std::string& name, const std::vector<int64_t>& whole)>;

/// The state dict saved under the top-level key `top` ("model", "optimizer": upstream's), laid out
/// as `read_torch_save` lays out the same dict saved whole: tensors by their dotted path below
/// `top` (each the part `box_of` says), values as JSON (integer-keyed steps as lists).
StateDict read_dcp_state(const DcpReader& reader, const std::string& top, const BoxOf& box_of);

/// One process's share of a DCP folder to write: its tensors' parts (by key, with the whole
/// shape and the part's offset), and values (by key, with their path) that only one process
/// writes.
struct DcpShare {
  struct Part {
    at::Tensor tensor;
    std::vector<int64_t> whole, offset;
    std::vector<dcp::PathStep> path;
  };
  std::map<std::string, Part> tensors;
  std::map<std::string, std::pair<nlohmann::json, std::vector<dcp::PathStep>>> values;
};

/// Writes this process's share into `folder` (`__<rank>_0.distcp`), gathers every process's
/// metadata on the main process of `state`, which writes `.metadata`. Every process must call it.
void write_dcp_folder(const std::filesystem::path& folder, const DcpShare& share, const PartialState& state);

}  // namespace accelerate::detail::checkpoint
