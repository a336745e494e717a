// torch.save's file format (see torch_save.h).
#include "checkpoint/torch_save.h"

#include "detail/dtype_names.h"
#include "detail/files.h"
#include "formats/torch_save.h"
#include "formats/zip.h"

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <stdexcept>

namespace accelerate::detail::checkpoint {

namespace {

// Note [torch.save files]
// Since PyTorch 1.6 torch.save writes a zip archive of stored (uncompressed) records: `data.pkl`,
// a protocol 2 pickle of the object whose tensors are calls of
// `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)` and
// whose storages are persistent ids ('storage', torch.<Type>Storage, key, location, numel),
// each storage's bytes in the record `data/<key>`. LibTorch's archive reader and writer
// (caffe2::serialize) handle the zip; the pickle is read as data by formats/pickle and
// interpreted here against a fixed list: tensors, storages, `collections.OrderedDict` and
// `torch._utils._rebuild_parameter` (a Parameter's tensor). Anything else is refused by name,
// except the modules a caller lists as skippable (numpy's arrays in random states), whose objects
// become null. So reading runs no code of the file's, like `torch.load(weights_only=True)`.
// Every tensor is checked against its storage (offset, sizes and strides within its bytes).
//
// A file of a few kilobytes must not cost gigabytes. So before the archive is opened, its
// central directory is read (formats/zip) and a compressed record, or one that claims more bytes
// than the file holds, is refused: no record then costs more memory than the file's size. Reading
// data.pkl costs at most one value per byte (formats/pickle: about 200 bytes each); a pickle that
// shares values into a walk of more than 16 times its size is refused before it is walked; and
// the walk itself is charged for what it builds (32 bytes per value visited, and every string,
// key and tensor name it copies) against 64 MiB plus 32 times the size of data.pkl. Paths
// ("state.0.exp_avg") are a stack of references to the pickle's keys, rendered only for a tensor's
// name or a message, so a long key shared through the memo by many levels costs nothing per
// level. Calls nest no deeper than values (kMaxDepth). Peak memory of reading a file of n bytes
// whose pickle has p bytes: about 232·p + 64 MiB, plus the records its tensors take (≤ n).

constexpr int kMaxDepth = pickle::kMaxDepth;

struct StorageType {
  const char* name;
  c10::ScalarType dtype;
};

constexpr StorageType kStorageTypes[] = {
    {"FloatStorage", c10::kFloat},       {"DoubleStorage", c10::kDouble},
    {"HalfStorage", c10::kHalf},         {"BFloat16Storage", c10::kBFloat16},
    {"LongStorage", c10::kLong},         {"IntStorage", c10::kInt},
    {"ShortStorage", c10::kShort},       {"CharStorage", c10::kChar},
    {"ByteStorage", c10::kByte},         {"BoolStorage", c10::kBool},
    {"ComplexFloatStorage", c10::kComplexFloat}, {"ComplexDoubleStorage", c10::kComplexDouble},
    {"UntypedStorage", c10::kByte},
};

const char* storage_name(c10::ScalarType dtype) {
  for (const auto& t : kStorageTypes) {
    if (t.dtype == dtype && std::string(t.name) != "UntypedStorage") return t.name;
  }
  TORCH_CHECK_VALUE(false, "torch.save has no storage type for ", dtype_name(dtype));
}

// What the values of a pickle may cost once interpreted, in bytes of JSON, strings and names:
// each value visited, each string and key copied, each tensor's dotted name.
constexpr size_t kCostPerValue = 32;
constexpr size_t kReadBudget = size_t{64} << 20;
constexpr size_t kReadBudgetPerByte = 32;

class Interpreter {
 public:
  Interpreter(caffe2::serialize::PyTorchStreamReader& archive, const TorchReadOptions& options, size_t budget)
      : archive_(archive), options_(options), budget_(budget) {}

  StateDict run(const pickle::Value& root) {
    StateDict out;
    out.values = value(&root, out.tensors, 0);
    return out;
  }

 private:
  using Value = pickle::Value;
  using K = Value::Kind;

