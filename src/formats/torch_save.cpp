// torch.save's container without LibTorch; see torch_save.h.
#include "formats/torch_save.h"

#include "detail/check.h"

#include <fstream>
#include <limits>

namespace accelerate::detail::torch_save {

bool is_zip_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  in.read(magic, 4);
  return in.gcount() == 4 && magic[0] == 'P' && magic[1] == 'K' && magic[2] == 3 && magic[3] == 4;
}

void check_records(const std::vector<zip::Record>& records, uint64_t file_size) {
  for (const auto& r : records) {
    if (r.method != 0) {
      raise_value_error(concat("the record ", r.name, " is compressed (method ", r.method,
                               "); torch.save stores its records uncompressed, and compressed ones are not read"));
    }
    if (r.compressed_size != r.size || r.size > file_size - r.header_offset) {
      raise_value_error(
          concat("the record ", r.name, " claims ", r.size, " bytes, more than the file holds after its start"));
    }
  }
}

const pickle::Value* ordered_dict(pickle::Tree& tree,
                                  std::vector<std::pair<const pickle::Value*, const pickle::Value*>> entries) {
  auto* v = tree.add(pickle::Value::Kind::kCall);
  v->callable = tree.global("collections", "OrderedDict");
  v->args = tree.tuple({});
  v->entries = std::move(entries);
  return v;
}

const pickle::Value* rebuild_tensor(pickle::Tree& tree, const char* storage_type, const std::string& key,
                                    int64_t numel, const std::vector<int64_t>& sizes,
                                    const std::vector<int64_t>& strides) {
  auto& tr = tree;
  const auto* id = tr.tuple({tr.string("storage"), tr.global("torch", storage_type), tr.string(key), tr.string("cpu"),
                             tr.integer(numel)});
  std::vector<const pickle::Value*> size_values, stride_values;
  for (auto s : sizes) size_values.push_back(tr.integer(s));
  for (auto s : strides) stride_values.push_back(tr.integer(s));
  return tr.call(tr.global("torch._utils", "_rebuild_tensor_v2"),
                 tr.tuple({tr.persistent(id), tr.integer(0), tr.tuple(size_values), tr.tuple(stride_values),
                           tr.boolean(false), ordered_dict(tree, {})}));
}

const pickle::Value* from_json(pickle::Tree& tree, const nlohmann::json& value) {
  auto& tr = tree;
  switch (value.type()) {
    case nlohmann::json::value_t::null: return tr.none();
    case nlohmann::json::value_t::boolean: return tr.boolean(value.get<bool>());
    case nlohmann::json::value_t::number_integer: return tr.integer(value.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned:
      if (value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        raise_value_error("an integer beyond 64 bits cannot be pickled here");
      }
      return tr.integer(value.get<int64_t>());
    case nlohmann::json::value_t::number_float: return tr.number(value.get<double>());
    case nlohmann::json::value_t::string: return tr.string(value.get<std::string>());
    case nlohmann::json::value_t::array: {
      std::vector<const pickle::Value*> items;
      for (const auto& item : value) items.push_back(from_json(tree, item));
      return tr.list(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      std::vector<std::pair<const pickle::Value*, const pickle::Value*>> entries;
      for (const auto& [k, v] : value.items()) entries.emplace_back(tr.string(k), from_json(tree, v));
      return tr.dict(std::move(entries));
    }
    default: raise_value_error(concat("a JSON value of type ", value.type_name(), " cannot be pickled"));
  }
}

}  // namespace accelerate::detail::torch_save
