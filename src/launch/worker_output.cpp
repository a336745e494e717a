// The launcher's console, and its workers' output and logs; see worker_output.h.
#include "launch/worker_output.h"

#include "detail/check.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <fstream>
#include <poll.h>
#include <sstream>

namespace accelerate::detail::launch {
namespace {

namespace fs = std::filesystem;

// Enough for ssh's line above Open MPI's banner (Note [A machine that ssh cannot reach]).
constexpr size_t kTailLines = 60;

}  // namespace

void write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        struct pollfd p {fd, POLLOUT, 0};
        ::poll(&p, 1, 100);
        continue;
      }
      return;  // console gone (EPIPE): keep supervising regardless
    }
    done += static_cast<size_t>(n);
  }
}

void say(const std::string& line) { write_all(STDERR_FILENO, "accelerate launch: " + line + "\n"); }

int open_log(const fs::path& path) {
  fs::create_directories(path.parent_path());
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ACCELERATE_CHECK(fd >= 0, "[launch] cannot write the log file ", path.string(), ": ", std::strerror(errno));
  return fd;
}

void Stream::emit(const std::string& line) {
  if (to_console) write_all(console_fd, prefix + line + "\n");
  if (log_fd >= 0) write_all(log_fd, line + "\n");
  if (keep_tail && !line.empty()) {
    tail.push_back(line);
    if (tail.size() > kTailLines) tail.pop_front();
  }
}

bool Stream::pump() {
  char buf[65536];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n > 0) {
      partial.append(buf, static_cast<size_t>(n));
      size_t start = 0;
      for (size_t nl; (nl = partial.find('\n', start)) != std::string::npos; start = nl + 1) {
        emit(partial.substr(start, nl - start));
      }
      partial.erase(0, start);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    flush();
    return false;
  }
}

void Stream::flush() {
  if (!partial.empty()) emit(partial);
  partial.clear();
}

void Stream::close() {
  if (fd >= 0) ::close(fd);
  if (log_fd >= 0) ::close(log_fd);
  fd = log_fd = -1;
}

// Note [A machine that ssh cannot reach]
// mpirun starts the ranks of other machines over ssh. When ssh fails, its own line names the
// machine and the reason (a host key that does not match known_hosts, a refused login, no route),
// and Open MPI's generic banner about daemons that could not start follows it. That line, made
// plain, is the root cause.
std::string ssh_failure(const std::deque<std::string>& tail) {
  auto after = [](const std::string& line, const std::string& marker) {
    const auto at = line.find(marker);
    if (at == std::string::npos) return std::string();
    std::string rest = line.substr(at + marker.size());
    const auto end = rest.find_first_of(" \t");
    return rest.substr(0, end);
  };
  std::string changed_host, unknown_host;
  for (const auto& line : tail) {
    if (auto host = after(line, "Host key for "); !host.empty()) changed_host = host;
    if (auto host = after(line, "host key is known for "); !host.empty()) unknown_host = host;
    if (line.find("Host key verification failed") != std::string::npos) {
      if (!unknown_host.empty()) {
        return "ssh refused to log in to " + unknown_host +
               ": known_hosts holds no key for it (Host key verification failed)";
      }
      return "ssh refused to log in to " + (changed_host.empty() ? std::string("a machine of the host file") : changed_host) +
             ": its host key is not the one known_hosts holds for it (Host key verification failed)";
    }
    if (line.find("Permission denied (") != std::string::npos) {
      return "ssh could not log in: " + line + " (the machine does not accept this machine's key for that user)";
    }
    if (line.rfind("ssh: ", 0) == 0) return line;  // ssh: connect to host ..., ssh: Could not resolve hostname ...
  }
  return {};
}

std::string last_error(const std::string& error_file, const std::deque<std::string>& tail) {
  if (!error_file.empty()) {
    std::ifstream in(error_file);
    std::stringstream text;
    text << in.rdbuf();
    std::string msg = text.str();
    while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
    if (!msg.empty()) return msg;
  }
  for (auto it = tail.rbegin(); it != tail.rend(); ++it) {
    const std::string& line = *it;
    if (line.find("rror") != std::string::npos || line.find("what()") != std::string::npos ||
        line.find("terminate") != std::string::npos || line.find("xception") != std::string::npos ||
        line.find("ailed") != std::string::npos) {
      return line;
    }
  }
  return tail.empty() ? std::string() : tail.back();
}

}  // namespace accelerate::detail::launch
