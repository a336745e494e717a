// Worker process creation; see subprocess.h.
#include "detail/subprocess.h"

#include "detail/check.h"

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

namespace accelerate::detail {
namespace {

bool is_executable(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

void close_quietly(int fd) {
  if (fd >= 0) ::close(fd);
}

}  // namespace

std::string signal_name(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev != nullptr ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

std::string resolve_program(const std::string& program) {
  ACCELERATE_CHECK_VALUE(!program.empty(), "[launch] no program to run was given");
  if (program.find('/') != std::string::npos) {
    ACCELERATE_CHECK_VALUE(::access(program.c_str(), F_OK) == 0, "[launch] the program '", program, "' does not exist");
    ACCELERATE_CHECK_VALUE(is_executable(program), "[launch] the program '", program,
                           "' is not an executable file (check its permissions)");
    return program;
  }
  const char* path_env = std::getenv("PATH");
  std::string path = path_env != nullptr ? path_env : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find(':', start);
    if (end == std::string::npos) end = path.size();
    std::string dir = path.substr(start, end - start);
    std::string candidate = (dir.empty() ? "." : dir) + "/" + program;
    if (is_executable(candidate)) return candidate;
    start = end + 1;
  }
  detail::raise_value_error(detail::concat("[launch] the program '", program, "' was not found in PATH"));
}

ChildProcess spawn_child(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  ACCELERATE_CHECK(!argv.empty(), "[launch] an empty command line");
  // Everything the child needs is prepared before fork: after it only async-signal-safe calls.
  std::vector<char*> c_argv;
  for (const auto& a : argv) c_argv.push_back(const_cast<char*>(a.c_str()));
  c_argv.push_back(nullptr);
  std::vector<char*> c_env;
  for (const auto& e : env) c_env.push_back(const_cast<char*>(e.c_str()));
  c_env.push_back(nullptr);

  int out[2] = {-1, -1};
  int err[2] = {-1, -1};
  int status[2] = {-1, -1};  // carries errno of a failed exec
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0 || ::pipe2(status, O_CLOEXEC) != 0) {
    const int e = errno;
    for (int fd : {out[0], out[1], err[0], err[1], status[0], status[1]}) close_quietly(fd);
    detail::raise_error(detail::concat("[launch] could not create pipes for a worker: ", std::strerror(e)));
  }
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int e = errno;
    for (int fd : {out[0], out[1], err[0], err[1], status[0], status[1]}) close_quietly(fd);
    detail::raise_error(detail::concat("[launch] fork failed: ", std::strerror(e)));
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the launcher died before the line above
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGPIPE, SIGQUIT}) ::sigaction(sig, &dfl, nullptr);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    ::execve(c_argv[0], c_argv.data(), c_env.data());
    const int e = errno;
    (void)!::write(status[1], &e, sizeof(e));
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also from the parent, so signalling the group never races the child
  close_quietly(out[1]);
  close_quietly(err[1]);
  close_quietly(status[1]);
  int exec_errno = 0;
  ssize_t n = 0;
  do {
    n = ::read(status[0], &exec_errno, sizeof(exec_errno));
  } while (n < 0 && errno == EINTR);
  close_quietly(status[0]);
  if (n == static_cast<ssize_t>(sizeof(exec_errno))) {
    ::waitpid(pid, nullptr, 0);
    close_quietly(out[0]);
    close_quietly(err[0]);
    detail::raise_error(detail::concat("[launch] could not start '", argv[0], "': ", std::strerror(exec_errno)));
  }
  ::fcntl(out[0], F_SETFL, ::fcntl(out[0], F_GETFL) | O_NONBLOCK);
  ::fcntl(err[0], F_SETFL, ::fcntl(err[0], F_GETFL) | O_NONBLOCK);
  return ChildProcess{pid, out[0], err[0]};
}

}  // namespace accelerate::detail
