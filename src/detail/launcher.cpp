// Supervision of worker processes; see launcher.h.
#include "detail/launcher.h"

#include "detail/subprocess.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fcntl.h>
#include <fstream>
#include <poll.h>
#include <sstream>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

namespace accelerate::detail {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

constexpr size_t kTailLines = 20;

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

// One output stream of one worker: line assembly, prefixing, log file, tail for diagnostics.
struct Stream {
  int fd = -1;
  int console_fd = STDOUT_FILENO;
  bool to_console = true;
  int log_fd = -1;
  std::string prefix;
  std::string partial;
  std::deque<std::string> tail;  // kept for stderr only
  bool keep_tail = false;

  void emit(const std::string& line) {
    if (to_console) write_all(console_fd, prefix + line + "\n");
    if (log_fd >= 0) write_all(log_fd, line + "\n");
    if (keep_tail && !line.empty()) {
      tail.push_back(line);
      if (tail.size() > kTailLines) tail.pop_front();
    }
  }
  // Reads what is available; returns false at end of stream.
  bool pump() {
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
  void flush() {
    if (!partial.empty()) emit(partial);
    partial.clear();
  }
  void close() {
    if (fd >= 0) ::close(fd);
    if (log_fd >= 0) ::close(log_fd);
    fd = log_fd = -1;
  }
};

struct Worker {
  const WorkerSpec* spec = nullptr;
  pid_t pid = -1;
  bool alive = false;
  int status = 0;
  Stream out;
  Stream err;
};

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + signal_name(sig) + ")";
  }
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

int exit_code_of(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

// The worker's own account of its failure: the error file, else the most telling stderr line.
std::string last_error(const Worker& w) {
  if (!w.spec->error_file.empty()) {
    std::ifstream in(w.spec->error_file);
    std::stringstream text;
    text << in.rdbuf();
    std::string msg = text.str();
    while (!msg.empty() && (msg.back() == '\n' || msg.back() == ' ')) msg.pop_back();
    if (!msg.empty()) return msg;
  }
  for (auto it = w.err.tail.rbegin(); it != w.err.tail.rend(); ++it) {
    const std::string& line = *it;
    if (line.find("rror") != std::string::npos || line.find("what()") != std::string::npos ||
        line.find("terminate") != std::string::npos || line.find("xception") != std::string::npos ||
        line.find("ailed") != std::string::npos) {
      return line;
    }
  }
  return w.err.tail.empty() ? std::string() : w.err.tail.back();
}

int open_log(const fs::path& path) {
  fs::create_directories(path.parent_path());
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TORCH_CHECK(fd >= 0, "[launch] cannot write the log file ", path.string(), ": ", std::strerror(errno));
  return fd;
}

}  // namespace

Supervisor::Supervisor() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&set, sig);
  TORCH_CHECK(::pthread_sigmask(SIG_BLOCK, &set, nullptr) == 0, "[launch] cannot block signals");
  signal_fd_ = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  TORCH_CHECK(signal_fd_ >= 0, "[launch] signalfd failed: ", std::strerror(errno));
  ::signal(SIGPIPE, SIG_IGN);  // a closed console must not kill the supervisor
}

Supervisor::~Supervisor() {
  if (signal_fd_ >= 0) ::close(signal_fd_);
}