  // One step of the path to the value being read: a key (a string of the pickle's) or an index.
  struct Step {
    const std::string* key;  // null: `index`
    int64_t index;
  };
  // The path as a stack of steps, rendered only for a message or a tensor's name, so that a long
  // key shared by many levels costs nothing per level.
  class Enter {
   public:
    Enter(std::vector<Step>& path, Step step) : path_(path) { path_.push_back(step); }
    ~Enter() { path_.pop_back(); }
    Enter(const Enter&) = delete;
    Enter& operator=(const Enter&) = delete;

   private:
    std::vector<Step>& path_;
  };

  std::string where() const {
    std::string out;
    for (const auto& step : path_) {
      if (!out.empty()) out += '.';
      out += step.key != nullptr ? *step.key : std::to_string(step.index);
    }
    return out;
  }
  size_t where_size() const {
    size_t n = 0;
    for (const auto& step : path_) n += 1 + (step.key != nullptr ? step.key->size() : 20);
    return n;
  }
  // The path for a message: keys longer than 64 bytes are cut, and so is a path of more than 16
  // steps, in its middle.
  std::string shown() const {
    std::string out;
    for (size_t i = 0; i < path_.size(); ++i) {
      if (path_.size() > 16 && i == 8) {
        out += ".….";
        i = path_.size() - 8;
      } else if (i > 0) {
        out += '.';
      }
      const auto& step = path_[i];
      if (step.key == nullptr) {
        out += std::to_string(step.index);
      } else {
        out.append(*step.key, 0, 64);
        if (step.key->size() > 64) out += "…";
      }
    }
    return out;
  }

  [[noreturn]] void refuse(const std::string& what) const {
    const auto path = shown();
    TORCH_CHECK_VALUE(false, path.empty() ? "the top level" : "\"" + path + "\"", " holds ", what);
  }
  void charge(size_t bytes) {
    if (bytes > budget_) {
      refuse("values that expand to more than " + std::to_string(spent_ + budget_) +
             " bytes once read (a bound of 64 MiB plus 32 times the size of data.pkl)");
    }
    budget_ -= bytes;
    spent_ += bytes;
  }

  bool skippable(const Value& global) const {
    for (const auto& module : options_.skippable_modules) {
      if (global.text == module || global.text.rfind(module + ".", 0) == 0) return true;
    }
    return false;
  }

  int64_t int_of(const Value* v, const char* what) const {
    if (v == nullptr || v->kind != K::kInt) refuse(std::string("a tensor whose ") + what + " is not an integer");
    return v->integer;
  }
  std::vector<int64_t> ints_of(const Value* v, const char* what) {
    if (v == nullptr || v->kind != K::kTuple) refuse(std::string("a tensor whose ") + what + " is not a tuple");
    if (v->items.size() > 64) refuse(std::string("a tensor whose ") + what + " has more than 64 dimensions");
    std::vector<int64_t> out;
    for (const auto* item : v->items) out.push_back(int_of(item, what));
    return out;
  }

  c10::Storage storage(const Value* pid, c10::ScalarType& dtype) {
    if (pid == nullptr || pid->kind != K::kPersistent || pid->items[0]->kind != K::kTuple) {
      refuse("a tensor whose storage is not a persistent id");
    }
    const auto& id = pid->items[0]->items;
    if (id.size() != 5 || id[0]->kind != K::kString || id[0]->text != "storage" || id[1]->kind != K::kGlobal ||
        id[2]->kind != K::kString || id[4]->kind != K::kInt) {
      refuse("a storage id other than ('storage', type, key, location, numel)");
    }
    const auto& type = *id[1];
    const StorageType* found = nullptr;
    for (const auto& t : kStorageTypes) {
      if ((type.text == "torch" || type.text == "torch.storage") && type.name == t.name) found = &t;
    }
    if (found == nullptr) refuse("a storage of type " + type.qualified_name());
    dtype = found->dtype;
    const auto& key = id[2]->text;
    if (key.size() > 64) refuse("a storage key longer than 64 bytes");
    const std::string record = "data/" + key;
    auto it = storages_.find(key);
    if (it == storages_.end()) {
      TORCH_CHECK_VALUE(key.find('/') == std::string::npos && archive_.hasRecord(record), "the archive has no record ",
                        record, " for \"", shown(), "\"");
      auto [data, size] = archive_.getRecord(record);
      c10::Storage s(c10::Storage::use_byte_size_t(), size, std::move(data), nullptr, /*resizable=*/false);
      it = storages_.emplace(key, std::move(s)).first;
    }
    const auto numel = id[4]->integer;
    const auto element = static_cast<int64_t>(c10::elementSize(dtype));
    TORCH_CHECK_VALUE(numel >= 0 && numel <= std::numeric_limits<int64_t>::max() / element &&
                          static_cast<uint64_t>(numel * element) == it->second.nbytes(),
                      "storage ", key, " of \"", shown(), "\" should hold ", numel, " elements of ", dtype_name(dtype),
                      " but its record holds ", it->second.nbytes(), " bytes");
    return it->second;
  }

