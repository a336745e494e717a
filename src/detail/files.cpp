// Durable file operations (files.h): whole-file reads, flushed writes renamed into place, folder flushes.
#include "detail/files.h"

#include "detail/check.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <utility>

namespace accelerate::detail {

namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path, int error) {
  raise_error("cannot " + what + " " + path + ": " + std::strerror(error));
}

// Closes a descriptor when it goes out of scope.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

void write_all(int fd, const char* data, size_t size, const std::string& path) {
  constexpr size_t kChunk = size_t{1} << 30;  // Linux writes at most ~2 GB per call
  while (size > 0) {
    const ssize_t n = ::write(fd, data, std::min(size, kChunk));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write", path, errno);
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
}

std::string read_file(const std::string& path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) fail("open", path, errno);
  std::string out;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(f.fd, buffer, sizeof(buffer));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("read", path, errno);
    }
    if (n == 0) break;
    out.append(buffer, static_cast<size_t>(n));
  }
  return out;
}

void write_file(const std::string& path, const std::string& bytes, bool durable) {
  Fd f{::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644)};
  if (f.fd < 0) fail("create", path, errno);
  write_all(f.fd, bytes.data(), bytes.size(), path);
  if (durable && ::fsync(f.fd) != 0) fail("flush", path, errno);
  const int fd = f.fd;
  f.fd = -1;
  if (::close(fd) != 0) fail("close", path, errno);
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  write_file_atomically(path, [&](SequentialWriter& writer) { writer.write(bytes.data(), bytes.size()); });
}

// Note [Early write-back]
// A durable save used to copy every byte into the page cache and only then, in fsync, have the
// disk write them all: the disk sat idle during the copy. Starting the write-back of each 8 MiB
// as soon as it is in the page cache (sync_file_range with SYNC_FILE_RANGE_WRITE, which does not
// wait) overlaps the two; on this project's machines a 200 MB save went from ~1.6 GB/s (what
// `dd conv=fsync` reaches) to ~2.2 GB/s. The call is only advice: fsync still decides
// durability and reports errors, so a file system that refuses it loses nothing.
//
// Note [Aligned runs]
// How fast a file can be read back from the page cache depends on how it was written. Linux
// (ext4, XFS and tmpfs since 6.x) caches a file in folios as large as each write call allows, up
// to 2 MiB when a write covers a whole aligned 2 MiB of the file; such a folio is mapped by a
// single page-table entry, so mapping it (Note [Bulk reads]) is nearly free and reading it takes
// no TLB misses. Written one tensor at a time, at offsets that the header shifts off any
// alignment, a checkpoint was cached in small folios and loaded at ~14 GB/s; written in gathered
// runs (writev) that start and end on multiples of 8 MiB of the file, the same file loads at
// ~20 GB/s on this project's machines. Gathering copies nothing: it holds the pieces until their
// run is complete.
namespace {
// The length of a run (Note [Aligned runs]), which is also how far early write-back trails.
constexpr uint64_t kRun = uint64_t{8} << 20;
}  // namespace

void SequentialWriter::write(const char* data, size_t size, std::shared_ptr<const void> owner) {
  bool held = false;
  while (size > 0) {
    const uint64_t end = written_ + pending_bytes_;
    const size_t take = static_cast<size_t>(std::min<uint64_t>(size, kRun - end % kRun));
    pending_.emplace_back(data, take);
    pending_bytes_ += take;
    data += take;
    size -= take;
    if ((end + take) % kRun == 0) {
      write_pending();
    } else if (owner && !held) {
      owners_.push_back(owner);
      held = true;
    }
  }
}

void SequentialWriter::finish() { write_pending(); }

void SequentialWriter::write_pending() {
  std::vector<iovec> pieces;
  pieces.reserve(pending_.size());
  for (const auto& [data, size] : pending_) pieces.push_back({const_cast<char*>(data), size});
  size_t first = 0;
  while (first < pieces.size()) {
    const int count = static_cast<int>(std::min<size_t>(pieces.size() - first, IOV_MAX));
    const ssize_t n = ::writev(fd_, pieces.data() + first, count);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write", path_, errno);
    }
    written_ += static_cast<uint64_t>(n);
    // Skips what was written, whole pieces and then part of one.
    size_t left = static_cast<size_t>(n);
    while (first < pieces.size() && left >= pieces[first].iov_len) left -= pieces[first++].iov_len;
    if (left > 0) {
      pieces[first].iov_base = static_cast<char*>(pieces[first].iov_base) + left;
      pieces[first].iov_len -= left;
    }
  }
  pending_.clear();
  pending_bytes_ = 0;
  owners_.clear();
  if (durable_ && written_ - submitted_ >= kRun) {
    (void)::sync_file_range(fd_, static_cast<off_t>(submitted_), static_cast<off_t>(written_ - submitted_),
                            SYNC_FILE_RANGE_WRITE);
    submitted_ = written_;
  }
}