AttemptResult Supervisor::run(const std::vector<WorkerSpec>& specs, const SuperviseOptions& options) {
  AttemptResult result;
  std::vector<Worker> workers(specs.size());
  const bool logs = options.log_dir.has_value();
  const fs::path attempt_dir = logs ? fs::path(*options.log_dir) / ("attempt_" + std::to_string(options.attempt))
                                    : fs::path();

  int interrupt_signal = pending_signal_;
  bool tearing_down = false;
  Clock::time_point kill_deadline = Clock::time_point::max();
  bool killed_hard = false;
  const Worker* root = nullptr;

  auto signal_all = [&](int sig) {
    for (auto& w : workers) {
      if (w.alive) ::kill(-w.pid, sig);
    }
  };
  auto begin_teardown = [&](int sig) {
    if (tearing_down) return;
    tearing_down = true;
    signal_all(sig);
    kill_deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                       std::chrono::duration<double>(options.grace_period));
  };

  // Start every worker; a worker that cannot start fails the attempt like a crash would.
  std::string start_error;
  for (size_t i = 0; i < specs.size() && interrupt_signal == 0; ++i) {
    Worker& w = workers[i];
    w.spec = &specs[i];
    const std::string tag = "[rank" + std::to_string(specs[i].rank) + "]: ";
    w.out.prefix = w.err.prefix = tag;
    w.out.console_fd = STDOUT_FILENO;
    w.err.console_fd = STDERR_FILENO;
    w.err.keep_tail = true;
    if (logs) {
      const fs::path dir = attempt_dir / ("rank_" + std::to_string(specs[i].rank));
      w.out.log_fd = open_log(dir / "stdout.log");
      w.err.log_fd = open_log(dir / "stderr.log");
      w.out.to_console = (options.tee & 1) != 0;
      w.err.to_console = (options.tee & 2) != 0;
    }
    try {
      ChildProcess child = spawn_child(specs[i].argv, specs[i].env);
      w.pid = child.pid;
      w.alive = true;
      w.out.fd = child.stdout_fd;
      w.err.fd = child.stderr_fd;
    } catch (const c10::Error& e) {
      start_error = e.what_without_backtrace();
      result.exit_code = 127;
      result.root_cause = "rank " + std::to_string(specs[i].rank) + " could not start: " + start_error;
      w.out.close();
      w.err.close();
      begin_teardown(SIGTERM);
      break;
    }
  }
  if (!start_error.empty()) say(result.root_cause);

  auto reap = [&] {
    while (true) {
      int status = 0;
      pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) return;
      for (auto& w : workers) {
        if (w.pid != pid || !w.alive) continue;
        w.alive = false;
        w.status = status;
        if (status != 0 && !tearing_down) {
          root = &w;
          begin_teardown(SIGTERM);
        }
      }
    }
  };

  while (true) {
    const bool any_alive = std::any_of(workers.begin(), workers.end(), [](const Worker& w) { return w.alive; });
    const bool any_open = std::any_of(workers.begin(), workers.end(),
                                      [](const Worker& w) { return w.out.fd >= 0 || w.err.fd >= 0; });
    if (!any_alive && !any_open) break;

    std::vector<struct pollfd> fds;
    std::vector<Stream*> streams;
    fds.push_back({signal_fd_, POLLIN, 0});
    for (auto& w : workers) {
      for (Stream* s : {&w.out, &w.err}) {
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
        }
      }
    }
    auto timeout = std::chrono::duration<double>(options.monitor_interval);
    if (tearing_down && !killed_hard) {
      timeout = std::min<std::chrono::duration<double>>(timeout, kill_deadline - Clock::now());
    }
    if (!any_alive) timeout = std::min<std::chrono::duration<double>>(timeout, std::chrono::milliseconds(200));
    const int timeout_ms = std::max(0, static_cast<int>(std::ceil(timeout.count() * 1000)));
    int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) C10_THROW_ERROR(Error, c10::str("[launch] poll failed: ", std::strerror(errno)));

    if (ready > 0 && (fds[0].revents & POLLIN) != 0) {
      struct signalfd_siginfo info {};
      while (::read(signal_fd_, &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
        const int sig = static_cast<int>(info.ssi_signo);
        if (sig == SIGCHLD) continue;
        if (interrupt_signal != 0 || tearing_down) {
          // A second request to stop: no more grace.
          interrupt_signal = interrupt_signal != 0 ? interrupt_signal : sig;
          signal_all(SIGKILL);
          killed_hard = true;
          continue;
        }
        interrupt_signal = sig;
        const auto alive = std::count_if(workers.begin(), workers.end(), [](const Worker& w) { return w.alive; });
        if (!options.quiet) say("received " + signal_name(sig) + ", forwarding it to " + std::to_string(alive) + " worker(s)");
        begin_teardown(sig);
      }
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      Stream* s = streams[i - 1];
      if (!s->pump()) {
        ::close(s->fd);
        s->fd = -1;
      }
    }
    reap();

    if (tearing_down && !killed_hard && Clock::now() >= kill_deadline) {
      const auto alive = std::count_if(workers.begin(), workers.end(), [](const Worker& w) { return w.alive; });
      if (alive > 0) {
        say(std::to_string(alive) + " worker(s) still running " + std::to_string(options.grace_period) +
            "s after SIGTERM; sending SIGKILL");
        signal_all(SIGKILL);
      }
      killed_hard = true;
    }
    // Streams held open by a process outside our groups must not keep us waiting forever.
    if (!any_alive) {
      for (auto& w : workers) {
        for (Stream* s : {&w.out, &w.err}) {
          if (s->fd >= 0 && !(ready > 0)) {
            s->flush();
            ::close(s->fd);
            s->fd = -1;
          }
        }
      }
    }
  }
  for (auto& w : workers) {
    w.out.close();
    w.err.close();
  }

  if (root != nullptr) {
    std::ostringstream msg;
    msg << "rank " << root->spec->rank << " (local rank " << root->spec->local_rank << ", pid " << root->pid << ") "
        << describe_status(root->status);
    const std::string error = last_error(*root);
    if (!error.empty()) msg << "\n  error: " << error;
    result.root_cause = msg.str();
    result.exit_code = exit_code_of(root->status);
    say("worker " + result.root_cause);
    const auto others = std::count_if(workers.begin(), workers.end(),
                                      [&](const Worker& w) { return &w != root && w.pid > 0 && w.status != 0; });
    if (others > 0) say("stopped the other " + std::to_string(others) + " worker(s) of the group");
  }
  if (interrupt_signal != 0) {
    result.interrupted = true;
    result.exit_code = 128 + interrupt_signal;
    if (result.root_cause.empty()) result.root_cause = "the launcher received " + signal_name(interrupt_signal);
  }
  pending_signal_ = 0;
  return result;
}

}  // namespace accelerate::detail
