// Starting a worker process: its own process group (so a whole tree can be signalled), death
// with the launcher (PR_SET_PDEATHSIG, even when the launcher is SIGKILLed), default signal
// dispositions, stdout/stderr on pipes, and exec errors reported back instead of lost.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace accelerate::detail {

/// A started child process with the read ends of its output pipes (non-blocking, close-on-exec).
struct ChildProcess {
  pid_t pid = -1;
  int stdout_fd = -1;
  int stderr_fd = -1;
};

/// Finds `program` the way a shell does (a name without '/' is searched in PATH); returns an
/// absolute or relative path that exists and is executable, or throws naming the program.
std::string resolve_program(const std::string& program);

/// Starts `argv` (argv[0] already resolved) with exactly `env` ("KEY=VALUE" entries). Throws with
/// the OS error when fork/exec fails (e.g. the file is not executable).
ChildProcess spawn_child(const std::vector<std::string>& argv, const std::vector<std::string>& env);

/// The signal's abbreviation with its prefix, e.g. "SIGKILL".
std::string signal_name(int sig);

}  // namespace accelerate::detail
