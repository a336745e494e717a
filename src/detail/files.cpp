#include "detail/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace accelerate::detail {

namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path, int error) {
  throw std::runtime_error("cannot " + what + " " + path + ": " + std::strerror(error));
}

// Closes a descriptor when it goes out of scope.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void write_all(int fd, const std::string& bytes, const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("write", path, errno);
    }
    done += static_cast<size_t>(n);
  }
}

}  // namespace

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
  write_all(f.fd, bytes, path);
  if (durable && ::fsync(f.fd) != 0) fail("flush", path, errno);
  const int fd = f.fd;
  f.fd = -1;
  if (::close(fd) != 0) fail("close", path, errno);
}

void write_file_atomically(const std::string& path, const std::string& bytes) {
  const std::filesystem::path target(path);
  const auto folder = target.has_parent_path() ? target.parent_path() : std::filesystem::path(".");
  std::string temporary = (folder / ("." + target.filename().string() + ".tmp-XXXXXX")).string();
  Fd f{::mkstemp(temporary.data())};
  if (f.fd < 0) fail("create a temporary file for", path, errno);
  try {
    write_all(f.fd, bytes, path);
    if (::fchmod(f.fd, 0644) != 0 || ::fsync(f.fd) != 0) fail("flush", path, errno);
    const int fd = f.fd;
    f.fd = -1;
    if (::close(fd) != 0) fail("close", path, errno);
    if (::rename(temporary.c_str(), path.c_str()) != 0) fail("rename a temporary file to", path, errno);
  } catch (...) {
    ::unlink(temporary.c_str());
    throw;
  }
  fsync_directory(folder.string());
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

}  // namespace accelerate::detail
