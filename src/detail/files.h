// Durable file operations: whole-file reads, writes that are flushed to the disk and renamed
// into place, and flushing a folder's entries. Errors raise std::runtime_error naming the path
// and the system's reason.
#pragma once

#include <cstddef>
#include <functional>
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
/// The same with the content written by `write_content(fd)` onto the temporary file, for content
/// too large to assemble in memory first; without `durable` nothing is flushed (the rename still
/// makes the new content appear whole).
void write_file_atomically(const std::string& path, const std::function<void(int fd)>& write_content,
                           bool durable = true);
/// Writes all `size` bytes at `data` to the descriptor `fd`, retrying short writes; an error names
/// `path`.
void write_all(int fd, const char* data, size_t size, const std::string& path);
/// Flushes the entries of the folder `path` (new, renamed or removed files) to the disk.
void fsync_directory(const std::string& path);
/// Flushes the data of the existing file `path` to the disk.
void fsync_file(const std::string& path);

}  // namespace accelerate::detail
