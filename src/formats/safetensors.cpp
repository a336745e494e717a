// Header validation and layout for safetensors files; see safetensors.h.
#include "formats/safetensors.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <tuple>
#include <utility>

namespace accelerate::detail::safetensors_format {

// Note [Safetensors validation]
// A file is an 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the data.
// The JSON is an object whose keys are tensor names, plus an optional "__metadata__" object of
// string values. Each tensor is an object with exactly "dtype" (a name the format defines),
// "shape" (non-negative integers) and "data_offsets" ([begin, end] into the data section).
// We reject, before any tensor is read: N past 100 MB or past the file; a header that is not
// UTF-8 (checked on the bytes, then again by the JSON lexer inside strings), starts with a byte
// order mark or holds a NUL byte (nlohmann would stop reading there); JSON that is malformed, has
// a duplicate key in any object (nlohmann's DOM keeps one silently, so the header is read through
// a SAX handler that sees every key), or does not follow the schema (unknown or missing keys,
// wrong types, negative or fractional numbers); an unknown dtype; a byte range that disagrees
// with shape × dtype size (overflow-checked); ranges that, sorted by (begin, end), do not tile
// [0, data size) exactly — the first must start at 0, each must start where the previous ended,
// and the last must end at the end of the file. Trailing whitespace after the JSON (the
// reference writer pads with spaces) is accepted.

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts are not supported");

namespace {

// The reference implementation's Dtype enum, in its order (which grows with the element size).
constexpr DtypeInfo kDtypes[] = {
    {"BOOL", 8, 0},         {"F4", 4, 1},      {"F6_E2M3", 6, 2}, {"F6_E3M2", 6, 3}, {"U8", 8, 4},
    {"I8", 8, 5},           {"F8_E5M2", 8, 6}, {"F8_E4M3", 8, 7}, {"F8_E8M0", 8, 8}, {"F8_E4M3FNUZ", 8, 9},
    {"F8_E5M2FNUZ", 8, 10}, {"I16", 16, 11},   {"U16", 16, 12},   {"F16", 16, 13},   {"BF16", 16, 14},
    {"I32", 32, 15},        {"U32", 32, 16},   {"F32", 32, 17},   {"C64", 64, 18},   {"F64", 64, 19},
    {"I64", 64, 20},        {"U64", 64, 21},
};

constexpr size_t kMaxQuotedBytes = 120;

}  // namespace

std::string printable(std::string_view text) {
  const bool utf8 = is_valid_utf8(text);
  std::string out = "'";
  size_t count = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (count >= kMaxQuotedBytes && (!utf8 || (c & 0xC0) != 0x80)) {
      out += "...";
      break;
    }
    if (c < 0x20 || c == 0x7F || (!utf8 && c >= 0x80)) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
    } else {
      out += static_cast<char>(c);
    }
    ++count;
  }
  out += "'";
  return out;
}

namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::invalid_argument(message.str());
}

// Builds a Header from nlohmann's SAX events, enforcing the schema as they arrive. Nesting is
// bounded (root object, entry object, shape array), so memory stays proportional to the input.
class HeaderReader {
 public:
  using json = nlohmann::json;

  explicit HeaderReader(Header& header) : header_(header) {}

  bool null() { return value(Kind::kNull); }
  bool boolean(bool) { return value(Kind::kBoolean); }
  bool number_integer(json::number_integer_t v) {
    if (v < 0) return value(Kind::kNegative);
    return number(static_cast<uint64_t>(v));
  }
  bool number_unsigned(json::number_unsigned_t v) { return number(v); }
  bool number_float(json::number_float_t, const json::string_t&) { return value(Kind::kFloat); }
  bool string(json::string_t& v) {
    if (where_ == Where::kMetadata) {
      header_.metadata.emplace(key_, v);
      return true;
    }
    if (where_ == Where::kEntry && key_ == "dtype") {
      entry_.dtype = v;
      return true;
    }
    return value(Kind::kString);
  }
  bool binary(json::binary_t&) { return value(Kind::kOther); }

  bool start_object(std::size_t) {
    switch (where_) {
      case Where::kTop:
        where_ = Where::kRoot;
        return true;
      case Where::kRoot:
        if (key_ == "__metadata__") {
          where_ = Where::kMetadata;
        } else {
          where_ = Where::kEntry;
          entry_name_ = key_;
          entry_ = Entry{};
          seen_ = 0;
        }
        return true;
      default:
        return value(Kind::kObject);
    }
  }

