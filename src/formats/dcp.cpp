// The metadata of torch.distributed.checkpoint folders (see dcp.h).
#include "formats/dcp.h"

#include "detail/check.h"
#include "formats/pickle.h"

#include <limits>
#include <set>
#include <utility>

namespace accelerate::detail::dcp {

// Note [DCP folders]
// torch.distributed.checkpoint (`dcp.save`, what upstream Accelerate's FSDP writes for
// SHARDED_STATE_DICT) flattens a nested state dict into keys ("optimizer.state.0.weight.exp_avg"),
// and each process appends its items to its own file `__<rank>_0.distcp`: each tensor chunk as a
// torch.save archive of that chunk, each non-tensor value (a param group's lr, say) as a torch.save
// archive of the value. A replicated tensor (a step count) is written once. The coordinator then
// pickles a `Metadata` object into `.metadata`:
// - state_dict_metadata: key → TensorStorageMetadata(properties (dtype, layout, ...), size,
//   chunks [ChunkStorageMetadata(offsets, sizes)]) or BytesStorageMetadata();
// - storage_data: MetadataIndex(fqn, offset of the chunk or None, index hint) →
//   _StorageInfo(relative_path, offset, length, transform_descriptors);
// - planner_data: key → its path in the nested dict (("optimizer", "state", "0.weight", "step"):
//   a parameter's name may hold dots, so the path, not the key, says where a value belongs);
// - storage_meta and version, which say nothing a loader needs.
// The pickle is read as data (formats/pickle) and only those classes, torch.Size, dtypes, the
// strided layout, memory-format encodings and (in storage_meta, which is not read) pathlib's
// paths are accepted; objects are made by NEWOBJ with their fields set by BUILD, or, as this file
// writes them, by copyreg.__newobj__, which Python's pickle reads alike. Each tensor's chunks must
// lie within it and add up to its size; whether they overlap is checked where they are copied
// (checkpoint/dcp_state.cpp), which counts every element each box receives.

namespace {

using pickle::Value;
using K = Value::Kind;

const std::string kMetadataModule = "torch.distributed.checkpoint.metadata";
const std::string kFilesystemModule = "torch.distributed.checkpoint.filesystem";

constexpr const char* kDtypes[] = {"float32", "float64", "float16", "bfloat16", "int64",     "int32",
                                   "int16",   "int8",    "uint8",   "bool",     "complex64", "complex128"};

constexpr int64_t kMaxElements = int64_t{1} << 62;

[[noreturn]] void refuse(const std::string& where, const std::string& what) {
  raise_value_error(concat(".metadata: ", where.empty() ? "" : where + ": ", what));
}

std::string shown(const std::string& key) { return key.size() > 80 ? key.substr(0, 80) + "…" : key; }

// The class of the object a call makes: NEWOBJ(cls, ()) or copyreg.__newobj__(cls) (as
// protocol 2 writes it); null when the call is neither.
const Value* class_of(const Value& call) {
  const Value* cls = call.callable;
  if (cls->kind == K::kGlobal && cls->text == "copyreg" && cls->name == "__newobj__") {
    return call.args->kind == K::kTuple && call.args->items.size() == 1 ? call.args->items[0] : nullptr;
  }
  return call.args->kind == K::kTuple && call.args->items.empty() ? cls : nullptr;
}

// The object a call makes, whose class must be `module.name`. (`where` by value: a reference
// returned from a call with a temporary argument is what GCC 14's -Wdangling-reference flags.)
const Value& object_of(const Value* v, const std::string& module, const char* name, std::string_view where_view) {
  const std::string where(where_view);
  if (v == nullptr || v->kind != K::kCall) refuse(where, std::string("not a ") + name + " object");
  const Value* cls = class_of(*v);
  if (cls == nullptr) refuse(where, std::string("a ") + name + " made with arguments");
  if (cls->kind != K::kGlobal || cls->text != module || cls->name != name) {
    refuse(where, cls->kind == K::kGlobal ? "an object of " + cls->qualified_name() + ", which is not read (a " +
                                                name + " was expected)"
                                          : std::string("not a ") + name + " object");
  }
  return *v;
}

// A field an object's BUILD set (its state is a dict with string keys); null when absent.
const Value* field(const Value& object, const char* name, const std::string& where) {
  if (object.state == nullptr || object.state->kind == K::kNone) return nullptr;
  if (object.state->kind != K::kDict) refuse(where, "an object whose fields are not a dict");
  const Value* found = nullptr;
  for (const auto& [k, x] : object.state->entries) {
    if (k->kind != K::kString) refuse(where, "a field name that is not a string");
    if (k->text == name) {
      if (found != nullptr) refuse(where, std::string("the field ") + name + " twice");
      found = x;
    }
  }
  return found;
}

const Value& required(const Value& object, const char* name, std::string_view where_view) {
  const std::string where(where_view);
  const Value* v = field(object, name, where);
  if (v == nullptr) refuse(where, std::string("no field ") + name);
  return *v;
}

bool is_none(const Value* v) { return v == nullptr || v->kind == K::kNone; }

// torch.Size((...)).
std::vector<int64_t> size_of(const Value& v, const std::string& where) {
  if (v.kind != K::kCall || v.callable->kind != K::kGlobal || v.callable->qualified_name() != "torch.Size" ||
      v.args->kind != K::kTuple || v.args->items.size() != 1 ||
      (v.args->items[0]->kind != K::kTuple && v.args->items[0]->kind != K::kList)) {
    refuse(where, "a size that is not a torch.Size");
  }
  const auto& items = v.args->items[0]->items;
  if (items.size() > 64) refuse(where, "a size of more than 64 dimensions");
  std::vector<int64_t> out;
  for (const auto* d : items) {
    if (d->kind != K::kInt || d->integer < 0 || d->integer > kMaxElements) refuse(where, "a size that is not a list of sizes");
    out.push_back(d->integer);
  }
  return out;
}

int64_t numel_of(const std::vector<int64_t>& size, const std::string& where) {
  int64_t n = 1;
  for (auto d : size) {
    if (d != 0 && n > kMaxElements / d) refuse(where, "a tensor of more than 2^62 elements");
    n *= d;
  }
  return n;
}

std::string dtype_of(const Value& v, const std::string& where) {
  if (v.kind != K::kGlobal || v.text != "torch") refuse(where, "a dtype that is not one of torch's");
  for (const auto* name : kDtypes) {
    if (v.name == name) return name;
  }
  refuse(where, "a tensor of dtype torch." + v.name + ", which is not read");
}

void check_layout(const Value& v, const std::string& where) {
  const bool strided =
      (v.kind == K::kGlobal && v.qualified_name() == "torch.strided") ||
      (v.kind == K::kCall && v.callable->kind == K::kGlobal &&
       v.callable->qualified_name() == "torch.serialization._get_layout" && v.args->kind == K::kTuple &&
       v.args->items.size() == 1 && v.args->items[0]->kind == K::kString && v.args->items[0]->text == "torch.strided");
  if (!strided) refuse(where, "a tensor whose layout is not torch.strided (sparse tensors are not read)");
}

// _MEM_FORMAT_ENCODING.X as getattr(enum, "X") or as the enum called with its value.
void check_memory_format(const Value& v, const std::string& where) {
  if (v.kind == K::kCall && v.callable->kind == K::kGlobal && v.args->kind == K::kTuple && v.args->items.size() == 2 &&
      v.callable->qualified_name() == "builtins.getattr") {
    const auto& cls = *v.args->items[0];
    const auto& name = *v.args->items[1];
    if (cls.kind == K::kGlobal && cls.text == kMetadataModule && cls.name == "_MEM_FORMAT_ENCODING" &&
        name.kind == K::kString &&
        (name.text == "TORCH_CONTIGUOUS_FORMAT" || name.text == "TORCH_CHANNELS_LAST" ||
         name.text == "TORCH_PRESERVE_FORMAT")) {
      return;
    }
  }
  if (v.kind == K::kCall && v.callable->kind == K::kGlobal && v.callable->text == kMetadataModule &&
      v.callable->name == "_MEM_FORMAT_ENCODING" && v.args->kind == K::kTuple && v.args->items.size() == 1 &&
      v.args->items[0]->kind == K::kInt && v.args->items[0]->integer >= 0 && v.args->items[0]->integer <= 2) {
    return;
  }
  refuse(where, "a memory format that is not one of _MEM_FORMAT_ENCODING's");
}

// TensorProperties: its state is the tuple its __getstate__ makes (dtype, layout, requires_grad,
// memory format, pin_memory), or a dict of fields.
std::string properties_dtype(const Value& v, const std::string& where) {
  const auto& props = object_of(&v, kMetadataModule, "TensorProperties", where);
  if (props.state != nullptr && props.state->kind == K::kTuple) {
    const auto& s = props.state->items;
    if (s.size() != 5 || s[2]->kind != K::kBool || s[4]->kind != K::kBool) refuse(where, "TensorProperties of another form");
    check_layout(*s[1], where);
    check_memory_format(*s[3], where);
    return dtype_of(*s[0], where);
  }
  if (const auto* layout = field(props, "layout", where)) check_layout(*layout, where);
  return dtype_of(required(props, "dtype", where), where);
}

// storage_meta, which is not read: only plain values and pathlib's paths.
void check_plain(const Value* v, int depth, const std::string& where) {
  if (v == nullptr) return;
  if (depth > 8) refuse(where, "values nested deeper than 8");
  switch (v->kind) {
    case K::kNone:
    case K::kBool:
    case K::kInt:
    case K::kFloat:
    case K::kString: return;
    case K::kList:
    case K::kTuple:
      for (const auto* item : v->items) check_plain(item, depth + 1, where);
      return;
    case K::kDict:
      for (const auto& [k, x] : v->entries) {
        check_plain(k, depth + 1, where);
        check_plain(x, depth + 1, where);
      }
      return;
    case K::kCall: {
      const auto& name = v->callable->kind == K::kGlobal ? v->callable->qualified_name() : std::string("?");
      if (name == "pathlib.PosixPath" || name == "pathlib.PurePosixPath" || name == "pathlib.WindowsPath" ||
          name == "pathlib.PureWindowsPath") {
        for (const auto* item : v->args->items) {
          if (item->kind != K::kString) refuse(where, "a path made of values that are not strings");
        }
        return;
      }
      if (v->callable->kind == K::kGlobal && v->callable->text == kMetadataModule && v->callable->name == "StorageMeta") {
        check_plain(v->state, depth + 1, where);
        return;
      }
      refuse(where, "an object of " + name + ", which is not read");
    }
    default: refuse(where, "a value that is not read");
  }
}

void check_file_name(const std::string& name, const std::string& where) {
  if (name.empty() || name.size() > 255 || name == "." || name == ".." || name.find('/') != std::string::npos ||
      name.find('\\') != std::string::npos || name.find('\0') != std::string::npos) {
    refuse(where, "the file name \"" + shown(name) + "\" is not a plain name in the folder");
  }
}

Location location_of(const Value& info, const std::string& where) {
  const auto& s = object_of(&info, kFilesystemModule, "_StorageInfo", where);
  const auto& path = required(s, "relative_path", where);
  const auto& offset = required(s, "offset", where);
  const auto& length = required(s, "length", where);
  if (path.kind != K::kString) refuse(where, "a relative_path that is not a string");
  check_file_name(path.text, where);
  if (offset.kind != K::kInt || length.kind != K::kInt || offset.integer < 0 || length.integer < 0 ||
      offset.integer > kMaxElements || length.integer > kMaxElements) {
    refuse(where, "an offset or length that is not a size");
  }
  if (const auto* transforms = field(s, "transform_descriptors", where)) {
    const bool none = transforms->kind == K::kNone ||
                      ((transforms->kind == K::kList || transforms->kind == K::kTuple) && transforms->items.empty());
    if (!none) {
      refuse(where, "an item written through transforms (DCP's extensions, such as compression), which is not read");
    }
  }
  return {path.text, static_cast<uint64_t>(offset.integer), static_cast<uint64_t>(length.integer)};
}

}  // namespace

Metadata read_metadata(std::string_view pickled) {
  if (pickled.size() > kMaxMetadataSize) refuse("", "larger than 1 GiB");
  pickle::Tree tree;
  try {
    tree = pickle::read(pickled);
  } catch (const std::invalid_argument& e) {
    refuse("", e.what());
  }
  // A few bytes may share values into a walk of 2^100: bound the walk by the size first.
  const size_t limit = std::max<size_t>(size_t{1} << 20, 16 * pickled.size());
  if (pickle::expanded_size(*tree.root, limit) >= limit) refuse("", "values shared into more than " + std::to_string(limit) + " places");

  const auto& root = object_of(tree.root, kMetadataModule, "Metadata", "the top level");
  Metadata out;
  const auto& entries = required(root, "state_dict_metadata", "Metadata");
  if (entries.kind != K::kDict) refuse("state_dict_metadata", "not a dict");
  std::set<std::string> bytes_keys;
  for (const auto& [k, v] : entries.entries) {
    if (k->kind != K::kString) refuse("state_dict_metadata", "a key that is not a string");
    const std::string& key = k->text;
    const std::string where = "\"" + shown(key) + "\"";
    if (out.tensors.count(key) || bytes_keys.count(key)) refuse(where, "the key twice");
    const Value* cls = v->kind == K::kCall ? class_of(*v) : nullptr;
    if (cls != nullptr && cls->kind == K::kGlobal && cls->name == "BytesStorageMetadata") {
      object_of(v, kMetadataModule, "BytesStorageMetadata", where);
      bytes_keys.insert(key);
      continue;
    }
    const auto& meta = object_of(v, kMetadataModule, "TensorStorageMetadata", where);
    TensorEntry entry;
    entry.dtype = properties_dtype(required(meta, "properties", where), where);
    entry.size = size_of(required(meta, "size", where), where);
    const int64_t numel = numel_of(entry.size, where);
    const auto& chunks = required(meta, "chunks", where);
    if (chunks.kind != K::kList && chunks.kind != K::kTuple) refuse(where, "chunks that are not a list");
    int64_t covered = 0;
    for (const auto* c : chunks.items) {
      const auto& chunk = object_of(c, kMetadataModule, "ChunkStorageMetadata", where);
      Chunk ch;
      ch.offsets = size_of(required(chunk, "offsets", where), where);
      ch.sizes = size_of(required(chunk, "sizes", where), where);
      if (ch.offsets.size() != entry.size.size() || ch.sizes.size() != entry.size.size()) {
        refuse(where, "a chunk with another number of dimensions than its tensor");
      }
      for (size_t d = 0; d < entry.size.size(); ++d) {
        if (ch.offsets[d] > entry.size[d] || ch.sizes[d] > entry.size[d] - ch.offsets[d]) {
          refuse(where, "a chunk that reaches outside its tensor (dimension " + std::to_string(d) + ")");
        }
      }
      covered += numel_of(ch.sizes, where);
      if (covered > numel) refuse(where, "chunks that hold more elements than the tensor");
      entry.chunks.push_back(std::move(ch));
    }
    if (covered != numel) {
      refuse(where, "chunks that hold " + std::to_string(covered) + " of the tensor's " + std::to_string(numel) +
                        " elements");
    }
    out.tensors.emplace(key, std::move(entry));
  }

  // Where each chunk's and value's bytes lie.
  const auto& storage = required(root, "storage_data", "Metadata");
  if (storage.kind != K::kDict) refuse("storage_data", "not a dict");
  std::map<std::pair<std::string, std::vector<int64_t>>, Location> chunk_places;
  for (const auto& [k, v] : storage.entries) {
    const auto& index = object_of(k, kMetadataModule, "MetadataIndex", "storage_data");
    const auto& fqn = required(index, "fqn", "storage_data");
    if (fqn.kind != K::kString) refuse("storage_data", "a MetadataIndex whose fqn is not a string");
    const std::string where = "storage_data \"" + shown(fqn.text) + "\"";
    const auto* offset = field(index, "offset", where);
    auto place = location_of(*v, where);
    if (is_none(offset)) {
      if (!bytes_keys.count(fqn.text)) refuse(where, "bytes of a key that is not a non-tensor value");
      if (!out.values.emplace(fqn.text, std::move(place)).second) refuse(where, "the value's bytes twice");
      continue;
    }
    auto key = std::make_pair(fqn.text, size_of(*offset, where));
    if (!chunk_places.emplace(std::move(key), std::move(place)).second) refuse(where, "a chunk's bytes twice");
  }
  for (auto& [key, entry] : out.tensors) {
    for (auto& chunk : entry.chunks) {
      auto it = chunk_places.find({key, chunk.offsets});
      if (it == chunk_places.end()) {
        refuse("storage_data", "no bytes for the chunk of \"" + shown(key) + "\" at offset " +
                                   std::to_string(chunk.offsets.empty() ? 0 : chunk.offsets[0]) + "…");
      }
      chunk.where = it->second;
    }
  }
  for (const auto& key : bytes_keys) {
    if (!out.values.count(key)) refuse("storage_data", "no bytes for the value \"" + shown(key) + "\"");
  }

  // Each key's path in the nested state dict.
  const auto* planner = field(root, "planner_data", "Metadata");
  if (!is_none(planner)) {
    if (planner->kind != K::kDict) refuse("planner_data", "not a dict");
    for (const auto& [k, v] : planner->entries) {
      if (k->kind != K::kString) refuse("planner_data", "a key that is not a string");
      if (v->kind != K::kTuple && v->kind != K::kList) refuse("planner_data", "a path that is not a tuple");
      std::vector<PathStep> path;
      for (const auto* step : v->items) {
        if (step->kind == K::kString) {
          path.emplace_back(step->text);
        } else if (step->kind == K::kInt) {
          path.emplace_back(step->integer);
        } else {
          refuse("planner_data", "a path step that is neither a string nor an integer");
        }
      }
      out.paths.insert_or_assign(k->text, std::move(path));
    }
  }
  check_plain(field(root, "storage_meta", "Metadata"), 0, "storage_meta");
  if (const auto* version = field(root, "version", "Metadata"); !is_none(version) && version->kind != K::kString) {
    refuse("version", "not a string");
  }
  return out;
}

void check_locations(const Metadata& metadata, const std::map<std::string, uint64_t>& file_sizes) {
  const auto check = [&](const std::string& key, const Location& where) {
    auto it = file_sizes.find(where.file);
    if (it == file_sizes.end()) {
      raise_value_error(concat("the folder has no ", where.file, ", which holds \"", shown(key), "\""));
    }
    if (where.offset > it->second || where.length > it->second - where.offset) {
      raise_value_error(concat(where.file, " has ", it->second, " bytes, but \"", shown(key), "\" is said to lie at ",
                               where.offset, "+", where.length));
    }
  };
  for (const auto& [key, entry] : metadata.tensors) {
    for (const auto& chunk : entry.chunks) check(key, chunk.where);
  }
  for (const auto& [key, where] : metadata.values) check(key, where);
}

// ---- writing -------------------------------------------------------------------------------------

namespace {

class Writer {
 public:
  // copyreg.__newobj__(module.name) with `fields` set by BUILD.
  const Value* object(const std::string& module, const char* name,
                      std::vector<std::pair<const char*, const Value*>> fields) {
    std::vector<std::pair<const Value*, const Value*>> entries;
    for (auto& [k, v] : fields) entries.emplace_back(tree.string(k), v);
    return object_with_state(module, name, tree.dict(std::move(entries)));
  }
  const Value* object_with_state(const std::string& module, const char* name, const Value* state) {
    auto* v = tree.add(K::kCall);
    v->callable = tree.global("copyreg", "__newobj__");
    v->args = tree.tuple({tree.global(module, name)});
    v->state = state;
    return v;
  }
  const Value* size(const std::vector<int64_t>& dims) {
    std::vector<const Value*> items;
    for (auto d : dims) items.push_back(tree.integer(d));
    return tree.call(tree.global("torch", "Size"), tree.tuple({tree.tuple(std::move(items))}));
  }
  const Value* properties(const std::string& dtype) {
    const auto* layout =
        tree.call(tree.global("torch.serialization", "_get_layout"), tree.tuple({tree.string("torch.strided")}));
    const auto* format = tree.call(tree.global("builtins", "getattr"),
                                   tree.tuple({tree.global(kMetadataModule, "_MEM_FORMAT_ENCODING"),
                                               tree.string("TORCH_CONTIGUOUS_FORMAT")}));
    return object_with_state(kMetadataModule, "TensorProperties",
                             tree.tuple({tree.global("torch", dtype), layout, tree.boolean(false), format,
                                         tree.boolean(false)}));
  }
  const Value* storage_info(const Location& where) {
    return object(kFilesystemModule, "_StorageInfo",
                  {{"relative_path", tree.string(where.file)},
                   {"offset", tree.integer(static_cast<int64_t>(where.offset))},
                   {"length", tree.integer(static_cast<int64_t>(where.length))},
                   {"transform_descriptors", tree.none()}});
  }

