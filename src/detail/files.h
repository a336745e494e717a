// Durable file operations: whole-file reads, writes that are flushed to the disk and renamed
// into place, and flushing a folder's entries. Errors name the path and the system's reason; they
// are c10::Errors in the library and std::runtime_errors in the torch-free launcher (detail/check.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accelerate::detail {

/// The whole content of `path`.
std::string read_file(const std::string& path);
/// Writes `bytes` to `path` and, with `durable`, flushes them to the disk (fsync).
void write_file(const std::string& path, const std::string& bytes, bool durable = true);
/// Writes `bytes` to a temporary file next to `path`, flushes it, renames it to `path` and flushes
/// the folder, so that `path` holds either its old content or all of the new one. Nothing is left
/// behind on failure.
void write_file_atomically(const std::string& path, const std::string& bytes);
/// Writes bytes to a file in order. Pieces are gathered and written in runs that end on multiples
/// of 8 MiB of the file (Note [Aligned runs]); when `durable`, the kernel is asked to start
/// writing each run to the disk as soon as it is written (see Note [Early write-back]); only fsync
/// makes them durable.
class SequentialWriter {
 public:
  /// `path` names the file in errors; it must outlive the writer.
  SequentialWriter(int fd, const std::string& path, bool durable) : fd_(fd), path_(path), durable_(durable) {}
  /// Appends the `size` bytes at `data`. They may be written only by a later call or by
  /// `finish`: they must stay valid until then, which `owner` (when given) guarantees by being
  /// held until they are written. An error names the path.
  void write(const char* data, size_t size, std::shared_ptr<const void> owner = nullptr);
  /// Writes whatever is still pending.
  void finish();

 private:
  void write_pending();

  int fd_;
  const std::string& path_;
  bool durable_;
  uint64_t written_ = 0;    // bytes written so far
  uint64_t submitted_ = 0;  // bytes whose write-back has been started
  std::vector<std::pair<const char*, size_t>> pending_;  // appended, not yet written
  uint64_t pending_bytes_ = 0;
  std::vector<std::shared_ptr<const void>> owners_;  // of pending pieces
};

/// The same with the content written by `write_content(writer)` onto the temporary file, for
/// content too large to assemble in memory first; without `durable` nothing is flushed (the
/// rename still makes the new content appear whole).
void write_file_atomically(const std::string& path, const std::function<void(SequentialWriter&)>& write_content,
                           bool durable = true);
/// Writes all `size` bytes at `data` to the descriptor `fd`, retrying short writes; an error names
/// `path`.
void write_all(int fd, const char* data, size_t size, const std::string& path);
/// Flushes the entries of the folder `path` (new, renamed or removed files) to the disk.
void fsync_directory(const std::string& path);
/// Flushes the data of the existing file `path` to the disk.
void fsync_file(const std::string& path);

/// Removes `path` and everything under it, as std::filesystem::remove_all does: symbolic links
/// are removed, never followed, and a missing path is no error. Raises naming the path that could
/// not be removed. See Note [Removing a tree] for why this is not std::filesystem::remove_all.
void remove_tree(const std::filesystem::path& path);
/// The same without raising: 0 when `path` is gone, else the system's error number.
int try_remove_tree(const std::filesystem::path& path) noexcept;

}  // namespace accelerate::detail
