// When `accelerate launch` starts its workers again: the one rule that its three ways of running a
// job share (static machine ranks, mpirun, the rounds of an elastic job), and the loop of attempts
// of a job of a fixed size, in which the launchers of several machines restart together (Note [A
// machine that comes back] in restarts.cpp). The rounds of an elastic job, which regroup without
// a restart, are elastic.h's; one attempt is the supervisor's (supervisor.h).
#pragma once

#include "accelerate/commands/launch.h"
#include "launch/supervisor.h"

#include <filesystem>
#include <map>
#include <string>

namespace accelerate::detail::launch {

/// Whether the launcher starts its workers again after an attempt that ended with `result`, when
/// it has restarted them `restarts` times already: only when they failed (they did not succeed,
/// did not save their state and stop as asked, and the launcher was not asked to stop) and
/// `max_restarts` (--max_restarts) allows one more.
bool restart_after(const AttemptResult& result, int restarts, int max_restarts);

/// Runs the attempts of a job of a fixed size on this machine, on its back-end (mpirun's for
/// "mpi"), until one ends without a restart; returns the launcher's exit code. `serves_store`:
/// this machine's launcher serves the rendezvous store at `port` (machine 0).
int run_attempts(const commands::LaunchPlan& plan, Supervisor& supervisor,
                 const std::map<std::string, std::string>& base, const std::filesystem::path& scratch, int port,
                 bool serves_store);

}  // namespace accelerate::detail::launch