  bool key(json::string_t& k) {
    switch (where_) {
      case Where::kRoot:
        if (k == "__metadata__" ? metadata_seen_ : header_.entries.count(k) > 0) {
          fail("duplicate key ", printable(k), " in the header");
        }
        if (k == "__metadata__") metadata_seen_ = true;
        break;
      case Where::kMetadata:
        if (header_.metadata.count(k) > 0) fail("duplicate key ", printable(k), " in \"__metadata__\"");
        break;
      case Where::kEntry: {
        const unsigned bit = k == "dtype" ? 1u : k == "shape" ? 2u : k == "data_offsets" ? 4u : 0u;
        if (bit == 0) {
          fail("unknown key ", printable(k), " in tensor ", printable(entry_name_),
               " (expected exactly \"dtype\", \"shape\" and \"data_offsets\")");
        }
        if ((seen_ & bit) != 0) fail("duplicate key ", printable(k), " in tensor ", printable(entry_name_));
        seen_ |= bit;
        break;
      }
      default:
        fail("unexpected key ", printable(k), " in the header");  // unreachable: arrays have no keys
    }
    key_ = k;
    return true;
  }

  bool end_object() {
    switch (where_) {
      case Where::kMetadata:
        where_ = Where::kRoot;
        return true;
      case Where::kEntry:
        for (auto [bit, name] : {std::pair{1u, "dtype"}, std::pair{2u, "shape"}, std::pair{4u, "data_offsets"}}) {
          if ((seen_ & bit) == 0) fail("tensor ", printable(entry_name_), " has no \"", name, "\"");
        }
        header_.entries.emplace(entry_name_, std::move(entry_));
        where_ = Where::kRoot;
        return true;
      case Where::kRoot:
        where_ = Where::kDone;
        return true;
      default:
        fail("unbalanced object in the header");  // unreachable: the parser checks nesting
    }
  }

  bool start_array(std::size_t) {
    if (where_ == Where::kEntry && key_ == "shape") {
      where_ = Where::kShape;
      return true;
    }
    if (where_ == Where::kEntry && key_ == "data_offsets") {
      where_ = Where::kOffsets;
      offsets_.clear();
      return true;
    }
    return value(Kind::kArray);
  }

  bool end_array() {
    if (where_ == Where::kShape) {
      where_ = Where::kEntry;
      return true;
    }
    if (where_ == Where::kOffsets) {
      if (offsets_.size() != 2) bad_offsets();
      entry_.begin = offsets_[0];
      entry_.end = offsets_[1];
      where_ = Where::kEntry;
      return true;
    }
    fail("unbalanced array in the header");  // unreachable: the parser checks nesting
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) {
    fail("the header is not valid JSON: ", e.what());
  }

 private:
  enum class Where { kTop, kRoot, kMetadata, kEntry, kShape, kOffsets, kDone };
  enum class Kind { kNull, kBoolean, kNegative, kFloat, kString, kObject, kArray, kOther };

  bool number(uint64_t v) {
    if (where_ == Where::kShape) {
      if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        fail("dimension ", v, " of tensor ", printable(entry_name_), " is too large");
      }
      entry_.shape.push_back(static_cast<int64_t>(v));
      return true;
    }
    if (where_ == Where::kOffsets) {
      if (offsets_.size() == 2) bad_offsets();
      offsets_.push_back(v);
      return true;
    }
    return value(Kind::kOther);
  }

  [[noreturn]] void bad_offsets() const {
    fail("\"data_offsets\" of tensor ", printable(entry_name_), " is not a pair [begin, end] of non-negative integers");
  }

  // Any value the schema does not allow where it appears.
  [[noreturn]] bool value(Kind kind) {
    switch (where_) {
      case Where::kTop:
        fail("the header is not a JSON object");
      case Where::kRoot:
        if (key_ == "__metadata__") fail("\"__metadata__\" is not an object of strings");
        fail("tensor ", printable(key_), " is not an object");
      case Where::kMetadata:
        fail("\"__metadata__\" value of ", printable(key_), " is not a string");
      case Where::kEntry:
        if (key_ == "dtype") fail("\"dtype\" of tensor ", printable(entry_name_), " is not a string");
        fail("\"", key_, "\" of tensor ", printable(entry_name_), " is not an array");
      case Where::kShape:
        fail("\"shape\" of tensor ", printable(entry_name_), " holds ",
             kind == Kind::kNegative ? "a negative number"
             : kind == Kind::kFloat  ? "a fractional or out-of-range number"
                                     : "a non-integer",
             "; expected non-negative integers");
      case Where::kOffsets:
        bad_offsets();
      case Where::kDone:
        break;
    }
    fail("unexpected value after the header object");  // unreachable: the parser stops at the end
  }

  Header& header_;
  Where where_ = Where::kTop;
  std::string key_;
  std::string entry_name_;
  Entry entry_;
  unsigned seen_ = 0;
  bool metadata_seen_ = false;
  std::vector<uint64_t> offsets_;
};