  pickle::Tree tree;
};

}  // namespace

std::string write_metadata(const Metadata& metadata) {
  Writer w;
  auto& tr = w.tree;
  std::vector<std::pair<const Value*, const Value*>> entries, storage, planner;
  for (const auto& [key, entry] : metadata.tensors) {
    std::vector<const Value*> chunks;
    for (const auto& chunk : entry.chunks) {
      chunks.push_back(w.object(kMetadataModule, "ChunkStorageMetadata",
                                {{"offsets", w.size(chunk.offsets)}, {"sizes", w.size(chunk.sizes)}}));
      storage.emplace_back(w.object(kMetadataModule, "MetadataIndex",
                                    {{"fqn", tr.string(key)},
                                     {"offset", w.size(chunk.offsets)},
                                     {"index", tr.integer(static_cast<int64_t>(chunks.size() - 1))}}),
                           w.storage_info(chunk.where));
    }
    entries.emplace_back(tr.string(key), w.object(kMetadataModule, "TensorStorageMetadata",
                                                  {{"properties", w.properties(entry.dtype)},
                                                   {"size", w.size(entry.size)},
                                                   {"chunks", tr.list(std::move(chunks))}}));
  }
  for (const auto& [key, where] : metadata.values) {
    entries.emplace_back(tr.string(key), w.object_with_state(kMetadataModule, "BytesStorageMetadata", nullptr));
    storage.emplace_back(
        w.object(kMetadataModule, "MetadataIndex", {{"fqn", tr.string(key)}, {"offset", tr.none()}, {"index", tr.none()}}),
        w.storage_info(where));
  }
  for (const auto& [key, path] : metadata.paths) {
    std::vector<const Value*> steps;
    for (const auto& step : path) {
      steps.push_back(std::holds_alternative<std::string>(step) ? tr.string(std::get<std::string>(step))
                                                                : tr.integer(std::get<int64_t>(step)));
    }
    planner.emplace_back(tr.string(key), tr.tuple(std::move(steps)));
  }
  tr.root = w.object(kMetadataModule, "Metadata",
                     {{"state_dict_metadata", tr.dict(std::move(entries))},
                      {"planner_data", tr.dict(std::move(planner))},
                      {"storage_data", tr.dict(std::move(storage))},
                      {"storage_meta", tr.none()},
                      {"version", tr.string("1.0.0")}});
  return pickle::write(*tr.root);
}

std::string data_file(int rank) { return "__" + std::to_string(rank) + "_0.distcp"; }

}  // namespace accelerate::detail::dcp
