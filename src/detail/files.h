// Durable file operations: whole-file reads, writes that are flushed to the disk and renamed
// into place, and flushing a folder's entries. Errors raise std::runtime_error naming the path
// and the system's reason.
#pragma once

#include <string>

namespace accelerate::detail {

/// The whole content of `path`.
std::string read_file(const std::string& path);
/// Writes `bytes` to `path` and, with `durable`, flushes them to the disk (fsync).
void write_file(const std::string& path, const std::string& bytes, bool durable = true);
/// Writes `bytes` to a temporary file next to `path`, flushes it, renames it to `path` and flushes
/// the folder, so that `path` holds either its old content or all of the new one. Nothing is left
/// behind on failure.
void write_file_atomically(const std::string& path, const std::string& bytes);
/// Flushes the entries of the folder `path` (new, renamed or removed files) to the disk.
void fsync_directory(const std::string& path);
/// Flushes the data of the existing file `path` to the disk.
void fsync_file(const std::string& path);

}  // namespace accelerate::detail
