// What /proc says about the processes of a job that `accelerate launch` supervises: whether one
// has ended, its name, the children of a process, and whether a process group takes a signal
// without dying of it. The attempt (attempt.cpp) decides what to do with the answers; nothing
// here signals or waits for a process.
#pragma once

#include <string>
#include <sys/types.h>
#include <vector>

namespace accelerate::detail::launch {

/// Whether a process has ended: no such pid, or a zombie its parent has not reaped yet.
bool process_gone(pid_t pid);

/// "pid (name), ..." for the first few of `pids`, as /proc names them ("?" for one already gone).
std::string describe_processes(const std::vector<pid_t>& pids);

/// The children of `process` ("self" or a pid), from every one of its threads.
std::vector<pid_t> children_of(const std::string& process);

/// The launcher's children, from every one of its threads.
std::vector<pid_t> own_children();

/// Whether every process of the group `leader` leads (it, and those of its descendants still in
/// the group) catches or ignores `sig`, so that passing it on kills none of them (Note [Signals
/// the workers cannot take yet] in attempt.cpp).
bool group_handles(pid_t leader, int sig);

}  // namespace accelerate::detail::launch