// Bytes that `shape` elements of `dtype` occupy; throws when the shape overflows or fills no
// whole number of bytes.
uint64_t byte_size(const std::string& name, const DtypeInfo& dtype, const std::vector<int64_t>& shape) {
  // LibTorch computes contiguous strides as products of the dimensions (zeros counted as one),
  // so those products must fit in int64 even when a zero makes the tensor empty.
  uint64_t extent = 1;
  uint64_t elements = 1;
  for (int64_t dim : shape) {
    const auto d = static_cast<uint64_t>(dim);
    if (__builtin_mul_overflow(extent, std::max<uint64_t>(d, 1), &extent) ||
        extent > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail("the shape ", shape_string(shape), " of tensor ", printable(name),
           " is too large: its dimensions multiply past 2^63");
    }
    elements *= d;  // at most `extent`
  }
  uint64_t bits = static_cast<uint64_t>(dtype.bits);
  if (__builtin_mul_overflow(elements, bits, &bits)) {
    fail("the size of tensor ", printable(name), " (shape ", shape_string(shape), ", dtype ", dtype.name,
         ") overflows 64 bits");
  }
  if (bits % 8 != 0) {
    fail("tensor ", printable(name), " of dtype ", dtype.name, " and shape ", shape_string(shape),
         " does not fill a whole number of bytes");
  }
  return bits / 8;
}

void put_le64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
}

}  // namespace

const DtypeInfo* find_dtype(std::string_view name) {
  for (const auto& d : kDtypes) {
    if (d.name == name) return &d;
  }
  return nullptr;
}

bool is_valid_utf8(std::string_view text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const auto* end = p + text.size();
  while (p < end) {
    const unsigned char c = *p;
    if (c < 0x80) {
      ++p;
      continue;
    }
    // Ranges of the second byte per lead byte (RFC 3629, table 3-7 of the Unicode standard).
    int length = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      length = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      length = 3;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      length = 4;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (end - p < length) return false;
    if (p[1] < lo || p[1] > hi) return false;
    for (int i = 2; i < length; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
    }
    p += length;
  }
  return true;
}

Header parse(std::string_view file) {
  if (file.size() < 8) fail("the file has ", file.size(), " bytes, fewer than the 8 of the header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[static_cast<size_t>(i)]);
  if (n > kMaxHeaderSize) fail("the header length ", n, " exceeds the format's limit of ", kMaxHeaderSize, " bytes");
  if (n > file.size() - 8) fail("the header length ", n, " runs past the end of the file (", file.size(), " bytes)");
  const std::string_view text = file.substr(8, n);
  if (!is_valid_utf8(text)) fail("the header is not valid UTF-8");
  if (text.substr(0, 3) == "\xEF\xBB\xBF") fail("the header starts with a byte order mark; expected a JSON object");
  // nlohmann's lexer takes a NUL byte for the end of the input and would ignore what follows;
  // in valid JSON a NUL can only appear escaped.
  if (const auto nul = text.find('\0'); nul != std::string_view::npos) {
    fail("the header is not valid JSON: a NUL byte at offset ", nul);
  }

  Header header;
  header.header_size = n;
  header.data_size = file.size() - 8 - n;
  HeaderReader reader(header);
  nlohmann::json::sax_parse(text.begin(), text.end(), &reader);

  // Shapes against sizes, then the ranges in file order must tile the data section.
  std::vector<std::pair<const std::string*, const Entry*>> sorted;
  sorted.reserve(header.entries.size());
  for (const auto& [name, entry] : header.entries) {
    const DtypeInfo* dtype = find_dtype(entry.dtype);
    if (dtype == nullptr)
      fail("tensor ", printable(name), " has dtype ", printable(entry.dtype), ", which the format does not define");
    if (entry.end < entry.begin) {
      fail("\"data_offsets\" of tensor ", printable(name), " end (", entry.end, ") before they begin (", entry.begin,
           ")");
    }
    const uint64_t expected = byte_size(name, *dtype, entry.shape);
    if (entry.end - entry.begin != expected) {
      fail("tensor ", printable(name), " spans ", entry.end - entry.begin, " bytes, but shape ",
           shape_string(entry.shape), " of dtype ", dtype->name, " needs ", expected);
    }
    sorted.emplace_back(&name, &entry);
  }
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
    return std::tie(a.second->begin, a.second->end, *a.first) < std::tie(b.second->begin, b.second->end, *b.first);
  });
  uint64_t position = 0;
  const std::string* previous = nullptr;
  for (const auto& [name, entry] : sorted) {
    if (entry->begin < position) {
      fail("tensor ", printable(*name), " (bytes ", entry->begin, "..", entry->end, ") overlaps tensor ",
           printable(*previous), " (which ends at ", position, ")");
    }
    if (entry->begin > position) {
      if (previous == nullptr)
        fail("the data does not start at offset 0: the first tensor, ", printable(*name), ", begins at ", entry->begin);
      fail("the data is not contiguous: bytes ", position, "..", entry->begin, " between tensors ",
           printable(*previous), " and ", printable(*name), " belong to no tensor");
    }
    position = entry->end;
    previous = name;
  }
  if (position > header.data_size) {
    fail("tensor ", printable(*previous), " ends at byte ", position, " of the data, but the file holds only ",
         header.data_size, " bytes of data (the file is truncated)");
  }
  if (position < header.data_size) {
    fail(header.data_size - position, " bytes at the end of the file belong to no tensor (the tensors end at byte ",
         position, " of ", header.data_size, ")");
  }
  return header;
}

