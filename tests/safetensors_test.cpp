// The safetensors reader and writer (utils/safetensors.h, formats/safetensors.h): round trips
// of every dtype, zero-copy views, golden bytes, every rule a hostile file can break, the
// writer's refusals, atomic saves, and a cross-check against an independent Python reader and
// writer (tests/python/safetensors_check.py, standard library only).
#include "accelerate/utils/safetensors.h"

#include "detail/files.h"
#include "support/process.h"
#include "support/test_support.h"
#include "formats/safetensors.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
namespace format = detail::safetensors_format;
namespace fs = std::filesystem;

std::string le64(uint64_t v) {
  std::string out;
  for (int i = 0; i < 8; ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
  return out;
}

// A file with `header` as is (no padding) followed by `data`.
std::string file_of(const std::string& header, const std::string& data = {}) {
  return le64(header.size()) + header + data;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::string> folder_entries(const fs::path& folder) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(folder)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// The message of the ValueError raised when opening `bytes` from memory.
std::string rejection(const std::string& bytes) {
  try {
    SafetensorsFile::from_bytes(bytes);
  } catch (const c10::ValueError& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a ValueError, got: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected the file to be rejected";
  return {};
}

// Every rejection names the API and "<memory>" before the rule.
#define EXPECT_REJECTED(bytes, substring)                                                     \
  do {                                                                                        \
    const std::string message_ = rejection(bytes);                                            \
    EXPECT_THAT(message_, HasSubstr("[SafetensorsFile::from_bytes] <memory>: ")) << message_; \
    EXPECT_THAT(message_, HasSubstr(substring));                                              \
  } while (false)

// A one-tensor header: {"t":{"dtype":…,"shape":…,"data_offsets":…}}.
std::string one_tensor(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return R"({"t":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}}";
}

// Whether [data, data + bytes) lies inside a mapping of `path` in this process.
bool inside_mapping_of(const void* data, const std::string& path) {
  const auto address = reinterpret_cast<uintptr_t>(data);
  const std::string canonical = fs::weakly_canonical(path).string();
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    std::istringstream fields(line);
    std::string range, perms, offset, device, inode, file;
    fields >> range >> perms >> offset >> device >> inode;
    std::getline(fields >> std::ws, file);
    if (file != canonical && file != canonical + " (deleted)") continue;
    const auto dash = range.find('-');
    const uintptr_t begin = std::stoull(range.substr(0, dash), nullptr, 16);
    const uintptr_t end = std::stoull(range.substr(dash + 1), nullptr, 16);
    if (begin <= address && address < end) return true;
  }
  return false;
}

bool is_mapped(const std::string& path) {
  const std::string canonical = fs::weakly_canonical(path).string();
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find(canonical) != std::string::npos) return true;
  }
  return false;
}

// One tensor of each dtype the writer supports, with values that exercise the whole range.
TensorMap every_dtype() {
  at::manual_seed(7);
  TensorMap tensors;
  tensors["bool"] = at::randint(0, 2, {5}).to(at::kBool);
  tensors["u8"] = at::randint(0, 256, {2, 3}).to(at::kByte);
  tensors["i8"] = at::randint(-128, 128, {7}).to(at::kChar);
  tensors["i16"] = at::randint(-32768, 32768, {3, 1}).to(at::kShort);
  tensors["i32"] = at::tensor({std::numeric_limits<int32_t>::min(), 0, std::numeric_limits<int32_t>::max()}, at::kInt);
  tensors["i64"] =
      at::tensor({std::numeric_limits<int64_t>::min(), int64_t{-1}, std::numeric_limits<int64_t>::max()}, at::kLong);
  tensors["f16"] = at::randn({4, 2}).to(at::kHalf);
  tensors["bf16"] = at::randn({3}).to(at::kBFloat16);
  tensors["f32"] = at::randn({2, 3, 4});
  tensors["f64"] = at::randn({5}, at::kDouble);
  tensors["c64"] = at::randn({2, 2}, at::kComplexFloat);
  return tensors;
}

void expect_same(const TensorMap& expected, const TensorMap& actual) {
  ASSERT_EQ(expected.size(), actual.size());
  for (const auto& [name, tensor] : expected) {
    ASSERT_TRUE(actual.count(name)) << name;
    const auto& got = actual.at(name);
    EXPECT_EQ(got.scalar_type(), tensor.scalar_type()) << name;
    EXPECT_EQ(got.sizes(), tensor.sizes()) << name;
    EXPECT_TRUE(at::equal(got, tensor)) << name;
  }
}

// ---- dtype names ----------------------------------------------------------------------------

TEST(SafetensorsDtype, EveryDtypeTheFormatNamesRoundTripsThroughItsName) {
  const std::vector<std::pair<c10::ScalarType, std::string>> names = {
      {at::kBool, "BOOL"}, {at::kByte, "U8"},    {at::kChar, "I8"},         {at::kShort, "I16"},
      {at::kInt, "I32"},   {at::kLong, "I64"},   {at::kHalf, "F16"},        {at::kBFloat16, "BF16"},
      {at::kFloat, "F32"}, {at::kDouble, "F64"}, {at::kComplexFloat, "C64"}};
  for (const auto& [dtype, name] : names) {
    EXPECT_EQ(safetensors_dtype_name(dtype), name);
    EXPECT_EQ(safetensors_dtype(name), dtype);
  }
}

TEST(SafetensorsDtype, DtypesTheFormatHasNoNameForAreValueErrors) {
  for (auto dtype : {at::kComplexDouble, at::kComplexHalf, at::kQInt8, at::kQUInt8, at::kQInt32}) {
    EXPECT_THROW(safetensors_dtype_name(dtype), c10::ValueError);
    EXPECT_THROWS_WITH(safetensors_dtype_name(dtype), "has no name for dtype " + std::string(c10::toString(dtype)));
  }
}

TEST(SafetensorsDtype, FormatDtypesLibTorchCannotRepresentAreNamed) {
  for (const char* name : {"U16", "U32", "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3"}) {
    EXPECT_THROW(safetensors_dtype(name), c10::ValueError);
    EXPECT_THROWS_WITH(safetensors_dtype(name), std::string("LibTorch cannot represent safetensors dtype ") + name);
  }
}

TEST(SafetensorsDtype, NamesOutsideTheFormatAreValueErrors) {
  for (const char* name : {"F128", "f32", "", "C128"}) {
    EXPECT_THROW(safetensors_dtype(name), c10::ValueError);
    EXPECT_THROWS_WITH(safetensors_dtype(name), "is not a safetensors dtype");
  }
}

// ---- round trips ----------------------------------------------------------------------------

TEST(SafetensorsRoundTrip, EverySupportedDtypeSurvivesAFile) {
  TempDir dir;
  const auto path = (dir.path() / "all.safetensors").string();
  const auto tensors = every_dtype();
  save_file(tensors, path);
  expect_same(tensors, load_file(path));
  SafetensorsFile file(path);
  for (const auto& [name, tensor] : tensors) {
    EXPECT_EQ(file.entry(name).dtype, safetensors_dtype_name(tensor.scalar_type()));
    EXPECT_EQ(file.entry(name).shape, tensor.sizes().vec());
    EXPECT_TRUE(at::equal(file.get_tensor(name), tensor)) << name;
  }
}

TEST(SafetensorsRoundTrip, EverySupportedDtypeSurvivesMemory) {
  const auto tensors = every_dtype();
  expect_same(tensors, load(save(tensors)));
}

TEST(SafetensorsRoundTrip, TheFileHoldsExactlyTheBytesSaveReturns) {
  TempDir dir;
  const auto path = (dir.path() / "all.safetensors").string();
  const auto tensors = every_dtype();
  save_file(tensors, path, {{"format", "pt"}});
  EXPECT_EQ(read_bytes(path), save(tensors, {{"format", "pt"}}));
}

