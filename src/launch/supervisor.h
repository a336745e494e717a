// The supervisor of `accelerate launch`: it owns the launcher's signal handling, and runs the
// attempts of a group of workers (attempt.h: it relays their output line by line with a rank
// prefix, reaps them, and on the first failure, or a signal to the launcher, tears the rest down:
// SIGTERM, a grace period, then SIGKILL). Also what an attempt is given: its workers' commands and
// environments, and the supervision settings of the launch. Whether to run another attempt is the
// launch's (restarts.h).
#pragma once

#include "accelerate/commands/launch.h"

#include <filesystem>
#include <map>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace accelerate::detail::launch {

/// One worker to start.
struct WorkerSpec {
  int rank = 0;
  int local_rank = 0;
  std::vector<std::string> argv;  ///< argv[0] resolved to a path
  std::vector<std::string> env;   ///< complete environment, "KEY=VALUE"
  std::string error_file;         ///< where the worker writes its fatal error (may stay absent)
  /// Named pipes its output arrives through, when a carrier starts it (else it is our child).
  std::string stdout_pipe;
  std::string stderr_pipe;
};

/// A process that starts the workers itself (`mpirun`). Each worker's wrapper reports
/// "start <rank> <pid>" and "exit <rank> <code>" lines on `status_pipe`; the carrier's own output
/// is relayed with its name as prefix.
struct CarrierSpec {
  std::string name = "mpirun";
  std::vector<std::string> argv;
  std::vector<std::string> env;
  std::string status_pipe;
  /// Whether every worker's wrapper reports on `status_pipe` (false when some run on other
  /// machines): the signals passed on to the workers then go to the carrier, which forwards them.
  bool reports_every_worker = true;
};

/// The stop echo window of a job of several machines.
inline constexpr double kStopEchoWindow = 2;

struct SuperviseOptions {
  double monitor_interval = 0.1;
  double grace_period = 5;
  std::optional<std::string> log_dir;  ///< per-worker log files under attempt_<k>/rank_<r>/
  int tee = 3;                         ///< with log_dir: 1 stdout, 2 stderr, 3 both, 0 none on the console
  int attempt = 0;
  bool quiet = false;  ///< no informational lines, only errors
  /// Seconds a launcher whose workers failed waits for a stop request of its own, which then
  /// counts as the cause (Note [A stop that reached another machine first]); 0: none.
  double stop_echo_window = 0;
  /// Asked about every half second while workers run: true stops them (SIGTERM, then SIGKILL past
  /// the grace period) so that the group can be formed again (Note [Elastic membership]).
  std::function<bool()> regroup;
};

/// The supervision settings of attempt `attempt` of a launch.
SuperviseOptions supervise_options(const commands::LaunchPlan& plan, int attempt);

/// The workers this machine runs in attempt `attempt` of `plan` (machine `plan.machine_rank` of
/// `plan.num_machines`): `base` plus the launch contract's variables, error files in `scratch`.
std::vector<WorkerSpec> worker_specs(const commands::LaunchPlan& plan, const std::map<std::string, std::string>& base,
                                     const std::filesystem::path& scratch, int port, int attempt);

/// How one attempt ended.
struct AttemptResult {
  int exit_code = 0;           ///< 0, the root-cause worker's code, or 128 + signal
  bool interrupted = false;    ///< the launcher itself received a signal
  bool preempted = false;      ///< the workers saved their state and stopped, as asked (Note [Preemption])
  bool regrouped = false;      ///< stopped because `SuperviseOptions::regroup` asked to
  std::string root_cause;      ///< one-paragraph description of the failure, empty on success
};

/// Owns the launcher's signal handling. Construct it before starting any thread (for example
/// the rendezvous store), so that every thread of the launcher blocks the signals it handles.
class Supervisor {
 public:
  Supervisor();
  ~Supervisor();
  Supervisor(const Supervisor&) = delete;
  Supervisor& operator=(const Supervisor&) = delete;

  /// Runs the workers until all have exited; never returns with one still alive, nor with any
  /// other process of the job (Note [The launcher returns last] in supervisor.cpp).
  AttemptResult run(const std::vector<WorkerSpec>& workers, const SuperviseOptions& options,
                    const CarrierSpec* carrier = nullptr);

  /// Between attempts (while the launcher waits at a rendezvous): the signal that asks the
  /// launcher to stop (SIGINT, SIGTERM, SIGHUP) if one came, else 0. Signals passed on to workers
  /// (SIGUSR1, SIGUSR2) are kept for the next attempt's workers.
  int stop_requested();

 private:
  int signal_fd_ = -1;
  int pending_signal_ = 0;  // a signal received between attempts
  std::vector<int> pending_passed_;  // signals for the workers, received between attempts
  bool was_subreaper_ = false;
};

}  // namespace accelerate::detail::launch
