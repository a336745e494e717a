// Running real programs from tests: start one with captured stdout/stderr, signal it, wait for it
// with a deadline (a test never hangs: past the deadline the process group is killed and the
// test fails), and small probes for pids and ports.
#pragma once

#include "detail/topology.h"
#include "detail/subprocess.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace accelerate::testing {

/// An environment variable the test harness must provide (CTest sets them).
inline std::string required_env(const char* key) {
  const char* value = std::getenv(key);
  if (value == nullptr) {
    ADD_FAILURE() << key << " is not set; run the tests through ctest";
    return {};
  }
  return value;
}

/// A program built under the build tree, e.g. `built("bin/accelerate")`.
inline std::string built(const std::string& relative) { return required_env("ACCELERATE_BINARY_DIR") + "/" + relative; }
inline std::string accelerate_bin() { return built("bin/accelerate"); }
inline std::string worker_bin() { return built("tests/mp_worker"); }

/// A program running in the background with its output captured.
class Running {
 public:
  explicit Running(const std::vector<std::string>& argv, const std::map<std::string, std::string>& extra_env = {}) {
    std::map<std::string, std::string> env;
    for (auto& [k, v] : detail::environment_entries()) env[k] = v;
    for (auto& [k, v] : extra_env) env[k] = v;
    std::vector<std::string> entries;
    for (auto& [k, v] : env) entries.push_back(k + "=" + v);
    auto resolved = argv;
    resolved[0] = detail::resolve_program(argv[0]);
    child_ = detail::spawn_child(resolved, entries);
    start_ = std::chrono::steady_clock::now();
  }
  ~Running() {
    if (!finished_) {
      ::kill(-child_.pid, SIGKILL);
      ::waitpid(child_.pid, nullptr, 0);
    }
    if (child_.stdout_fd >= 0) ::close(child_.stdout_fd);
    if (child_.stderr_fd >= 0) ::close(child_.stderr_fd);
  }
  Running(const Running&) = delete;
  Running& operator=(const Running&) = delete;

  pid_t pid() const { return child_.pid; }
  void signal(int sig) const { ::kill(child_.pid, sig); }

  /// Waits for the exit (and the end of its output); kills it and fails the test past `seconds`.
  void wait(double seconds) {
    const auto deadline = start_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                       std::chrono::duration<double>(seconds));
    while (child_.stdout_fd >= 0 || child_.stderr_fd >= 0 || !finished_) {
      drain(50);
      if (!finished_) {
        int status = 0;
        if (::waitpid(child_.pid, &status, WNOHANG) == child_.pid) {
          finished_ = true;
          status_ = status;
        }
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ADD_FAILURE() << "still running after " << seconds << " s; killed.\nstdout:\n" << out << "\nstderr:\n" << err;
        ::kill(-child_.pid, SIGKILL);
        if (!finished_) ::waitpid(child_.pid, &status_, 0);
        finished_ = true;
        drain(0);
        break;
      }
    }
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

  /// The exit code, or 128 + signal when killed by one.
  int exit_code() const { return WIFSIGNALED(status_) ? 128 + WTERMSIG(status_) : WEXITSTATUS(status_); }

  std::string out;
  std::string err;
  double elapsed = 0;

 private:
  void drain(int timeout_ms) {
    std::vector<struct pollfd> fds;
    if (child_.stdout_fd >= 0) fds.push_back({child_.stdout_fd, POLLIN, 0});
    if (child_.stderr_fd >= 0) fds.push_back({child_.stderr_fd, POLLIN, 0});
    if (fds.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
      return;
    }
    if (::poll(fds.data(), fds.size(), timeout_ms) <= 0) return;
    for (auto& p : fds) {
      if (p.revents == 0) continue;
      char buf[65536];
      ssize_t n = ::read(p.fd, buf, sizeof(buf));
      std::string& target = p.fd == child_.stdout_fd ? out : err;
      if (n > 0) {
        target.append(buf, static_cast<size_t>(n));
      } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        ::close(p.fd);
        (p.fd == child_.stdout_fd ? child_.stdout_fd : child_.stderr_fd) = -1;
      }
    }
  }

  detail::ChildProcess child_;
  std::chrono::steady_clock::time_point start_;
  bool finished_ = false;
  int status_ = 0;
};

/// Runs a program to completion (at most `seconds`).
inline std::unique_ptr<Running> run(const std::vector<std::string>& argv, double seconds = 60,
                                    const std::map<std::string, std::string>& extra_env = {}) {
  auto r = std::make_unique<Running>(argv, extra_env);
  r->wait(seconds);
  return r;
}

/// Whether a process is gone (no such pid, or a zombie nobody reaped yet).
inline bool process_gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return true;
  // Through the stream, not its buffer: reading a process that ends meanwhile fails with ESRCH,
  // which the buffer throws and the stream turns into an empty read (a process gone).
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  std::getline(stat, text);
  const auto close_paren = text.rfind(')');
  return close_paren == std::string::npos || (close_paren + 2 < text.size() && text[close_paren + 2] == 'Z');
}

/// The parent of a process, from /proc (-1 when it is gone).
inline pid_t parent_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  std::getline(in, text);  // as in process_gone: a process that ends meanwhile reads as empty
  const auto close_paren = text.rfind(')');
  if (close_paren == std::string::npos) return -1;
  std::istringstream rest(text.substr(close_paren + 2));
  std::string state;
  long ppid = -1;
  rest >> state >> ppid;
  return static_cast<pid_t>(ppid);
}

/// Waits up to `seconds` for a process to be gone.
inline bool wait_gone(pid_t pid, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    if (process_gone(pid)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return process_gone(pid);
}

/// Waits up to `seconds` for a process to be reaped by its parent (no such pid any more, not even a
/// zombie).
inline bool wait_reaped(pid_t pid, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (::kill(pid, 0) == 0) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

/// Waits up to `seconds` until a process catches `sig` (a handler of its own, /proc's SigCgt):
/// before that, the signal's default action would end it instead of reaching its code.
inline bool wait_until_catching(pid_t pid, int sig, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  const unsigned long long bit = 1ull << (sig - 1);
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream status("/proc/" + std::to_string(pid) + "/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("SigCgt:", 0) == 0 && (std::stoull(line.substr(7), nullptr, 16) & bit) != 0) return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

/// Reads an integer from a file that another process writes, waiting up to `seconds` for it.
inline int wait_for_int_file(const std::string& path, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(path);
    int value = 0;
    if (in >> value && value > 0) return value;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << "no integer appeared in " << path << " within " << seconds << " s";
  return -1;
}

/// A TCP port that was free a moment ago.
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

/// The launcher of machine rank `rank` of a HYBRID_SHARD job of tests/mp_fsdp in `dir`: four
/// processes over two machine ranks on this host, on Gloo, meeting at `port`. Start one for "0"
/// and one for "1", with ACCELERATE_RDZV_SECRET set.
inline std::vector<std::string> hybrid_shard_launcher(const char* rank, const std::string& port,
                                                      const std::string& dir) {
  return {accelerate_bin(), "launch", "--num_processes", "4", "--num_machines", "2", "--machine_rank", rank,
          "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--rdzv_timeout", "60", "--backend", "gloo",
          "--fsdp_sharding_strategy", "HYBRID_SHARD", built("tests/mp_fsdp"), dir};
}

/// Waits up to `seconds` until something accepts connections on 127.0.0.1:`port`.
inline bool wait_for_port(int port, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < deadline) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    ::close(fd);
    if (ok) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

}  // namespace accelerate::testing