TEST(SafetensorsRoundTrip, EmptyAndZeroDimTensorsSurvive) {
  TensorMap tensors;
  tensors["scalar_f64"] = at::scalar_tensor(3.25, at::kDouble);
  tensors["scalar_bool"] = at::scalar_tensor(true, at::kBool);
  tensors["empty"] = at::empty({0}, at::kFloat);
  tensors["empty_2d"] = at::empty({2, 0, 3}, at::kLong);
  tensors["empty_half"] = at::empty({0, 5}, at::kHalf);
  TempDir dir;
  const auto path = (dir.path() / "edge.safetensors").string();
  save_file(tensors, path);
  const auto loaded = load_file(path);
  expect_same(tensors, loaded);
  EXPECT_EQ(loaded.at("scalar_f64").dim(), 0);
  EXPECT_EQ(loaded.at("scalar_f64").item<double>(), 3.25);
  SafetensorsFile file(path);
  EXPECT_EQ(file.entry("empty_2d").begin, file.entry("empty_2d").end);
  EXPECT_TRUE(file.entry("scalar_f64").shape.empty());
}

TEST(SafetensorsRoundTrip, AFileWithNoTensorsSurvives) {
  const std::string bytes = save({}, {{"format", "pt"}});
  const auto file = SafetensorsFile::from_bytes(bytes);
  EXPECT_TRUE(file.keys().empty());
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_TRUE(load(save({})).empty());
}

TEST(SafetensorsRoundTrip, NonContiguousInputsAreWrittenContiguous) {
  const auto base = at::arange(24, at::kFloat).reshape({4, 6});
  TensorMap tensors;
  tensors["transposed"] = base.t();
  tensors["strided"] = base.slice(1, 0, 6, 2);
  tensors["expanded"] = at::arange(3, at::kLong).expand({4, 3});
  tensors["conjugated"] = at::randn({3}, at::kComplexFloat).conj();
  tensors["negated"] = at::_neg_view(at::randn({3}, at::kComplexFloat));
  for (const auto& [name, tensor] : tensors)
    ASSERT_FALSE(tensor.is_contiguous() && !tensor.is_conj() && !tensor.is_neg()) << name;
  const auto bytes = save(tensors);
  const auto loaded = load(bytes);
  for (const auto& [name, tensor] : tensors) {
    EXPECT_TRUE(loaded.at(name).is_contiguous()) << name;
    EXPECT_TRUE(at::equal(loaded.at(name), tensor.resolve_conj().resolve_neg())) << name;
  }
  // The bytes are the values in row-major order, not the storage order of the input.
  const auto file = SafetensorsFile::from_bytes(bytes);
  const auto expected = base.t().contiguous();
  const at::Tensor view = file.get_tensor("transposed");
  EXPECT_EQ(std::memcmp(view.data_ptr(), expected.data_ptr(), expected.nbytes()), 0);
}

TEST(SafetensorsRoundTrip, TensorsRequiringGradAreSavedAsValues) {
  const auto weight = at::randn({3}).requires_grad_(true);
  const auto loaded = load(save({{"w", weight}}));
  EXPECT_FALSE(loaded.at("w").requires_grad());
  EXPECT_TRUE(at::equal(loaded.at("w"), weight.detach()));
}

TEST(SafetensorsRoundTrip, MetadataSurvivesAndIsEmptyWhenAbsent) {
  const SafetensorsMetadata metadata = {{"format", "pt"},
                                        {"note",
                                         "\xc3\xbcn\xc3\xaf"
                                         "code \xe2\x9c\x93"},
                                        {"empty", ""},
                                        {"quote\"and\\slash", "line\nbreak\ttab\x01"}};
  const auto with = SafetensorsFile::from_bytes(save({{"x", at::ones({1})}}, metadata));
  EXPECT_EQ(with.metadata(), metadata);
  const auto without = SafetensorsFile::from_bytes(save({{"x", at::ones({1})}}));
  EXPECT_TRUE(without.metadata().empty());
  EXPECT_EQ(save({{"x", at::ones({1})}}).find("__metadata__"), std::string::npos);
}

TEST(SafetensorsRoundTrip, NamesWithEscapesAndUnicodeSurvive) {
  TensorMap tensors;
  tensors["layer.0/weight"] = at::ones({2});
  tensors["quote\"back\\slash"] = at::zeros({1});
  tensors["\xe2\x9c\x93 \x01"] = at::full({1}, 3.0);
  expect_same(tensors, load(save(tensors)));
}

// ---- layout ---------------------------------------------------------------------------------

TEST(SafetensorsLayout, GoldenBytesOfASmallFile) {
  // Python's safetensors.torch.save({"weight": torch.tensor([1., -2.]), "step": torch.tensor(7)},
  // metadata={"format": "pt"}) returns exactly these bytes.
  const char kGolden[] =
      "\x98\x00\x00\x00\x00\x00\x00\x00"  // header length: 152
      "{\"__metadata__\":{\"format\":\"pt\"},"
      "\"step\":{\"dtype\":\"I64\",\"shape\":[],\"data_offsets\":[0,8]},"
      "\"weight\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}      "  // padded to 8
      "\x07\x00\x00\x00\x00\x00\x00\x00"                                             // step = 7
      "\x00\x00\x80\x3f\x00\x00\x00\xc0";                                            // weight = [1, -2]
  const std::string golden(kGolden, sizeof(kGolden) - 1);
  TensorMap tensors;
  tensors["weight"] = at::tensor({1.0f, -2.0f});
  tensors["step"] = at::scalar_tensor(7, at::kLong);
  EXPECT_EQ(save(tensors, {{"format", "pt"}}), golden);
  TempDir dir;
  const auto path = (dir.path() / "golden.safetensors").string();
  save_file(tensors, path, {{"format", "pt"}});
  EXPECT_EQ(read_bytes(path), golden);
  expect_same(tensors, load(golden));
}

TEST(SafetensorsLayout, DataIsOrderedByDecreasingElementSizeThenNameAndAligned) {
  TensorMap tensors = every_dtype();
  tensors["a_i8"] = at::ones({3}, at::kChar);
  tensors["z_f64"] = at::ones({1}, at::kDouble);
  const auto file = SafetensorsFile::from_bytes(save(tensors));
  std::vector<std::pair<uint64_t, std::string>> by_offset;
  for (const auto& name : file.keys()) by_offset.emplace_back(file.entry(name).begin, name);
  std::sort(by_offset.begin(), by_offset.end());
  std::vector<std::string> order;
  for (const auto& [offset, name] : by_offset) order.push_back(name);
  // The reference implementation's order: its dtype ranks descending (element size first), then names.
  EXPECT_EQ(order, (std::vector<std::string>{"i64", "f64", "z_f64", "c64", "f32", "i32", "bf16", "f16", "i16", "a_i8",
                                             "i8", "u8", "bool"}));
  const uint64_t data_offset = file.file_size() - file.entry("bool").end;
  EXPECT_EQ(data_offset % 8, 0u);
  for (const auto& name : file.keys()) {
    const auto size = c10::elementSize(safetensors_dtype(file.entry(name).dtype));
    EXPECT_EQ((data_offset + file.entry(name).begin) % size, 0u) << name;
  }
}

TEST(SafetensorsLayout, HeaderIsPaddedWithSpacesToAMultipleOfEight) {
  for (const std::string name : {"a", "ab", "abc", "abcd", "abcde", "abcdef", "abcdefg", "abcdefgh"}) {
    const std::string bytes = save({{name, at::ones({1})}});
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    EXPECT_EQ((8 + n) % 8, 0u) << name;
    const std::string header = bytes.substr(8, n);
    const auto close = header.rfind('}');
    EXPECT_LT(header.size() - close - 1, 8u) << name;
    EXPECT_EQ(header.find_first_not_of(' ', close + 1), std::string::npos) << name;
  }
}

// ---- lazy access and zero copy -------------------------------------------------------------