Layout plan(const std::vector<TensorSpec>& tensors, const std::map<std::string, std::string>& metadata) {
  std::vector<const DtypeInfo*> dtypes;
  dtypes.reserve(tensors.size());
  for (const auto& t : tensors) {
    if (t.name.empty()) fail("a tensor name is empty");
    if (t.name.rfind("__metadata__", 0) == 0) fail("tensor name ", printable(t.name), " is reserved for the metadata");
    if (!is_valid_utf8(t.name)) fail("tensor name ", printable(t.name), " is not valid UTF-8");
    const DtypeInfo* dtype = find_dtype(t.dtype);
    if (dtype == nullptr)
      fail("tensor ", printable(t.name), " has dtype ", printable(t.dtype), ", which the format does not define");
    for (int64_t dim : t.shape) {
      if (dim < 0) fail("tensor ", printable(t.name), " has a negative dimension in shape ", shape_string(t.shape));
    }
    const uint64_t expected = byte_size(t.name, *dtype, t.shape);
    if (t.nbytes != expected) {
      fail("tensor ", printable(t.name), " has ", t.nbytes, " bytes, but shape ", shape_string(t.shape), " of dtype ",
           dtype->name, " needs ", expected);
    }
    dtypes.push_back(dtype);
  }
  for (const auto& [key, value] : metadata) {
    if (!is_valid_utf8(key)) fail("metadata key ", printable(key), " is not valid UTF-8");
    if (!is_valid_utf8(value)) fail("metadata value of ", printable(key), " is not valid UTF-8");
  }

  Layout layout;
  layout.order.resize(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) layout.order[i] = i;
  // Decreasing rank keeps every tensor aligned: each size before it is a multiple of its own.
  std::sort(layout.order.begin(), layout.order.end(), [&](size_t a, size_t b) {
    if (dtypes[a]->rank != dtypes[b]->rank) return dtypes[a]->rank > dtypes[b]->rank;
    return tensors[a].name < tensors[b].name;
  });
  for (size_t i = 1; i < layout.order.size(); ++i) {
    const auto& name = tensors[layout.order[i]].name;
    if (name == tensors[layout.order[i - 1]].name) fail("tensor name ", printable(name), " appears twice");
  }

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (size_t index : layout.order) {
    const auto& t = tensors[index];
    if (__builtin_add_overflow(offset, t.nbytes, &offset)) fail("the tensors hold more than 2^64 bytes");
    header[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset - t.nbytes, offset}}};
  }
  layout.data_size = offset;

  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');
  if (text.size() > kMaxHeaderSize) {
    fail("the header would have ", text.size(), " bytes, more than the format's limit of ", kMaxHeaderSize);
  }
  layout.prefix.reserve(8 + text.size());
  put_le64(layout.prefix, text.size());
  layout.prefix += text;
  return layout;
}

}  // namespace accelerate::detail::safetensors_format
