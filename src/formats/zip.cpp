// The central directory of a zip archive (see zip.h).
#include "formats/zip.h"

#include <algorithm>
#include <fstream>
#include <stdexcept>
#include <string_view>

namespace accelerate::detail::zip {

namespace {

constexpr uint32_t kEndOfDirectory = 0x06054b50;
constexpr uint32_t kZip64Locator = 0x07064b50;
constexpr uint32_t kZip64EndOfDirectory = 0x06064b50;
constexpr uint32_t kDirectoryEntry = 0x02014b50;
constexpr size_t kEndSize = 22;        // the end of central directory without its comment
constexpr size_t kLocatorSize = 20;    // zip64's locator of its end of central directory
constexpr size_t kZip64EndSize = 56;   // zip64's end of central directory without extensions
constexpr size_t kEntrySize = 46;      // a directory entry without its name, extra field and comment
constexpr size_t kLocalHeaderSize = 30;

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("zip: " + what); }

uint64_t le(std::string_view bytes, size_t at, int width) {
  uint64_t v = 0;
  for (int i = width - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(bytes[at + i]);
  return v;
}

std::string read_at(std::ifstream& in, uint64_t offset, uint64_t size) {
  std::string out(size, '\0');
  in.clear();
  in.seekg(static_cast<std::streamoff>(offset));
  in.read(out.data(), static_cast<std::streamsize>(size));
  if (static_cast<uint64_t>(in.gcount()) != size) fail("the file could not be read at byte " + std::to_string(offset));
  return out;
}

}  // namespace

std::vector<Record> read_directory(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) fail("cannot open the file");
  return read_directory(path, 0, static_cast<uint64_t>(in.tellg()));
}

std::vector<Record> read_directory(const std::string& path, uint64_t offset, uint64_t size) {
  std::ifstream file(path, std::ios::binary);
  if (!file) fail("cannot open the file");
  // Offsets within the archive, which starts `offset` bytes into the file.
  const auto read_at = [&](uint64_t at, uint64_t n) { return zip::read_at(file, offset + at, n); };
  const uint64_t file_size = size;
  if (file_size < kEndSize) fail("the file is shorter than an end of central directory");
  // The end of central directory: the last signature within its comment's reach of the end.
  const uint64_t tail_size = std::min<uint64_t>(file_size, kEndSize + 0xffff);
  const auto tail = read_at(file_size - tail_size, tail_size);
  size_t end = std::string_view::npos;
  for (size_t i = tail_size - kEndSize + 1; i-- > 0;) {
    if (le(tail, i, 4) == kEndOfDirectory) {
      end = i;
      break;
    }
  }
  if (end == std::string_view::npos) fail("no end of central directory (not a zip archive, or a truncated one)");
  const uint64_t end_at = file_size - tail_size + end;
  uint64_t entries = le(tail, end + 10, 2);
  uint64_t directory_size = le(tail, end + 12, 4);
  uint64_t directory_at = le(tail, end + 16, 4);
  if (le(tail, end + 4, 2) != 0 || le(tail, end + 6, 2) != 0) fail("an archive of several disks");
  if (entries == 0xffff || directory_size == 0xffffffff || directory_at == 0xffffffff) {
    if (end_at < kLocatorSize) fail("zip64 fields without zip64's locator");
    const auto locator = read_at(end_at - kLocatorSize, kLocatorSize);
    if (le(locator, 0, 4) != kZip64Locator) fail("zip64 fields without zip64's locator");
    const uint64_t zip64_at = le(locator, 8, 8);
    if (zip64_at > file_size || file_size - zip64_at < kZip64EndSize) fail("zip64's end of directory lies past the file");
    const auto zip64 = read_at(zip64_at, kZip64EndSize);
    if (le(zip64, 0, 4) != kZip64EndOfDirectory) fail("zip64's locator points at no end of directory");
    entries = le(zip64, 32, 8);
    directory_size = le(zip64, 40, 8);
    directory_at = le(zip64, 48, 8);
  }
  if (directory_at > file_size || directory_size > file_size - directory_at) {
    fail("the central directory (" + std::to_string(directory_size) + " bytes at " + std::to_string(directory_at) +
         ") reaches past the end of the file (" + std::to_string(file_size) + " bytes)");
  }
  if (entries > directory_size / kEntrySize) {
    fail("the central directory lists " + std::to_string(entries) + " records in " + std::to_string(directory_size) +
         " bytes");
  }
  const auto directory = read_at(directory_at, directory_size);
  std::vector<Record> out;
  out.reserve(entries);
  size_t at = 0;
  for (uint64_t i = 0; i < entries; ++i) {
    if (directory.size() - at < kEntrySize || le(directory, at, 4) != kDirectoryEntry) {
      fail("central directory entry " + std::to_string(i) + " is malformed");
    }
    Record r;
    r.method = static_cast<uint16_t>(le(directory, at + 10, 2));
    r.compressed_size = le(directory, at + 20, 4);
    r.size = le(directory, at + 24, 4);
    const size_t name_size = le(directory, at + 28, 2);
    const size_t extra_size = le(directory, at + 30, 2);
    const size_t comment_size = le(directory, at + 32, 2);
    r.header_offset = le(directory, at + 42, 4);
    if (directory.size() - at - kEntrySize < name_size + extra_size + comment_size) {
      fail("central directory entry " + std::to_string(i) + " runs past the directory");
    }
    r.name = directory.substr(at + kEntrySize, name_size);
    // Zip64's extra field holds, in this order, the fields whose 32-bit value is all ones.
    const std::string_view extra(directory.data() + at + kEntrySize + name_size, extra_size);
    for (size_t e = 0; e + 4 <= extra.size();) {
      const auto id = le(extra, e, 2);
      const size_t size = le(extra, e + 2, 2);
      if (extra.size() - e - 4 < size) fail("an extra field of record " + r.name + " runs past its entry");
      if (id == 0x0001) {
        size_t f = e + 4;
        const auto field = [&](uint64_t& value) {
          if (value != 0xffffffff) return;
          if (f + 8 > e + 4 + size) fail("zip64's extra field of record " + r.name + " is too short");
          value = le(extra, f, 8);
          f += 8;
        };
        field(r.size);
        field(r.compressed_size);
        field(r.header_offset);
      }
      e += 4 + size;
    }
    if (r.header_offset > file_size || file_size - r.header_offset < kLocalHeaderSize) {
      fail("record " + r.name + " starts past the end of the file");
    }
    out.push_back(std::move(r));
    at += kEntrySize + name_size + extra_size + comment_size;
  }
  return out;
}

}  // namespace accelerate::detail::zip