// Note [Releasing the replaced file later]
// Renaming a new file over an old one takes away the old one's last name, and the kernel then
// frees its blocks and drops its cached pages inside the rename: ~50 ms for a 200 MB file on this
// project's machines, a third of the time of a durable save of that size. A descriptor of the old
// file, opened before the rename, keeps it alive past it; closing that descriptor on a thread of
// its own moves the work there, and the save returns as soon as the new file is in place. Should
// the process end first, the kernel closes it: nothing is left behind. Small files (below one run
// of the writer) are released in place, where a thread would cost more than it saves.
namespace {

// A descriptor of the regular file at `path` when it is large enough to be worth releasing on a
// thread of its own; -1 otherwise (no file, a small one, a link, anything else).
int hold_replaced(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) < kRun) return -1;
  return ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
}

void release_later(int fd) {
  if (fd < 0) return;
  try {
    std::thread([fd] { ::close(fd); }).detach();
  } catch (const std::system_error&) {
    ::close(fd);  // no thread to be had: released here
  }
}

}  // namespace

// Note [Atomic write]: the content goes to a new file beside `path` that is renamed over it once
// complete, so a reader sees the old file or the new one, and a failure leaves no partial file.
void write_file_atomically(const std::string& path, const std::function<void(SequentialWriter&)>& write_content,
                           bool durable) {
  const std::filesystem::path target(path);
  const auto folder = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  std::string temporary = (folder / ("." + target.filename().string() + ".tmp-XXXXXX")).string();
  Fd f{::mkstemp(temporary.data())};
  if (f.fd < 0) fail("write", path, errno);
  try {
    SequentialWriter writer(f.fd, path, durable);
    write_content(writer);
    writer.finish();
    if (::fchmod(f.fd, 0644) != 0) fail("write", path, errno);
    if (durable && ::fsync(f.fd) != 0) fail("flush", path, errno);
    const int fd = f.fd;
    f.fd = -1;
    if (::close(fd) != 0) fail("write", path, errno);
    Fd replaced{hold_replaced(path)};  // Note [Releasing the replaced file later]
    if (::rename(temporary.c_str(), path.c_str()) != 0) fail("write", path, errno);
    release_later(std::exchange(replaced.fd, -1));
  } catch (...) {
    ::unlink(temporary.c_str());
    throw;
  }
  // The file is in place by now: a failure to make the rename durable is reported but leaves it.
  if (durable) fsync_directory(folder.string());
}

void fsync_directory(const std::string& path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)};
  if (f.fd < 0) fail("open the folder", path, errno);
  if (::fsync(f.fd) != 0 && errno != EINVAL) fail("flush the folder", path, errno);
}

void fsync_file(const std::string& path) {
  Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (f.fd < 0) fail("open", path, errno);
  if (::fsync(f.fd) != 0) fail("flush", path, errno);
}

// Note [Removing a tree]
// PyTorch's pip wheels (seen with 2.11, CUDA 13) export from libtorch.so their own copy of
// std::filesystem::remove_all, and the dynamic linker binds this library's calls to it; that copy
// jumps to a null address. Every folder this project removes (checkpoint staging and rotation,
// scratch folders, merged inputs, the tests' temporary folders) therefore goes through
// remove_tree: unlinkat on each entry, depth first, through descriptors, so that a symbolic link
// is removed and never followed.

namespace {

// Removes `name` in the folder `parent` (a descriptor, or AT_FDCWD) with everything under it;
// 0 or the system's error number.
int remove_entry(int parent, const char* name) {
  if (::unlinkat(parent, name, 0) == 0 || errno == ENOENT) return 0;
  if (errno != EISDIR && errno != EPERM) return errno;  // Linux answers EISDIR for a folder
  const int fd = ::openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT ? 0 : errno;
  DIR* dir = ::fdopendir(fd);
  if (dir == nullptr) {
    const int error = errno;
    ::close(fd);
    return error;
  }
  int error = 0;
  while (error == 0) {
    errno = 0;
    const dirent* entry = ::readdir(dir);
    if (entry == nullptr) {
      error = errno;
      break;
    }
    if (std::strcmp(entry->d_name, ".") == 0 || std::strcmp(entry->d_name, "..") == 0) continue;
    error = remove_entry(::dirfd(dir), entry->d_name);
  }
  ::closedir(dir);
  if (error != 0) return error;
  if (::unlinkat(parent, name, AT_REMOVEDIR) != 0 && errno != ENOENT) return errno;
  return 0;
}

}  // namespace

int try_remove_tree(const std::filesystem::path& path) noexcept {
  if (path.empty()) return ENOENT;
  return remove_entry(AT_FDCWD, path.c_str());
}

void remove_tree(const std::filesystem::path& path) {
  if (const int error = try_remove_tree(path)) fail("remove", path.string(), error);
}

}  // namespace accelerate::detail