  at::Tensor tensor(const Value& call) {
    const auto& args = call.args->items;
    if (args.size() < 4) refuse("a tensor with too few arguments");
    c10::ScalarType dtype;
    auto s = storage(args[0], dtype);
    const auto offset = int_of(args[1], "offset");
    const auto sizes = ints_of(args[2], "size");
    const auto strides = ints_of(args[3], "stride");
    if (sizes.size() != strides.size() || offset < 0) refuse("a tensor whose size, stride and offset disagree");
    // The last element's index, checked against the storage without overflowing.
    const int64_t elements = static_cast<int64_t>(s.nbytes() / c10::elementSize(dtype));
    bool empty = false;
    int64_t last = offset;
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (sizes[i] < 0 || strides[i] < 0) refuse("a tensor with a negative size or stride");
      if (sizes[i] == 0) empty = true;
      if (sizes[i] > 0 && strides[i] > 0 &&
          (sizes[i] - 1 > (std::numeric_limits<int64_t>::max() - last) / strides[i])) {
        refuse("a tensor larger than its storage");
      }
      if (sizes[i] > 0) last += (sizes[i] - 1) * strides[i];
    }
    if (!empty && last >= elements) {
      refuse("a tensor that reaches element " + std::to_string(last) + " of a storage of " + std::to_string(elements));
    }
    if (empty) return at::empty(sizes, at::TensorOptions().dtype(dtype));
    auto out = at::empty({0}, at::TensorOptions().dtype(dtype));
    out.set_(s, offset, sizes, strides);
    return out;
  }

  // A call: a tensor (added to `tensors`), an OrderedDict, or an object of a skippable module.
  nlohmann::json call(const Value& v, TensorMap& tensors, int depth) {
    if (depth > kMaxDepth) refuse("values nested deeper than " + std::to_string(kMaxDepth));
    const auto& name = v.callable->qualified_name();
    if (skippable(*v.callable)) {
      if (options_.skipped != nullptr) {
        const auto path = shown();
        charge(path.size() + name.size());
        options_.skipped->push_back(path.empty() ? name : path + " (" + name + ")");
      }
      return nullptr;
    }
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor") {
      charge(where_size());
      tensors.insert_or_assign(where(), tensor(v));
      tensor_path_size_ = path_.size();
      return nullptr;
    }
    if (name == "torch._utils._rebuild_parameter" && !v.args->items.empty() && v.args->items[0]->kind == K::kCall) {
      charge(kCostPerValue);
      return call(*v.args->items[0], tensors, depth + 1);
    }
    if (name == "collections.OrderedDict" && v.args->items.empty() && v.items.empty()) {
      // A module's state_dict() carries its modules' versions as the attribute `_metadata`,
      // which only Python's load_state_dict reads.
      bool plain = v.state == nullptr || v.state->kind == K::kNone || v.state->kind == K::kDict;
      if (plain && v.state != nullptr && v.state->kind == K::kDict) {
        for (const auto& [k, x] : v.state->entries) plain = plain && k->kind == K::kString && k->text == "_metadata";
      }
      if (!plain) refuse("an OrderedDict with attributes other than _metadata");
      return entries(v.entries, tensors, depth);
    }
    refuse("an object of " + name + ", which is not read (only plain values, tensors and OrderedDicts are)");
  }

