// torch.distributed.checkpoint folders, the tensors' side (see dcp_state.h).
#include "checkpoint/dcp_state.h"

#include "accelerate/utils/operations.h"
#include "checkpoint/torch_save.h"
#include "detail/dtype_names.h"
#include "detail/files.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <fstream>
#include <set>

namespace fs = std::filesystem;

namespace accelerate::detail::checkpoint {

// Note [DCP states]
// Upstream Accelerate saves a fully sharded model's SHARDED_STATE_DICT as `dcp.save({"model":
// state_dict})` into `pytorch_model_fsdp_<i>/`, and its optimizer's as `{"optimizer":
// optim_state_dict}` into `optimizer_<i>/`, the optimizer's state keyed by parameter names
// (FSDP's `optim_state_dict`). Reading one here: each tensor's part this process holds is a box
// (ShardBox: rows of its piece, as the project's own sharded format places it), filled from every
// chunk that overlaps it, whatever number of processes saved; a mask counts what each element
// receives, so overlapping or missing chunks are refused rather than silently mixed. The values
// (param groups) are torch.save archives of plain values, read as such. The result has the layout
// `read_torch_save` gives the same dict saved whole, so the conversions of upstream's whole files
// (python_layout.cpp) apply unchanged.
// Writing one: each process appends its parts (torch.save archives of contiguous copies) to
// `__<rank>_0.distcp`, its metadata (key, dtype, whole shape, offset, size, bytes' place, path)
// is gathered as JSON on the main process, which writes `.metadata` (formats/dcp) last: a folder
// without it is not a DCP folder, and the commit protocol makes the whole checkpoint appear at once.

namespace {

c10::ScalarType scalar_type_named(const std::string& name) {
  for (const auto type : {c10::kFloat, c10::kDouble, c10::kHalf, c10::kBFloat16, c10::kLong, c10::kInt, c10::kShort,
                          c10::kChar, c10::kByte, c10::kBool, c10::kComplexFloat, c10::kComplexDouble}) {
    if (dtype_name(type) == name) return type;
  }
  TORCH_CHECK_VALUE(false, "a tensor of dtype ", name, ", which is not read");
}

std::string shown_key(const std::string& key) { return key.size() > 80 ? key.substr(0, 80) + "…" : key; }

std::vector<int64_t> box_end(const ShardBox& box) {
  std::vector<int64_t> end(box.offset.size());
  for (size_t k = 0; k < end.size(); ++k) end[k] = box.offset[k] + box.length[k];
  return end;
}

}  // namespace

bool is_dcp_folder(const fs::path& folder) { return fs::is_regular_file(folder / ".metadata"); }

DcpReader::DcpReader(fs::path folder) : folder_(std::move(folder)) {
  const auto path = folder_ / ".metadata";
  TORCH_CHECK_VALUE(fs::is_regular_file(path), folder_.string(), " has no .metadata (not a torch.distributed.checkpoint folder)");
  const auto size = fs::file_size(path);
  TORCH_CHECK_VALUE(size <= dcp::kMaxMetadataSize, path.string(), " is larger than 1 GiB");
  std::string bytes(size, '\0');
  std::ifstream in(path, std::ios::binary);
  in.read(bytes.data(), static_cast<std::streamsize>(size));
  TORCH_CHECK_VALUE(static_cast<uint64_t>(in.gcount()) == size, "cannot read ", path.string());
  try {
    metadata_ = dcp::read_metadata(bytes);
    std::map<std::string, uint64_t> sizes;
    for (const auto& entry : fs::directory_iterator(folder_)) {
      if (entry.is_regular_file()) sizes.emplace(entry.path().filename().string(), entry.file_size());
    }
    dcp::check_locations(metadata_, sizes);
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(ValueError, c10::str(folder_.string(), ": ", e.what_without_backtrace()));
  }
}

at::Tensor DcpReader::read(const std::string& key, const ShardBox& box) const {
  auto it = metadata_.tensors.find(key);
  TORCH_CHECK_VALUE(it != metadata_.tensors.end(), folder_.string(), " has no tensor \"", shown_key(key), "\"");
  const auto& entry = it->second;
  const auto dtype = scalar_type_named(entry.dtype);
  const bool scalar = entry.size.empty();
  TORCH_CHECK_VALUE(scalar || box.offset.size() == entry.size.size(), folder_.string(), ": \"", shown_key(key),
                    "\" has ", entry.size.size(), " dimensions, not ", box.offset.size());
  auto out = at::empty(scalar ? std::vector<int64_t>{} : box.length, at::TensorOptions().dtype(dtype));
  auto received = at::zeros(scalar ? std::vector<int64_t>{} : box.length, at::kInt);
  const auto want_end = box_end(box);
  for (const auto& chunk : entry.chunks) {
    // The overlap of the chunk and the box, in each dimension.
    std::vector<int64_t> begin(chunk.offsets.size()), end(chunk.offsets.size());
    bool overlaps = true;
    for (size_t k = 0; k < chunk.offsets.size(); ++k) {
      begin[k] = std::max(box.offset[k], chunk.offsets[k]);
      end[k] = std::min(want_end[k], chunk.offsets[k] + chunk.sizes[k]);
      overlaps = overlaps && begin[k] < end[k];
    }
    if (!overlaps) continue;
    const auto where = (folder_ / chunk.where.file).string();
    auto item = read_torch_save_at(where, chunk.where.offset, chunk.where.length);
    auto found = item.tensors.find("");
    TORCH_CHECK_VALUE(found != item.tensors.end() && item.tensors.size() == 1, where, " at byte ", chunk.where.offset,
                      ": the bytes of a chunk of \"", shown_key(key), "\" do not hold one tensor");
    const auto& part = found->second;
    TORCH_CHECK_VALUE(part.sizes().vec() == chunk.sizes && part.scalar_type() == dtype, where, " at byte ",
                      chunk.where.offset, ": the chunk of \"", shown_key(key), "\" holds ", dtype_name(part.scalar_type()),
                      " ", part.sizes(), " where the metadata says ", entry.dtype, " ", c10::IntArrayRef(chunk.sizes));
    at::Tensor d = out, r = received, s = part;
    for (size_t k = 0; k < begin.size(); ++k) {
      const auto dim = static_cast<int64_t>(k);
      d = d.narrow(dim, begin[k] - box.offset[k], end[k] - begin[k]);
      r = r.narrow(dim, begin[k] - box.offset[k], end[k] - begin[k]);
      s = s.narrow(dim, begin[k] - chunk.offsets[k], end[k] - begin[k]);
    }
    d.copy_(s);
    r.add_(1);
  }
  TORCH_CHECK_VALUE(received.eq(1).all().item<bool>(), folder_.string(), ": the chunks of \"", shown_key(key),
                    "\" do not cover the part ", c10::IntArrayRef(box.offset), "+", c10::IntArrayRef(box.length),
                    " exactly once (", received.eq(0).sum().item<int64_t>(), " elements missing, ",
                    received.gt(1).sum().item<int64_t>(), " given twice)");
  return out;
}

at::Tensor DcpReader::read_whole(const std::string& key) const {
  auto it = metadata_.tensors.find(key);
  TORCH_CHECK_VALUE(it != metadata_.tensors.end(), folder_.string(), " has no tensor \"", shown_key(key), "\"");
  const auto& size = it->second.size;
  return read(key, ShardBox{std::vector<int64_t>(size.size(), 0), size});
}

nlohmann::json DcpReader::value(const std::string& key) const {
  auto it = metadata_.values.find(key);
  TORCH_CHECK_VALUE(it != metadata_.values.end(), folder_.string(), " has no value \"", shown_key(key), "\"");
  const auto where = (folder_ / it->second.file).string();
  auto item = read_torch_save_at(where, it->second.offset, it->second.length);
  TORCH_CHECK_VALUE(item.tensors.empty(), where, " at byte ", it->second.offset, ": the value \"", shown_key(key),
                    "\" holds tensors");
  return item.values;
}

namespace {

// `key`'s path below `top`, from planner_data; refused when it has none or lies elsewhere.
std::vector<dcp::PathStep> path_below(const DcpReader& reader, const std::string& key, const std::string& top) {
  auto it = reader.metadata().paths.find(key);
  if (it == reader.metadata().paths.end()) {
    // Without planner_data, a key "<top>.<name>" is taken as one name below the top level.
    TORCH_CHECK_VALUE(key.rfind(top + ".", 0) == 0, reader.folder().string(), ": \"", shown_key(key),
                      "\" is not below \"", top, "\"");
    return {key.substr(top.size() + 1)};
  }
  const auto& path = it->second;
  TORCH_CHECK_VALUE(path.size() >= 2 && std::holds_alternative<std::string>(path[0]) &&
                        std::get<std::string>(path[0]) == top,
                    reader.folder().string(), ": \"", shown_key(key), "\" is not below \"", top,
                    "\" (upstream's folders hold one top-level entry, \"model\" or \"optimizer\")");
  return {path.begin() + 1, path.end()};
}

std::string dotted(const std::vector<dcp::PathStep>& path) {
  std::string out;
  for (const auto& step : path) {
    if (!out.empty()) out += '.';
    out += std::holds_alternative<std::string>(step) ? std::get<std::string>(step)
                                                     : std::to_string(std::get<int64_t>(step));
  }
  return out;
}

}  // namespace

StateDict read_dcp_state(const DcpReader& reader, const std::string& top, const BoxOf& box_of) {
  StateDict out;
  out.values = nlohmann::json::object();
  for (const auto& [key, entry] : reader.metadata().tensors) {
    const auto name = dotted(path_below(reader, key, top));
    const auto box = box_of ? box_of(name, entry.size) : std::nullopt;
    out.tensors.emplace(name, box && !entry.size.empty() ? reader.read(key, *box) : reader.read_whole(key));
  }
  for (const auto& [key, where] : reader.metadata().values) {
    const auto path = path_below(reader, key, top);
    nlohmann::json* at = &out.values;
    for (const auto& step : path) {
      if (std::holds_alternative<std::string>(step)) {
        TORCH_CHECK_VALUE(at->is_null() || at->is_object(), reader.folder().string(), ": \"", shown_key(key),
                          "\" is a key of a value that is not a dict");
        at = &(*at)[std::get<std::string>(step)];
      } else {
        const auto index = std::get<int64_t>(step);
        TORCH_CHECK_VALUE((at->is_null() || at->is_array()) && index >= 0 && index < 1000000,
                          reader.folder().string(), ": \"", shown_key(key), "\" is an item of a value that is not a list");
        if (at->is_null()) *at = nlohmann::json::array();
        while (static_cast<int64_t>(at->size()) <= index) at->push_back(nullptr);
        at = &(*at)[static_cast<size_t>(index)];
      }
    }
    TORCH_CHECK_VALUE(at->is_null(), reader.folder().string(), ": \"", shown_key(key), "\" is given twice");
    *at = reader.value(key);
  }
  return out;
}

// ---- writing -------------------------------------------------------------------------------------

namespace {

nlohmann::json path_json(const std::vector<dcp::PathStep>& path) {
  auto out = nlohmann::json::array();
  for (const auto& step : path) {
    if (std::holds_alternative<std::string>(step)) {
      out.push_back(std::get<std::string>(step));
    } else {
      out.push_back(std::get<int64_t>(step));
    }
  }
  return out;
}

std::vector<dcp::PathStep> path_of(const nlohmann::json& json) {
  std::vector<dcp::PathStep> out;
  for (const auto& step : json) {
    if (step.is_string()) {
      out.emplace_back(step.get<std::string>());
    } else {
      out.emplace_back(step.get<int64_t>());
    }
  }
  return out;
}

}  // namespace

void write_dcp_folder(const fs::path& folder, const DcpShare& share, const PartialState& state) {
  fs::create_directories(folder);
  const auto file = dcp::data_file(state.process_index());
  const auto path = (folder / file).string();
  auto mine = nlohmann::json::array();
  write_file_atomically(path, [&](SequentialWriter& out) {
    uint64_t at = 0;
    for (const auto& [key, part] : share.tensors) {
      TorchSaveWriter w;
      const auto length = w.write_to(w.tensor(part.tensor), out, path);
      mine.push_back({{"key", key}, {"dtype", dtype_name(part.tensor.scalar_type())}, {"whole", part.whole},
                      {"offset", part.offset}, {"sizes", part.tensor.sizes().vec()}, {"at", at},
                      {"length", length}, {"path", path_json(part.path)}});
      at += length;
    }
    for (const auto& [key, value] : share.values) {
      TorchSaveWriter w;
      const auto length = w.write_to(w.from_json(value.first), out, path);
      mine.push_back({{"key", key}, {"at", at}, {"length", length}, {"path", path_json(value.second)}});
      at += length;
    }
  });
  const auto gathered = gather_object(state, c10::IValue(mine.dump()));
  if (!state.is_main_process()) return;
  dcp::Metadata metadata;
  for (size_t rank = 0; rank < gathered.size(); ++rank) {
    const auto items = nlohmann::json::parse(gathered[rank].toStringRef());
    for (const auto& item : items) {
      const auto key = item.at("key").get<std::string>();
      const dcp::Location where{dcp::data_file(static_cast<int>(rank)), item.at("at").get<uint64_t>(),
                                item.at("length").get<uint64_t>()};
      metadata.paths.emplace(key, path_of(item.at("path")));
      if (!item.contains("dtype")) {
        metadata.values.emplace(key, where);  // the first process's, where several wrote it
        continue;
      }
      auto& entry = metadata.tensors[key];
      const auto dtype = item.at("dtype").get<std::string>();
      const auto whole = item.at("whole").get<std::vector<int64_t>>();
      TORCH_CHECK_VALUE(entry.dtype.empty() || (entry.dtype == dtype && entry.size == whole),
                        "[save_state] the processes hold \"", shown_key(key), "\" with different dtypes or shapes");
      entry.dtype = dtype;
      entry.size = whole;
      dcp::Chunk chunk{item.at("offset").get<std::vector<int64_t>>(), item.at("sizes").get<std::vector<int64_t>>(), where};
      bool seen = false;
      for (const auto& c : entry.chunks) seen = seen || c.offsets == chunk.offsets;
      if (!seen) entry.chunks.push_back(std::move(chunk));
    }
  }
  write_file_atomically((folder / ".metadata").string(), dcp::write_metadata(metadata));
}

}  // namespace accelerate::detail::checkpoint
