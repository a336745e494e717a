// What /proc says about the job's processes; see processes.h.
#include "launch/processes.h"

#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <dirent.h>
#include <fstream>
#include <optional>
#include <unistd.h>

namespace accelerate::detail::launch {
namespace {

// The signals `pid` catches or ignores (its SigCgt and SigIgn), as a mask with bit N-1 for signal
// N; nullopt when it is gone.
std::optional<uint64_t> handled_signals(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::optional<uint64_t> mask;
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("SigIgn:", 0) == 0 || line.rfind("SigCgt:", 0) == 0) {
      mask = mask.value_or(0) | std::strtoull(line.c_str() + 7, nullptr, 16);
    }
  }
  return mask;
}

}  // namespace

bool process_gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  // Through the stream, not its buffer: reading a process that ends meanwhile fails with ESRCH,
  // which the buffer throws and the stream turns into an empty read.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  std::getline(stat, text);
  const auto close_paren = text.rfind(')');
  return close_paren == std::string::npos || (close_paren + 2 < text.size() && text[close_paren + 2] == 'Z');
}

std::string describe_processes(const std::vector<pid_t>& pids) {
  constexpr size_t kNamed = 8;
  std::string out;
  for (size_t i = 0; i < pids.size() && i < kNamed; ++i) {
    std::ifstream comm("/proc/" + std::to_string(pids[i]) + "/comm");
    std::string name;
    if (!std::getline(comm, name) || name.empty()) name = "?";
    out += (i == 0 ? "" : ", ") + std::to_string(pids[i]) + " (" + name + ")";
  }
  if (pids.size() > kNamed) out += ", and " + std::to_string(pids.size() - kNamed) + " more";
  return out;
}

std::vector<pid_t> children_of(const std::string& process) {
  std::vector<pid_t> children;
  const std::string task_dir = "/proc/" + process + "/task";
  DIR* tasks = ::opendir(task_dir.c_str());
  if (tasks == nullptr) return children;
  while (const dirent* entry = ::readdir(tasks)) {
    if (entry->d_name[0] == '.') continue;
    std::ifstream in(task_dir + "/" + entry->d_name + "/children");
    for (long pid; in >> pid;) children.push_back(static_cast<pid_t>(pid));
  }
  ::closedir(tasks);
  return children;
}

std::vector<pid_t> own_children() { return children_of("self"); }

bool group_handles(pid_t leader, int sig) {
  const uint64_t bit = uint64_t{1} << (sig - 1);
  std::vector<pid_t> todo = {leader};
  bool any = false;
  for (int seen = 0; !todo.empty() && seen < 4096; ++seen) {
    const pid_t pid = todo.back();
    todo.pop_back();
    if (::getpgid(pid) != leader) continue;
    const auto handled = handled_signals(pid);
    if (!handled) continue;  // gone meanwhile
    if ((*handled & bit) == 0) return false;
    any = true;
    const auto children = children_of(std::to_string(pid));
    todo.insert(todo.end(), children.begin(), children.end());
  }
  return any;
}

}  // namespace accelerate::detail::launch
