// The central directory of a zip archive (PKWARE's APPNOTE, zip64 included), read without
// LibTorch and without inflating anything: what a caller needs to check an archive's records
// before another reader opens it (torch.save's archives hold stored records only). Rejections are
// std::invalid_argument naming the broken rule. Writing, and reading the records' bytes, are left
// to LibTorch's archive reader.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace accelerate::detail::zip {

/// One record as the archive's central directory lists it.
struct Record {
  std::string name;
  uint16_t method = 0;          ///< 0: stored; 8: deflated; others
  uint64_t compressed_size = 0;  ///< bytes in the archive
  uint64_t size = 0;             ///< bytes once extracted
  uint64_t header_offset = 0;    ///< where its local header starts
};

/// The records of the zip archive at `path`. Refuses a file without an end of central directory,
/// a directory that reaches past the end of the file or lists more records than it can hold, and
/// a record whose local header lies past the end of the file.
std::vector<Record> read_directory(const std::string& path);
/// The records of the zip archive that lies `size` bytes from `offset` within the file at `path`
/// (as torch.distributed.checkpoint's files hold torch.save archives), with offsets relative to
/// the archive's start.
std::vector<Record> read_directory(const std::string& path, uint64_t offset, uint64_t size);

}  // namespace accelerate::detail::zip
