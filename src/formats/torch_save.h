// The container of torch.save's files without LibTorch: recognising the archive, checking its
// records before LibTorch's reader opens it, and the pickle values torch.save writes around
// tensors (a `_rebuild_tensor_v2` call over a storage's persistent id, OrderedDicts, JSON values
// as Python's). Reading the tensors' storages and writing the archive are LibTorch's, in
// checkpoint/torch_save.cpp (Note [torch.save files]). Rejections are ValueErrors (detail/check.h).
#pragma once

#include "formats/pickle.h"
#include "formats/zip.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace accelerate::detail::torch_save {

/// Whether `path` starts like a zip archive (torch.save's format since PyTorch 1.6).
bool is_zip_file(const std::string& path);

/// Refuses a record that torch.save would not write (a compressed one) or that claims more bytes
/// than the file of `file_size` bytes holds after its start, so that no record costs more memory
/// to read than the file's size.
void check_records(const std::vector<zip::Record>& records, uint64_t file_size);

/// `collections.OrderedDict` with `entries`.
const pickle::Value* ordered_dict(pickle::Tree& tree,
                                  std::vector<std::pair<const pickle::Value*, const pickle::Value*>> entries);

/// A tensor as torch.save pickles it: `torch._utils._rebuild_tensor_v2` over the persistent id of
/// the storage `torch.<storage_type>` saved in the record `data/<key>` on the CPU, holding
/// `numel` elements, with offset 0 and the given sizes and strides.
const pickle::Value* rebuild_tensor(pickle::Tree& tree, const char* storage_type, const std::string& key,
                                    int64_t numel, const std::vector<int64_t>& sizes,
                                    const std::vector<int64_t>& strides);

/// `value` as Python values: objects become dicts with string keys, arrays lists. An integer
/// beyond 64 bits, or a JSON value of another type, is a ValueError.
const pickle::Value* from_json(pickle::Tree& tree, const nlohmann::json& value);

}  // namespace accelerate::detail::torch_save
