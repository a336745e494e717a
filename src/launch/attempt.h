// One attempt of `accelerate launch`'s workers on this machine, from their start until every one
// of them, and everything they left behind, has ended: started directly or by a carrier
// (mpirun), their output relayed (worker_output.h), the launcher's signals forwarded or passed on
// to them, torn down on the first failure, and the attempt's end described (Note [A stop that
// reached another machine first] in attempt.cpp). The launcher's signal handling and what runs
// between attempts are the supervisor's (supervisor.h).
#pragma once

#include "launch/supervisor.h"

#include <csignal>
#include <vector>

namespace accelerate::detail::launch {

/// The signals that ask the launcher to stop: the first is forwarded to the workers, a second
/// kills them.
inline constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGHUP};
/// Passed on to the workers without stopping them: the signals a cluster sends ahead of a time
/// limit (Slurm's --signal=USR1@N), which a program that handles preemption saves on.
inline constexpr int kPassedSignals[] = {SIGUSR1, SIGUSR2};

/// Runs one attempt of `specs` (started by `carrier` when there is one) until all have ended,
/// reading the launcher's signals from `signal_fd`. `stop_signal` is a stop the launcher received
/// before the attempt (0: none; its workers then do not start); `passed` holds the signals for the
/// workers received before it, passed on once they have started (Note [Signals the workers cannot
/// take yet] in attempt.cpp) and then cleared.
AttemptResult run_attempt(const std::vector<WorkerSpec>& specs, const SuperviseOptions& options,
                          const CarrierSpec* carrier, int signal_fd, int stop_signal, std::vector<int>& passed);

}  // namespace accelerate::detail::launch