  nlohmann::json entries(const std::vector<std::pair<const Value*, const Value*>>& items, TensorMap& tensors,
                         int depth) {
    auto out = nlohmann::json::object();
    for (const auto& [k, x] : items) {
      std::string number;
      const std::string* key = &k->text;
      if (k->kind == K::kInt) {
        number = std::to_string(k->integer);
        key = &number;
      } else if (k->kind != K::kString) {
        refuse("a dict key that is neither a string nor an integer");
      }
      charge(kCostPerValue + key->size());
      if (out.contains(*key)) refuse("the key " + key->substr(0, 100) + " twice");
      Enter enter(path_, {k->kind == K::kInt ? nullptr : key, k->integer});
      tensor_path_size_ = 0;
      auto item = value(x, tensors, depth + 1);
      if (tensor_path_size_ != path_.size()) out[*key] = std::move(item);
    }
    return out;
  }

  nlohmann::json value(const Value* v, TensorMap& tensors, int depth) {
    if (depth > kMaxDepth) refuse("values nested deeper than " + std::to_string(kMaxDepth));
    charge(kCostPerValue);
    switch (v->kind) {
      case K::kNone: return nullptr;
      case K::kBool: return v->boolean;
      case K::kInt: return v->integer;
      case K::kFloat: return v->number;
      case K::kString: charge(v->text.size()); return v->text;
      case K::kList:
      case K::kTuple: {
        auto out = nlohmann::json::array();
        for (size_t i = 0; i < v->items.size(); ++i) {
          Enter enter(path_, {nullptr, static_cast<int64_t>(i)});
          out.push_back(value(v->items[i], tensors, depth + 1));
        }
        return out;
      }
      case K::kDict: return entries(v->entries, tensors, depth);
      case K::kCall: return call(*v, tensors, depth);
      case K::kBytes: refuse("bytes, which are not read");
      case K::kSet: refuse("a set, which is not read");
      case K::kGlobal:
        if (skippable(*v)) return nullptr;
        refuse("the name " + v->qualified_name() + ", which is not read");
      case K::kPersistent: refuse("a storage outside a tensor, which is not read");
    }
    refuse("an unknown value");
  }

  caffe2::serialize::PyTorchStreamReader& archive_;
  const TorchReadOptions& options_;
  size_t budget_;
  size_t spent_ = 0;
  std::vector<Step> path_;
  size_t tensor_path_size_ = 0;  // the length of the path of the tensor taken out last
  std::map<std::string, c10::Storage> storages_;
};

// Every record stored as torch.save writes it (uncompressed), within the archive, so that no
// record costs more memory to read than the archive's size.
void check_records(const std::string& path, uint64_t offset, uint64_t size) {
  std::vector<zip::Record> records;
  try {
    records = zip::read_directory(path, offset, size);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, e.what());  // reported as an archive that is not valid
  }
  torch_save::check_records(records, size);
}

// The bytes of an archive that lies `size` bytes from `offset` within a file, for LibTorch's
// archive reader.
class FileRange final : public caffe2::serialize::ReadAdapterInterface {
 public:
  FileRange(const std::string& path, uint64_t offset, uint64_t size)
      : in_(path, std::ios::binary), offset_(offset), size_(size) {
    TORCH_CHECK_VALUE(in_.good(), "cannot open the file");
  }
  size_t size() const override { return size_; }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/ = "") const override {
    if (pos >= size_) return 0;
    n = static_cast<size_t>(std::min<uint64_t>(n, size_ - pos));
    in_.clear();
    in_.seekg(static_cast<std::streamoff>(offset_ + pos));
    in_.read(static_cast<char*>(buf), static_cast<std::streamsize>(n));
    return static_cast<size_t>(in_.gcount());
  }

 private:
  mutable std::ifstream in_;
  uint64_t offset_, size_;
};

StateDict read_archive(const std::string& path, uint64_t offset, uint64_t size, const TorchReadOptions& options) {
  check_records(path, offset, size);
  caffe2::serialize::PyTorchStreamReader archive(std::make_shared<FileRange>(path, offset, size));
  TORCH_CHECK_VALUE(archive.hasRecord("data.pkl"), "the archive has no data.pkl (a TorchScript archive is not read)");
  auto [data, data_size] = archive.getRecord("data.pkl");
  const auto tree = pickle::read(std::string_view(static_cast<const char*>(data.get()), data_size));
  // Walking shared values costs what the walk visits: bounded by a multiple of the file.
  const size_t limit = std::max<size_t>(size_t{1} << 20, 16 * data_size);
  TORCH_CHECK_VALUE(pickle::expanded_size(*tree.root, limit) < limit, "data.pkl shares its values into more than ",
                    limit, " places");
  return Interpreter(archive, options, kReadBudget + kReadBudgetPerByte * data_size).run(*tree.root);
}