TEST(SafetensorsFile, KeysAreSortedAndEntriesDescribeTheBytes) {
  TempDir dir;
  const auto path = (dir.path() / "m.safetensors").string();
  save_file({{"b", at::ones({2, 3})}, {"a", at::zeros({4}, at::kLong)}}, path);
  SafetensorsFile file(path);
  EXPECT_EQ(file.keys(), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(file.contains("a"));
  EXPECT_FALSE(file.contains("c"));
  EXPECT_EQ(file.entry("a").dtype, "I64");
  EXPECT_EQ(file.entry("a").shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(file.entry("a").begin, 0u);
  EXPECT_EQ(file.entry("a").end, 32u);
  EXPECT_EQ(file.entry("b").begin, 32u);
  EXPECT_EQ(file.entry("b").end, 56u);
  EXPECT_EQ(file.file_size(), fs::file_size(path));
  EXPECT_EQ(file.path(), path);
  EXPECT_EQ(SafetensorsFile::from_bytes(read_bytes(path)).path(), "<memory>");
}

TEST(SafetensorsFile, UnknownNamesAreValueErrors) {
  const auto file = SafetensorsFile::from_bytes(save({{"a", at::ones({1})}}));
  EXPECT_THROW(file.get_tensor("b"), c10::ValueError);
  EXPECT_THROWS_WITH(file.get_tensor("b"), "[SafetensorsFile::get_tensor] no tensor named 'b' in <memory>");
  EXPECT_THROWS_WITH(file.entry("b"), "[SafetensorsFile::entry] no tensor named 'b' in <memory>");
}

TEST(SafetensorsFile, AlignedTensorsAreViewsOfTheMappedFile) {
  TempDir dir;
  const auto path = (dir.path() / "views.safetensors").string();
  const auto tensors = every_dtype();
  save_file(tensors, path);
  SafetensorsFile file(path);
  for (const auto& [name, tensor] : tensors) {
    const auto view = file.get_tensor(name);
    EXPECT_TRUE(inside_mapping_of(view.data_ptr(), path)) << name;
  }
  // Two reads of one tensor share its bytes; so do the tensors of load_file.
  EXPECT_EQ(file.get_tensor("f32").data_ptr(), file.get_tensor("f32").data_ptr());
  const auto loaded = load_file(path);
  EXPECT_TRUE(inside_mapping_of(loaded.at("f64").data_ptr(), path));
}

TEST(SafetensorsFile, AViewKeepsTheMappingAliveAfterTheFileIsGone) {
  TempDir dir;
  const auto path = (dir.path() / "alive.safetensors").string();
  const auto values = at::arange(1000, at::kFloat);
  save_file({{"v", values}}, path);
  at::Tensor view;
  {
    SafetensorsFile file(path);
    view = file.get_tensor("v").view({10, 100}).slice(0, 2, 5);
  }
  fs::remove(path);  // the unlinked file stays readable through the mapping
  ASSERT_TRUE(inside_mapping_of(view.data_ptr(), path));
  EXPECT_TRUE(at::equal(view, values.view({10, 100}).slice(0, 2, 5)));
  view = at::Tensor();
  EXPECT_FALSE(is_mapped(path)) << "the mapping outlived its last view";
}

TEST(SafetensorsFile, WritingIntoALoadedViewLeavesTheFileUnchanged) {
  TempDir dir;
  const auto path = (dir.path() / "cow.safetensors").string();
  save_file({{"v", at::arange(16, at::kFloat)}}, path);
  const auto bytes = detail::read_file(path);
  auto loaded = load_file(path);
  ASSERT_TRUE(inside_mapping_of(loaded.at("v").data_ptr(), path));
  loaded.at("v").mul_(2);  // as an optimizer updating its loaded state would
  EXPECT_TRUE(at::equal(loaded.at("v"), at::arange(16, at::kFloat) * 2));
  EXPECT_EQ(detail::read_file(path), bytes);
  EXPECT_TRUE(at::equal(load_file(path).at("v"), at::arange(16, at::kFloat)));
}

TEST(SafetensorsFile, CopiesShareTheMapping) {
  TempDir dir;
  const auto path = (dir.path() / "copies.safetensors").string();
  save_file({{"v", at::ones({4})}}, path);
  std::optional<SafetensorsFile> first(std::in_place, path);
  const SafetensorsFile second = *first;
  first.reset();
  EXPECT_TRUE(is_mapped(path));
  EXPECT_TRUE(at::equal(second.get_tensor("v"), at::ones({4})));
}

TEST(SafetensorsFile, MisalignedTensorsAreCopied) {
  // A 54-byte header: the data starts at byte 62, so the F32 tensor is misaligned.
  std::string data(8, '\0');
  const float values[2] = {1.5f, -4.0f};
  std::memcpy(data.data(), values, 8);
  const std::string padded = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  ASSERT_NE((8 + padded.size()) % 4, 0u);
  TempDir dir;
  const auto path = (dir.path() / "misaligned.safetensors").string();
  write_bytes(path, file_of(padded, data));
  SafetensorsFile file(path);
  const auto tensor = file.get_tensor("t");
  EXPECT_FALSE(inside_mapping_of(tensor.data_ptr(), path));
  EXPECT_TRUE(at::equal(tensor, at::tensor({1.5f, -4.0f})));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(tensor.data_ptr()) % alignof(float), 0u);
}

TEST(SafetensorsFile, LoadFileMovesTensorsToTheRequestedDevice) {
  TempDir dir;
  const auto path = (dir.path() / "device.safetensors").string();
  save_file({{"w", at::ones({2, 3}, at::kBFloat16)}}, path);
  // The meta device stands in for an accelerator: every non-CPU device gets copies.
  const auto loaded = load_file(path, c10::Device(c10::kMeta));
  EXPECT_TRUE(loaded.at("w").is_meta());
  EXPECT_EQ(loaded.at("w").sizes(), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(loaded.at("w").scalar_type(), at::kBFloat16);
  EXPECT_FALSE(is_mapped(path)) << "copies must not keep the file mapped";
}

TEST(SafetensorsFile, LoadReturnsTensorsThatOwnTheirBytes) {
  auto bytes = std::make_unique<std::string>(save({{"v", at::arange(6, at::kDouble)}}));
  auto loaded = load(*bytes);
  bytes.reset();
  loaded.at("v").add_(1);  // writable: the bytes belong to the result
  EXPECT_TRUE(at::equal(loaded.at("v"), at::arange(1, 7, at::kDouble)));
}

TEST(SafetensorsFile, BoolBytesOtherThanZeroOrOneAreRejectedOnRead) {
  const auto file =
      SafetensorsFile::from_bytes(file_of(one_tensor("BOOL", "[3]", "[0,3]"), std::string("\x01\x02\x00", 3)));
  EXPECT_THROW(file.get_tensor("t"), c10::ValueError);
  EXPECT_THROWS_WITH(file.get_tensor("t"), "BOOL tensor 't' holds a byte other than 0 and 1");
}

// ---- bulk reads (read_tensors, read_into) -------------------------------------------------

// A file holding a tensor of `floats` values whose data starts `shift` bytes past an 8-byte
// boundary of the file (the header is padded by hand), so that bulk reads meet misaligned sources.
std::string shifted_file(int64_t floats, size_t shift, at::Tensor& values) {
  values = at::randn({floats});
  std::string header = "{\"t\":{\"dtype\":\"F32\",\"shape\":[" + std::to_string(floats) + "],\"data_offsets\":[0," +
                       std::to_string(floats * 4) + "]}}";
  while ((8 + header.size()) % 8 != shift) header += ' ';
  return file_of(header, std::string(static_cast<const char*>(values.data_ptr()), values.nbytes()));
}

TEST(SafetensorsBulkRead, ReadTensorsGivesOwnedCopiesOfEveryDtype) {
  TempDir dir;
  const auto path = (dir.path() / "owned.safetensors").string();
  const auto tensors = every_dtype();
  save_file(tensors, path);
  SafetensorsFile file(path);
  const auto copies = file.read_tensors();
  ASSERT_EQ(copies.size(), tensors.size());
  for (const auto& [name, tensor] : tensors) {
    const auto& copy = copies.at(name);
    EXPECT_EQ(copy.scalar_type(), tensor.scalar_type()) << name;
    EXPECT_TRUE(at::equal(copy, tensor)) << name;
    EXPECT_FALSE(inside_mapping_of(copy.data_ptr(), path)) << name << " is a view of the file";
  }
  copies.at("f32").add_(1);  // the copy is the caller's: the file and its views are untouched
  EXPECT_TRUE(at::equal(file.get_tensor("f32"), tensors.at("f32")));
  const auto some = file.read_tensors({"f64", "i8"});
  EXPECT_EQ(some.size(), 2u);
  EXPECT_TRUE(at::equal(some.at("i8"), tensors.at("i8")));
  EXPECT_THROWS_WITH(file.read_tensors({"f32", "nope"}), "[SafetensorsFile::read_tensors] no tensor named 'nope'");
}

TEST(SafetensorsBulkRead, LargeBatchesFromMisalignedOffsetsAreExact) {
  // 24 MiB in one tensor (split over threads) starting 4 bytes past an 8-byte boundary.
  for (size_t shift : {0u, 4u}) {
    at::Tensor values;
    TempDir dir;
    const auto path = (dir.path() / "large.safetensors").string();
    write_bytes(path, shifted_file(6 << 20, shift, values));
    SafetensorsFile file(path);
    EXPECT_TRUE(at::equal(file.read_tensors().at("t"), values)) << "shift " << shift;
    auto target = at::zeros({6 << 20});
    file.read_into({{"t", target}});
    EXPECT_TRUE(at::equal(target, values)) << "shift " << shift;
  }
  // Many tensors of a few MiB each, saved by the writer, read into existing targets.
  TensorMap tensors, targets;
  for (int i = 0; i < 9; ++i) {
    tensors["w" + std::to_string(i)] = at::randn({(i + 1) * 100000 + 3});
    targets["w" + std::to_string(i)] = at::empty({(i + 1) * 100000 + 3});
  }
  TempDir dir;
  const auto path = (dir.path() / "many.safetensors").string();
  save_file(tensors, path);
  SafetensorsFile(path).read_into(targets);
  for (const auto& [name, tensor] : tensors) EXPECT_TRUE(at::equal(targets.at(name), tensor)) << name;
}

TEST(SafetensorsBulkRead, ReadIntoFillsTheTargetsInPlaceConvertingWhereNeeded) {
  TempDir dir;
  const auto path = (dir.path() / "into.safetensors").string();
  const auto w = at::randn({4, 6});
  const auto b = at::arange(5, at::kFloat);
  const auto flags = at::tensor({1, 0, 1}, at::kByte).to(at::kBool);
  save_file({{"w", w}, {"b", b}, {"flags", flags}, {"n", at::arange(3, at::kLong)}}, path);

  auto same = at::zeros({4, 6});
  const auto* address = same.data_ptr();
  auto wider = at::zeros({5}, at::kDouble);          // converted
  auto strided = at::zeros({6, 4}).t();              // non-contiguous
  auto bools = at::zeros({3}, at::kBool);
  const auto version = same._version();
  SafetensorsFile file(path);
  file.read_into({{"w", same}, {"b", wider}, {"flags", bools}});
  file.read_into({{"w", strided}});
  EXPECT_EQ(same.data_ptr(), address);
  EXPECT_TRUE(at::equal(same, w));
  EXPECT_GT(same._version(), version) << "autograd must see the in-place write";
  EXPECT_TRUE(at::equal(wider, b.to(at::kDouble)));
  EXPECT_TRUE(at::equal(strided, w));
  EXPECT_TRUE(at::equal(bools, flags));
}

TEST(SafetensorsBulkRead, ReadIntoChecksEverythingBeforeWritingAnything) {
  TempDir dir;
  const auto path = (dir.path() / "checks.safetensors").string();
  save_file({{"a", at::ones({3})}, {"b", at::ones({2, 2})}}, path);
  SafetensorsFile file(path);
  auto a = at::zeros({3});
  EXPECT_THROWS_WITH(file.read_into({{"a", a}, {"b", at::zeros({4})}}),
                     "[SafetensorsFile::read_into] size mismatch for 'b': " + path +
                         " has shape [2, 2], the target has shape [4]");
  EXPECT_THROWS_WITH(file.read_into({{"a", a}, {"c", at::zeros({1})}}), "no tensor named 'c'");
  EXPECT_THROWS_WITH(file.read_into({{"a", a}, {"b", at::empty({2, 2}, at::kMeta)}}),
                     "the target of 'b' is on the meta device");
  EXPECT_THROWS_WITH(file.read_into({{"a", a}, {"b", at::Tensor()}}), "the target of 'b' is undefined");
  EXPECT_TRUE(at::equal(a, at::zeros({3}))) << "a target was written before the batch was refused";
  // A BOOL tensor with a byte other than 0 or 1 is refused before anything is written, too.
  const auto bad = SafetensorsFile::from_bytes(file_of(
      "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"t\":{\"dtype\":\"BOOL\",\"shape\":[3],"
      "\"data_offsets\":[4,7]}} ",
      std::string("\x00\x00\x80\x3f\x01\x02\x00", 7)));
  auto one = at::zeros({1});
  auto t = at::zeros({3}, at::kBool);
  EXPECT_THROWS_WITH(bad.read_into({{"a", one}, {"t", t}}), "BOOL tensor 't' holds a byte other than 0 and 1");
  EXPECT_TRUE(at::equal(one, at::zeros({1})));
}

TEST(SafetensorsBulkRead, DurableSavesOfManyMegabytesHoldExactlyTheBytes) {
  // Larger than the write-back step (8 MiB), so the early write-back runs several times.
  TensorMap tensors{{"big", at::randn({5 << 20})}, {"small", at::arange(7, at::kInt)}};
  TempDir dir;
  const auto path = (dir.path() / "durable.safetensors").string();
  save_file(tensors, path, {{"format", "pt"}}, /*fsync=*/true);
  EXPECT_EQ(detail::read_file(path), save(tensors, {{"format", "pt"}}));
}

TEST(SafetensorsBulkRead, StridedTensorsAndThousandsOfSmallOnesAreWrittenInRunsExactly) {
  // Runs of 8 MiB gather pieces (Note [Aligned runs]): the dense copies of transposed tensors
  // must outlive their own write call, a piece may straddle two runs, and one run may hold more
  // pieces than a single writev takes (IOV_MAX, 1024 on Linux).
  TensorMap tensors;
  for (int i = 0; i < 4; ++i) tensors.emplace("strided." + std::to_string(i), at::randn({1024, 769}).t());
  for (int i = 0; i < 3000; ++i) tensors.emplace("small." + std::to_string(i), at::full({i % 5 + 1}, i % 251, at::kByte));
  TempDir dir;
  for (const bool durable : {true, false}) {
    const auto path = (dir.path() / (durable ? "durable.safetensors" : "plain.safetensors")).string();
    save_file(tensors, path, {}, durable);
    EXPECT_TRUE(detail::read_file(path) == save(tensors, {})) << path;  // 13 MB: no diff printed
  }
}

TEST(SequentialWriter, PiecesHeldByTheirOwnersArriveWholeAndInOrder) {
  // Each piece is freed by the caller right after `write`; only its owner keeps it until its run
  // is written. A freed piece would be overwritten by the next one's bytes.
  TempDir dir;
  const auto path = (dir.path() / "pieces").string();
  std::string expected;
  detail::write_file_atomically(path, [&](detail::SequentialWriter& writer) {
    for (int i = 0; i < 40; ++i) {
      const size_t size = (i % 3 == 0) ? (size_t{3} << 20) + 5 : 4093 * static_cast<size_t>(i + 1);
      auto piece = std::make_shared<std::string>(size, static_cast<char>('a' + i % 26));
      expected += *piece;
      writer.write(piece->data(), piece->size(), piece);
    }
  });
  ASSERT_GT(expected.size(), size_t{5} * (8 << 20) / 2);
  EXPECT_TRUE(detail::read_file(path) == expected);
}

// The descriptors of this process that refer to a file in `folder` whose last name is gone.
std::vector<std::string> open_deleted_files_in(const std::filesystem::path& folder) {
  std::vector<std::string> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code error;
    const auto target = std::filesystem::read_symlink(entry.path(), error).string();
    if (!error && target.rfind(folder.string() + "/", 0) == 0 && target.find("(deleted)") != std::string::npos) {
      out.push_back(target);
    }
  }
  return out;
}

// Note [Releasing the replaced file later]: the old file is let go of after the save returns;
// readers see the old content or the new, and nothing of the old file is kept.
TEST(AtomicWrite, LargeFilesWrittenOverEachOtherLeaveOnlyTheNewContentAndNoTraceOfTheOld) {
  TempDir dir;
  const auto path = (dir.path() / "weights").string();
  const size_t size = (size_t{16} << 20) + 3;
  std::optional<std::ifstream> reader_of_first;
  for (int i = 0; i < 4; ++i) {
    const std::string content(size, static_cast<char>('a' + i));
    detail::write_file_atomically(path, [&](detail::SequentialWriter& writer) { writer.write(content.data(), content.size()); });
    EXPECT_TRUE(detail::read_file(path) == content) << "after save " << i;
    if (i == 0) reader_of_first.emplace(path, std::ios::binary);
  }
  // A reader that opened the first file still reads it whole.
  std::string first((std::istreambuf_iterator<char>(*reader_of_first)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(first == std::string(size, 'a'));
  reader_of_first.reset();
  // Only the file itself is in the folder, and once the releases have run no descriptor of a
  // replaced file is left open.
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) names.push_back(entry.path().filename());
  EXPECT_EQ(names, std::vector<std::string>{"weights"});
  std::vector<std::string> left = open_deleted_files_in(dir.path());
  for (int tries = 0; tries < 500 && !left.empty(); ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    left = open_deleted_files_in(dir.path());
  }
  EXPECT_TRUE(left.empty()) << left.size() << " replaced files still open, e.g. " << left.front();
}

// ---- hostile files --------------------------------------------------------------------------

TEST(SafetensorsReader, FilesShorterThanEightBytesAreRejected) {
  EXPECT_REJECTED(std::string(), "the file has 0 bytes, fewer than the 8 of the header length");
  EXPECT_REJECTED(std::string("\x02\x00\x00", 3), "the file has 3 bytes");
}

TEST(SafetensorsReader, HeaderLengthsPastTheLimitAreRejected) {
  EXPECT_REJECTED(le64(100'000'001) + "{}",
                  "the header length 100000001 exceeds the format's limit of 100000000 bytes");
  EXPECT_REJECTED(le64(std::numeric_limits<uint64_t>::max()) + "{}", "exceeds the format's limit");
}

TEST(SafetensorsReader, HeaderLengthsPastTheFileAreRejected) {
  EXPECT_REJECTED(le64(100'000'000) + "{}", "the header length 100000000 runs past the end of the file (10 bytes)");
  EXPECT_REJECTED(le64(3) + "{}", "the header length 3 runs past the end of the file");
}

TEST(SafetensorsReader, HeadersThatAreNotUtf8AreRejected) {
  for (const std::string bad : {"\xff", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x9c", "\x80"}) {
    EXPECT_REJECTED(file_of(R"({"__metadata__":{"k":")" + bad + R"("}})"), "the header is not valid UTF-8");
    EXPECT_REJECTED(file_of("{}" + bad), "the header is not valid UTF-8");
  }
}

TEST(SafetensorsReader, AByteOrderMarkIsRejected) { EXPECT_REJECTED(file_of("\xef\xbb\xbf{}"), "byte order mark"); }

TEST(SafetensorsReader, MalformedJsonIsRejected) {
  // Each is valid under the schema up to its syntax error (the schema is checked as the JSON is read).
  for (const std::string bad :
       {"", "{", "{\"a\":}", "{}}", "{} x", R"({"__metadata__":{"a":"1",}})", "{'a':1}",
        R"({"t":{"dtype":"F32","shape":[01],"data_offsets":[0,4]}})", "{/*c*/}", "{\"\\ud800\":1}", "{\"a\":NaN}",
        "{\"\x01\":1}", "{\"a\"", R"({"__metadata__":{"a":"\q"}})"}) {
    SCOPED_TRACE(bad);
    EXPECT_REJECTED(file_of(bad), "the header is not valid JSON");
  }
}

TEST(SafetensorsReader, HeadersThatAreNotObjectsAreRejected) {
  for (const std::string bad : {"[]", "3", "\"x\"", "null", "true"}) {
    EXPECT_REJECTED(file_of(bad), "the header is not a JSON object");
  }
}

TEST(SafetensorsReader, EntriesBreakingTheSchemaAreRejected) {
  EXPECT_REJECTED(file_of(R"({"t":3})"), "tensor 't' is not an object");
  EXPECT_REJECTED(file_of(R"({"t":[1]})"), "tensor 't' is not an object");
  EXPECT_REJECTED(file_of(R"({"t":{"dtype":"F32","shape":[],"data_offsets":[0,4],"extra":1}})", std::string(4, '\0')),
                  "unknown key 'extra' in tensor 't'");
  EXPECT_REJECTED(file_of(R"({"t":{"dtype":"F32","data_offsets":[0,4]}})", std::string(4, '\0')),
                  "tensor 't' has no \"shape\"");
  EXPECT_REJECTED(file_of(R"({"t":{"shape":[],"data_offsets":[0,4]}})"), "tensor 't' has no \"dtype\"");
  EXPECT_REJECTED(file_of(R"({"t":{"dtype":"F32","shape":[]}})"), "tensor 't' has no \"data_offsets\"");
  EXPECT_REJECTED(file_of(R"({"t":{"dtype":3,"shape":[],"data_offsets":[0,4]}})"),
                  "\"dtype\" of tensor 't' is not a string");
  EXPECT_REJECTED(file_of(one_tensor("F32", "3", "[0,4]")), "\"shape\" of tensor 't' is not an array");
  EXPECT_REJECTED(file_of(one_tensor("F32", "{}", "[0,4]")), "\"shape\" of tensor 't' is not an array");
  EXPECT_REJECTED(file_of(one_tensor("F32", "[]", "\"0,4\"")), "\"data_offsets\" of tensor 't' is not an array");
}

TEST(SafetensorsReader, ShapesOfAnythingButNonNegativeIntegersAreRejected) {
  EXPECT_REJECTED(file_of(one_tensor("F32", "[-1]", "[0,4]")), "\"shape\" of tensor 't' holds a negative number");
  EXPECT_REJECTED(file_of(one_tensor("F32", "[1.5]", "[0,4]")), "holds a fractional or out-of-range number");
  EXPECT_REJECTED(file_of(one_tensor("F32", "[1.0]", "[0,4]")), "holds a fractional or out-of-range number");
  EXPECT_REJECTED(file_of(one_tensor("F32", "[1e0]", "[0,4]")), "holds a fractional or out-of-range number");
  EXPECT_REJECTED(file_of(one_tensor("F32", "[18446744073709551616]", "[0,4]")),
                  "holds a fractional or out-of-range number");
  for (const char* bad : {"[true]", "[\"2\"]", "[[1]]", "[null]", "[{}]"}) {
    EXPECT_REJECTED(file_of(one_tensor("F32", bad, "[0,4]")), "holds a non-integer");
  }
  EXPECT_REJECTED(file_of(one_tensor("F32", "[9223372036854775808]", "[0,0]")),
                  "dimension 9223372036854775808 of tensor 't' is too large");
}

TEST(SafetensorsReader, OffsetsThatAreNotAPairOfNonNegativeIntegersAreRejected) {
  for (const char* bad : {"[0]", "[]", "[0,4,8]", "[-1,3]", "[0,\"4\"]", "[0,4.0]", "[[0],4]", "[0,null]"}) {
    EXPECT_REJECTED(file_of(one_tensor("F32", "[]", bad), std::string(4, '\0')),
                    "\"data_offsets\" of tensor 't' is not a pair [begin, end] of non-negative integers");
  }
  EXPECT_REJECTED(file_of(one_tensor("F32", "[]", "[8,4]"), std::string(8, '\0')),
                  "\"data_offsets\" of tensor 't' end (4) before they begin (8)");
}

TEST(SafetensorsReader, MetadataOtherThanAnObjectOfStringsIsRejected) {
  for (const char* bad : {"\"x\"", "[]", "null", "3"}) {
    EXPECT_REJECTED(file_of(std::string(R"({"__metadata__":)") + bad + "}"),
                    "\"__metadata__\" is not an object of strings");
  }
  EXPECT_REJECTED(file_of(R"({"__metadata__":{"a":1}})"), "\"__metadata__\" value of 'a' is not a string");
  EXPECT_REJECTED(file_of(R"({"__metadata__":{"a":{"b":"c"}}})"), "\"__metadata__\" value of 'a' is not a string");
  EXPECT_REJECTED(file_of(R"({"__metadata__":{"a":null}})"), "\"__metadata__\" value of 'a' is not a string");
}

TEST(SafetensorsReader, UnknownDtypesAreRejectedByName) {
  EXPECT_REJECTED(file_of(one_tensor("F128", "[]", "[0,16]"), std::string(16, '\0')),
                  "tensor 't' has dtype 'F128', which the format does not define");
  EXPECT_REJECTED(file_of(one_tensor("f32", "[]", "[0,4]"), std::string(4, '\0')), "has dtype 'f32'");
}

TEST(SafetensorsReader, FormatDtypesLibTorchCannotRepresentAreRejectedByName) {
  for (const auto& [dtype, size] :
       std::vector<std::pair<std::string, int>>{{"U16", 2}, {"U32", 4}, {"U64", 8}, {"F8_E4M3", 1}, {"F8_E5M2", 1}}) {
    EXPECT_REJECTED(file_of(one_tensor(dtype, "[]", "[0," + std::to_string(size) + "]"),
                            std::string(static_cast<size_t>(size), '\0')),
                    "tensor 't' has dtype " + dtype + ", which LibTorch cannot represent");
  }
}

TEST(SafetensorsReader, SizesThatDisagreeWithShapeAndDtypeAreRejected) {
  EXPECT_REJECTED(file_of(one_tensor("F32", "[2,3]", "[0,20]"), std::string(20, '\0')),
                  "tensor 't' spans 20 bytes, but shape [2, 3] of dtype F32 needs 24");
  EXPECT_REJECTED(file_of(one_tensor("I64", "[]", "[0,4]"), std::string(4, '\0')), "needs 8");
  EXPECT_REJECTED(file_of(one_tensor("F4", "[3]", "[0,2]"), std::string(2, '\0')),
                  "tensor 't' of dtype F4 and shape [3] does not fill a whole number of bytes");
}

TEST(SafetensorsReader, ShapesWhoseProductsOverflowAreRejected) {
  EXPECT_REJECTED(file_of(one_tensor("F32", "[4611686018427387904,4]", "[0,4]")), "its dimensions multiply past 2^63");
  // Empty, but LibTorch's strides for it would overflow.
  EXPECT_REJECTED(file_of(one_tensor("F32", "[0,4611686018427387904,4611686018427387904,2]", "[0,0]")),
                  "its dimensions multiply past 2^63");
  EXPECT_REJECTED(file_of(one_tensor("F64", "[1152921504606846976]", "[0,8]")), "overflows 64 bits");
}

TEST(SafetensorsReader, EmptyTensorsWithHugeDimensionsWithinLimitsAreAccepted) {
  const auto file = SafetensorsFile::from_bytes(file_of(one_tensor("F32", "[0,4611686018427387904]", "[0,0]")));
  const auto tensor = file.get_tensor("t");
  EXPECT_EQ(tensor.numel(), 0);
  EXPECT_EQ(tensor.size(1), int64_t{1} << 62);
}

TEST(SafetensorsReader, DataThatDoesNotStartAtZeroIsRejected) {
  EXPECT_REJECTED(file_of(one_tensor("F32", "[]", "[4,8]"), std::string(8, '\0')),
                  "the data does not start at offset 0: the first tensor, 't', begins at 4");
}

TEST(SafetensorsReader, GapsBetweenTensorsAreRejected) {
  EXPECT_REJECTED(
      file_of(R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
              R"("b":{"dtype":"F32","shape":[],"data_offsets":[8,12]}})",
              std::string(12, '\0')),
      "the data is not contiguous: bytes 4..8 between tensors 'a' and 'b' belong to no tensor");
}

TEST(SafetensorsReader, OverlappingTensorsAreRejected) {
  EXPECT_REJECTED(
      file_of(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
              R"("b":{"dtype":"F32","shape":[],"data_offsets":[4,8]}})",
              std::string(8, '\0')),
      "tensor 'b' (bytes 4..8) overlaps tensor 'a' (which ends at 8)");
  // The same range twice.
  EXPECT_REJECTED(
      file_of(R"({"a":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
              R"("b":{"dtype":"I32","shape":[],"data_offsets":[0,4]}})",
              std::string(4, '\0')),
      "overlaps tensor 'a'");
}

TEST(SafetensorsReader, BytesLeftOverAtTheEndAreRejected) {
  EXPECT_REJECTED(file_of(one_tensor("F32", "[]", "[0,4]"), std::string(7, '\0')),
                  "3 bytes at the end of the file belong to no tensor (the tensors end at byte 4 of 7)");
  EXPECT_REJECTED(file_of("{}", "x"), "1 bytes at the end of the file belong to no tensor");
}

TEST(SafetensorsReader, TruncatedDataIsRejected) {
  EXPECT_REJECTED(
      file_of(one_tensor("F32", "[2]", "[0,8]"), std::string(5, '\0')),
      "tensor 't' ends at byte 8 of the data, but the file holds only 5 bytes of data (the file is truncated)");
  const std::string whole = save({{"a", at::ones({4})}, {"b", at::ones({2}, at::kLong)}});
  EXPECT_REJECTED(whole.substr(0, whole.size() - 1), "the file is truncated");
}

TEST(SafetensorsReader, DuplicateKeysAreRejectedInEveryObject) {
  const std::string t = R"({"dtype":"F32","shape":[],"data_offsets":[0,4]})";
  EXPECT_REJECTED(file_of(R"({"a":)" + t + R"(,"a":)" + t + "}", std::string(4, '\0')),
                  "duplicate key 'a' in the header");
  EXPECT_REJECTED(file_of(R"({"__metadata__":{},"__metadata__":{}})"), "duplicate key '__metadata__' in the header");
  EXPECT_REJECTED(file_of(R"({"__metadata__":{"k":"1","k":"2"}})"), "duplicate key 'k' in \"__metadata__\"");
  EXPECT_REJECTED(
      file_of(R"({"a":{"dtype":"F32","dtype":"F32","shape":[],"data_offsets":[0,4]}})", std::string(4, '\0')),
      "duplicate key 'dtype' in tensor 'a'");
  EXPECT_REJECTED(file_of(R"({"a":{"dtype":"F32","shape":[],"shape":[],"data_offsets":[0,4]}})", std::string(4, '\0')),
                  "duplicate key 'shape' in tensor 'a'");
}

TEST(SafetensorsReader, WhitespaceAroundTheHeaderObjectIsAccepted) {
  for (const std::string pad : {"", " ", "       ", " \n\t\r "}) {
    const auto file =
        SafetensorsFile::from_bytes(file_of(pad + one_tensor("F32", "[]", "[0,4]") + pad, std::string(4, '\0')));
    EXPECT_EQ(file.keys(), std::vector<std::string>{"t"});
  }
}

TEST(SafetensorsReader, EntriesMayComeInAnyOrderAndShareEmptyRanges) {
  const std::string header = R"({"z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                             R"("b":{"data_offsets":[0,4],"shape":[1],"dtype":"I32"},)"
                             R"("a":{"shape":[2,0],"dtype":"F64","data_offsets":[0,0]},"__metadata__":{}})";
  std::string data(4, '\0');
  data[0] = 9;
  const auto file = SafetensorsFile::from_bytes(file_of(header, data));
  EXPECT_EQ(file.keys(), (std::vector<std::string>{"a", "b", "z"}));
  EXPECT_EQ(file.get_tensor("b").item<int32_t>(), 9);
  EXPECT_EQ(file.get_tensor("a").sizes(), (std::vector<int64_t>{2, 0}));
  EXPECT_TRUE(file.metadata().empty());
}

TEST(SafetensorsReader, RejectionsOfFilesNameTheApiAndThePath) {
  TempDir dir;
  const auto path = (dir.path() / "bad.safetensors").string();
  write_bytes(path, file_of(one_tensor("F32", "[]", "[0,4]"), std::string(5, '\0')));
  EXPECT_THROW(SafetensorsFile{path}, c10::ValueError);
  EXPECT_THROWS_WITH(SafetensorsFile{path}, "[SafetensorsFile] " + path + ": 1 bytes at the end");
  EXPECT_THROW(load_file(path), c10::ValueError);
  EXPECT_THROWS_WITH(load_file(path), "[load_file] " + path + ": 1 bytes at the end");
  EXPECT_THROWS_WITH(load(read_bytes(path)), "[load] <memory>: 1 bytes at the end");
  write_bytes(path, "");
  EXPECT_THROWS_WITH(SafetensorsFile{path}, "[SafetensorsFile] " + path + ": the file has 0 bytes");
}

TEST(SafetensorsReader, MissingFilesAndFoldersCannotBeOpened) {
  TempDir dir;
  const auto missing = (dir.path() / "missing.safetensors").string();
  EXPECT_THROWS_WITH(SafetensorsFile{missing},
                     "[SafetensorsFile] cannot open " + missing + ": No such file or directory");
  EXPECT_THROWS_WITH(load_file(dir.str()), "[load_file] " + dir.str() + " is not a regular file");
  const auto fifo = (dir.path() / "fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_THROWS_WITH(SafetensorsFile{fifo}, "[SafetensorsFile] " + fifo + " is not a regular file");
}

TEST(SafetensorsReader, NulBytesInTheHeaderAreRejected) {
  // nlohmann's lexer ends the input at a NUL, which would hide whatever follows it; the reference
  // writer pads with spaces and serde_json, like us, refuses anything but whitespace.
  EXPECT_REJECTED(file_of(std::string("{}\0\0\0\0\0\0", 8)), "the header is not valid JSON: a NUL byte at offset 2");
  EXPECT_REJECTED(file_of(std::string("{}\0{\"t\":3}", 10)), "a NUL byte at offset 2");
  EXPECT_REJECTED(file_of(std::string("{\"a\0\":3}", 8)), "a NUL byte at offset 3");
}

TEST(SafetensorsReader, NamesInMessagesAreEscapedAndShortened) {
  const std::string name = "\x01" + std::string(500, 'n');
  const std::string message = rejection(file_of("{\"\\u0001" + std::string(500, 'n') + "\":3}"));
  EXPECT_THAT(message, HasSubstr("tensor '\\x01nnn"));
  EXPECT_THAT(message, HasSubstr("...' is not an object"));
  EXPECT_LT(message.size(), 300u);
  EXPECT_THAT(message, Not(HasSubstr(name)));
}

// ---- the LibTorch-free parser ---------------------------------------------------------------

TEST(SafetensorsFormat, Utf8ValidationFollowsRfc3629) {
  for (const std::string& good : std::vector<std::string>{"", "plain", "\xc3\xa9", "\xe2\x9c\x93", "\xf0\x9f\x98\x80",
                                                          "\xef\xbf\xbf", "\xf4\x8f\xbf\xbf", std::string(1, '\0')}) {
    EXPECT_TRUE(format::is_valid_utf8(good)) << good;
  }
  for (const std::string bad : {"\x80", "\xbf", "\xc0\x80", "\xc1\xbf", "\xe0\x80\x80", "\xed\xa0\x80", "\xed\xbf\xbf",
                                "\xf0\x80\x80\x80", "\xf4\x90\x80\x80", "\xf5\x80\x80\x80", "\xff", "\xc3", "\xe2\x9c",
                                "\xf0\x9f\x98", "\xc3\x28", "\xe2\x28\xa1"}) {
    EXPECT_FALSE(format::is_valid_utf8(bad)) << bad;
  }
}

TEST(SafetensorsFormat, TheJsonLexerRejectsInvalidUtf8InStringsToo) {
  // A second line of defence behind the explicit check: nlohmann's lexer validates strings.
  for (const std::string bad : {"\"\xff\"", "\"\xc0\xaf\"", "\"\xed\xa0\x80\"", "\"\xe2\x9c\""}) {
    EXPECT_THROW(
        {
          const auto parsed = nlohmann::json::parse(bad);
          (void)parsed;
        },
        nlohmann::json::parse_error)
        << bad;
  }
}

TEST(SafetensorsFormat, PlanRefusesWhatTheFormatCannotHold) {
  auto plan_message = [](std::vector<format::TensorSpec> specs, std::map<std::string, std::string> metadata = {}) {
    try {
      format::plan(specs, metadata);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_THAT(plan_message({{"a", "F32", {2}, 4}}),
              HasSubstr("tensor 'a' has 4 bytes, but shape [2] of dtype F32 needs 8"));
  EXPECT_THAT(plan_message({{"a", "F99", {2}, 8}}), HasSubstr("has dtype 'F99', which the format does not define"));
  EXPECT_THAT(plan_message({{"a", "F32", {-2}, 0}}), HasSubstr("negative dimension"));
  EXPECT_THAT(plan_message({{"a", "F32", {1}, 4}, {"a", "F32", {1}, 4}}), HasSubstr("tensor name 'a' appears twice"));
  EXPECT_EQ(plan_message({{"a", "F4", {2}, 1}}), "accepted");
}

// ---- the writer's refusals ------------------------------------------------------------------

TEST(SafetensorsWriter, DtypesTheFormatCannotStoreAreRefusedNamingTheTensor) {
  EXPECT_THROW(save({{"z", at::zeros({2}, at::kComplexDouble)}}), c10::ValueError);
  EXPECT_THROWS_WITH(save({{"z", at::zeros({2}, at::kComplexDouble)}}),
                     "[save] tensor 'z' has dtype ComplexDouble, which the safetensors format cannot store");
  EXPECT_THROWS_WITH(save({{"h", at::empty({2}, at::kComplexHalf)}}), "tensor 'h' has dtype ComplexHalf");
  const auto quantized = at::quantize_per_tensor(at::rand({4}), 0.1, 0, at::kQInt8);
  EXPECT_THROW(save({{"q", quantized}}), c10::ValueError);
  EXPECT_THROWS_WITH(save({{"q", quantized}}), "[save] tensor 'q' is quantized (dtype QInt8)");
}

TEST(SafetensorsWriter, SparseMetaAndUndefinedTensorsAreRefused) {
  EXPECT_THROWS_WITH(save({{"s", at::eye(3).to_sparse()}}),
                     "[save] tensor 's' has layout Sparse; only dense tensors can be saved");
  EXPECT_THROWS_WITH(save({{"m", at::empty({2}, at::TensorOptions().device(c10::kMeta))}}),
                     "[save] tensor 'm' is on the meta device and has no data");
  EXPECT_THROWS_WITH(save({{"u", at::Tensor()}}), "[save] tensor 'u' is undefined");
}

TEST(SafetensorsWriter, EmptyReservedAndNonUtf8NamesAreRefused) {
  EXPECT_THROW(save({{"", at::ones({1})}}), c10::ValueError);
  EXPECT_THROWS_WITH(save({{"", at::ones({1})}}), "[save] a tensor name is empty");
  EXPECT_THROWS_WITH(save({{"__metadata__", at::ones({1})}}),
                     "tensor name '__metadata__' is reserved for the metadata");
  EXPECT_THROWS_WITH(save({{"__metadata__x", at::ones({1})}}), "is reserved for the metadata");
  EXPECT_THROWS_WITH(save({{"bad\xff", at::ones({1})}}), "tensor name 'bad\\xff' is not valid UTF-8");
  EXPECT_THROWS_WITH(save({{"a", at::ones({1})}}, {{"k\xc0", "v"}}), "metadata key 'k\\xc0' is not valid UTF-8");
  EXPECT_THROWS_WITH(save({{"a", at::ones({1})}}, {{"k", "v\xc0"}}), "metadata value of 'k' is not valid UTF-8");
}

TEST(SafetensorsWriter, ARefusedSaveFileWritesNothing) {
  TempDir dir;
  const auto path = (dir.path() / "refused.safetensors").string();
  EXPECT_THROW(save_file({{"a", at::ones({1})}, {"z", at::zeros({1}, at::kComplexDouble)}}, path), c10::ValueError);
  EXPECT_TRUE(folder_entries(dir.path()).empty());
}

// ---- save_file ------------------------------------------------------------------------------

TEST(SafetensorsSaveFile, AnUnwritableLocationRaisesNamingThePathAndLeavesNothing) {
  TempDir dir;
  write_bytes((dir.path() / "regular").string(), "not a folder");
  const auto path = (dir.path() / "regular" / "model.safetensors").string();
  try {
    save_file({{"a", at::ones({2})}}, path);
    ADD_FAILURE() << "expected a c10::Error";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("[save_file] cannot write " + path + ": Not a directory"));
  }
  EXPECT_EQ(folder_entries(dir.path()), std::vector<std::string>{"regular"});
  EXPECT_EQ(read_bytes((dir.path() / "regular").string()), "not a folder");
}

TEST(SafetensorsSaveFile, AFailedRenameRemovesTheTemporaryFile) {
  TempDir dir;
  const auto path = (dir.path() / "a_folder").string();
  fs::create_directory(path);
  fs::create_directory(path + "/inside");  // a non-empty folder cannot be replaced by a file
  EXPECT_THROWS_WITH(save_file({{"a", at::ones({2})}}, path), "[save_file] cannot write " + path + ": Is a directory");
  EXPECT_EQ(folder_entries(dir.path()), std::vector<std::string>{"a_folder"});
}

TEST(SafetensorsSaveFile, ReplacesAnExistingFileAndLeavesNoTemporaryFiles) {
  TempDir dir;
  const auto path = (dir.path() / "model.safetensors").string();
  save_file({{"old", at::ones({100})}}, path);
  save_file({{"new", at::zeros({2}, at::kLong)}}, path, {}, /*fsync=*/false);
  EXPECT_EQ(SafetensorsFile(path).keys(), std::vector<std::string>{"new"});
  EXPECT_EQ(folder_entries(dir.path()), std::vector<std::string>{"model.safetensors"});
}

TEST(SafetensorsSaveFile, ARelativePathLandsInTheWorkingFolder) {
  TempDir dir;
  const auto previous = fs::current_path();
  fs::current_path(dir.path());
  save_file({{"a", at::ones({3})}}, "relative.safetensors");
  fs::current_path(previous);
  EXPECT_EQ(folder_entries(dir.path()), std::vector<std::string>{"relative.safetensors"});
  EXPECT_TRUE(at::equal(load_file((dir.path() / "relative.safetensors").string()).at("a"), at::ones({3})));
}

TEST(SafetensorsSaveFile, NewFilesGetTheUsualPermissions) {
  TempDir dir;
  const auto path = (dir.path() / "perm.safetensors").string();
  const mode_t previous = ::umask(022);
  save_file({{"a", at::ones({1})}}, path);
  ::umask(previous);
  EXPECT_EQ(fs::status(path).permissions(),
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read | fs::perms::others_read);
}

// ---- cross-check with an independent Python reader and writer ------------------------------

const char* const kPython = "/usr/bin/python3";

std::string checker() { return built("tests/python/safetensors_check.py"); }

TEST(SafetensorsPython, AnIndependentReaderFindsTheValuesWeWrote) {
  ASSERT_TRUE(fs::exists(kPython)) << kPython << " is missing; scripts/setup.sh installs python3";
  TensorMap tensors;
  tensors["bool"] = at::tensor({1, 0, 0, 1}).to(at::kBool);
  tensors["u8"] = at::tensor({0, 7, 255}, at::kByte);
  tensors["i8"] = at::tensor({-128, -1, 127}, at::kChar);
  tensors["i16"] = at::tensor({-32768, 12345}, at::kShort);
  tensors["i32"] =
      at::tensor({std::numeric_limits<int32_t>::min(), 1, 2, std::numeric_limits<int32_t>::max()}, at::kInt)
          .view({2, 2});
  tensors["i64"] = at::tensor({int64_t{-1}, int64_t{0}, (int64_t{1} << 40) + 3}, at::kLong);
  tensors["f16"] = at::tensor({1.0, -2.5, 65504.0}).to(at::kHalf);
  tensors["bf16"] = at::tensor({1.0, -3.0}).to(at::kBFloat16);
  tensors["f32"] = (at::arange(6, at::kFloat) * 0.5).view({2, 3});
  tensors["f64"] = at::scalar_tensor(M_PI, at::kDouble);
  tensors["c64"] = at::tensor(std::vector<c10::complex<float>>{{1.0f, 2.0f}, {-3.5f, 0.25f}});
  tensors["empty"] = at::empty({0, 3});
  TempDir dir;
  const auto path = (dir.path() / "from_cpp.safetensors").string();
  save_file(tensors, path, {{"format", "pt"}, {"source", "accelerate-cpp \xe2\x9c\x93"}});
  auto python = run({kPython, checker(), "read", path});
  EXPECT_EQ(python->exit_code(), 0) << python->err;
  EXPECT_EQ(python->out, "ok\n") << python->err;

  // The reader can fail: a value it does not expect makes it exit non-zero naming the tensor.
  tensors["i8"] = at::tensor({-128, -1, 126}, at::kChar);
  save_file(tensors, path, {{"format", "pt"}, {"source", "accelerate-cpp \xe2\x9c\x93"}});
  python = run({kPython, checker(), "read", path});
  EXPECT_EQ(python->exit_code(), 1);
  EXPECT_THAT(python->err, HasSubstr("i8 holds [-128, -1, 126]"));
}

TEST(SafetensorsPython, WeReadTheValuesAnIndependentWriterWrote) {
  ASSERT_TRUE(fs::exists(kPython)) << kPython << " is missing; scripts/setup.sh installs python3";
  TempDir dir;
  const auto path = (dir.path() / "from_python.safetensors").string();
  const auto python = run({kPython, checker(), "write", path});
  ASSERT_EQ(python->exit_code(), 0) << python->err;

  SafetensorsFile file(path);
  EXPECT_EQ(file.metadata(), (SafetensorsMetadata{{"writer", "python"},
                                                  {"note",
                                                   "\xc3\xbcn\xc3\xaf"
                                                   "code"}}));
  EXPECT_EQ(file.keys(), (std::vector<std::string>{"a_u8", "bf", "c", "d", "e", "flag", "h", "m_i64", "z_f32"}));
  EXPECT_TRUE(at::equal(file.get_tensor("a_u8"), at::tensor({1, 2, 3, 4}, at::kByte).view({2, 2})));
  EXPECT_TRUE(at::equal(file.get_tensor("z_f32"), at::tensor({1.5f, -2.0f, 3.25f})));
  EXPECT_TRUE(at::equal(file.get_tensor("m_i64"), at::tensor({int64_t{-5}, int64_t{1} << 62})));
  EXPECT_TRUE(at::equal(file.get_tensor("flag"), at::tensor({1, 0}).to(at::kBool)));
  EXPECT_TRUE(at::equal(file.get_tensor("h"), at::tensor({0.5}).to(at::kHalf)));
  EXPECT_TRUE(at::equal(file.get_tensor("bf"), at::tensor({1.0, -2.0}).to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(file.get_tensor("c"), at::tensor(std::vector<c10::complex<float>>{{0.5f, -1.0f}})));
  EXPECT_EQ(file.get_tensor("d").dim(), 0);
  EXPECT_EQ(file.get_tensor("d").item<double>(), std::ldexp(1.0, -30));
  EXPECT_EQ(file.get_tensor("e").sizes(), (std::vector<int64_t>{0}));
  // The writer left the data 2 bytes past a multiple of 4: the 4- and 8-byte tensors are copies,
  // the 1- and 2-byte ones views.
  for (const char* name : {"z_f32", "m_i64", "c", "d"})
    EXPECT_FALSE(inside_mapping_of(file.get_tensor(name).data_ptr(), path)) << name;
  for (const char* name : {"a_u8", "flag", "h", "bf"})
    EXPECT_TRUE(inside_mapping_of(file.get_tensor(name).data_ptr(), path)) << name;
}

}  // namespace
}  // namespace accelerate::testing