// Reading's errors as ValueErrors that name `what`.
template <typename F>
StateDict naming(const std::string& what, F&& read) {
  try {
    return read();
  } catch (const c10::ValueError& e) {
    C10_THROW_ERROR(ValueError, c10::str(what, ": ", e.what_without_backtrace()));
  } catch (const c10::Error& e) {
    C10_THROW_ERROR(ValueError, c10::str(what, " is not a valid torch.save archive: ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    C10_THROW_ERROR(ValueError, c10::str(what, ": ", e.what()));
  }
}

}  // namespace

StateDict read_torch_save(const std::string& path, const TorchReadOptions& options) {
  TORCH_CHECK_VALUE(std::filesystem::is_regular_file(path), path, " does not exist");
  TORCH_CHECK_VALUE(torch_save::is_zip_file(path), path,
                    " is not a zip archive written by torch.save (files of the legacy format, "
                    "torch.save(..., _use_new_zipfile_serialization=False), are not read: load and save it again in "
                    "Python)");
  return naming(path, [&] { return read_archive(path, 0, std::filesystem::file_size(path), options); });
}

StateDict read_torch_save_at(const std::string& path, uint64_t offset, uint64_t size, const TorchReadOptions& options) {
  return naming(c10::str(path, " at byte ", offset), [&] { return read_archive(path, offset, size, options); });
}

// ---- writing -----------------------------------------------------------------------------------

const pickle::Value* TorchSaveWriter::tensor(const at::Tensor& t) {
  auto cpu = t.detach().to(at::kCPU).contiguous();
  if (cpu.storage_offset() != 0 || cpu.numel() * cpu.element_size() != static_cast<int64_t>(cpu.storage().nbytes())) {
    cpu = cpu.clone();
  }
  const auto key = std::to_string(storages_.size());
  storages_.push_back(cpu);
  return torch_save::rebuild_tensor(tree_, storage_name(cpu.scalar_type()), key, cpu.numel(), cpu.sizes().vec(),
                                    cpu.strides().vec());
}

const pickle::Value* TorchSaveWriter::ordered_dict(
    std::vector<std::pair<const pickle::Value*, const pickle::Value*>> entries) {
  return torch_save::ordered_dict(tree_, std::move(entries));
}

const pickle::Value* TorchSaveWriter::from_json(const nlohmann::json& value) {
  return torch_save::from_json(tree_, value);
}

uint64_t TorchSaveWriter::write_to(const pickle::Value* root, SequentialWriter& out, const std::string& what) {
  std::string pickled;
  try {
    pickled = pickle::write(*root);
  } catch (const std::invalid_argument& e) {
    C10_THROW_ERROR(ValueError, c10::str(what, ": ", e.what()));
  }
  uint64_t written = 0;
  caffe2::serialize::PyTorchStreamWriter archive([&](const void* data, size_t size) -> size_t {
    auto piece = std::make_shared<std::string>(static_cast<const char*>(data), size);
    out.write(piece->data(), piece->size(), piece);
    written += size;
    return size;
  });
  archive.writeRecord("data.pkl", pickled.data(), pickled.size());
  static const std::string little = "little";
  archive.writeRecord("byteorder", little.data(), little.size());
  for (size_t i = 0; i < storages_.size(); ++i) {
    const auto& s = storages_[i];
    archive.writeRecord("data/" + std::to_string(i), s.data_ptr(), s.numel() * s.element_size());
  }
  archive.writeEndOfFile();
  return written;
}

void TorchSaveWriter::write(const pickle::Value* root, const std::string& path) {
  write_file_atomically(path, [&](SequentialWriter& out) { write_to(root, out, path); });
}

}  // namespace accelerate::detail::checkpoint
