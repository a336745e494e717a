// The launcher's supervisor: its signals, the attempts it runs and what they are given; see
// supervisor.h.
#include "launch/supervisor.h"

#include "detail/check.h"
#include "launch/attempt.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <iterator>
#include <pthread.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <unistd.h>

namespace accelerate::detail::launch {
namespace {

namespace fs = std::filesystem;

// Note [The launcher returns last]
// A supervisor such as Slurm or systemd restarts a job the moment its launcher returns, so the
// launcher must not return while any process of the job still runs: a second generation would
// write the same checkpoint folder as the first. Workers under mpirun are not the launcher's
// children, and when mpirun or a worker's wrapper dies first, the workers it started are left to
// their own. So the supervisor makes the launcher a child subreaper: every process of the job that
// loses its parent (the wrappers of a dead mpirun, the worker of a dead wrapper, a worker's own
// children, a daemon in a session of its own with an emptied environment) becomes the launcher's
// child, which it can wait for and stop. The launcher starts no process but the workers (or
// mpirun), so every child it has during an attempt is the job's, except those it had before the
// attempt began (a shell that `exec`s the launcher hands it its own background jobs). An attempt
// ends only when no worker is alive and no other child of the launcher is left; those left over
// get SIGTERM, then SIGKILL after the grace period (at once when the workers' grace period has
// already run out, or the launcher was asked twice to stop). A worker the launcher reaps this way
// died before its wrapper could report it, and its wait status is the real one, which makes it the
// root cause rather than the ranks that mpirun stopped because of it.

// Note [Signals of other threads]
// The supervisor blocks the signals it forwards in its own thread and reads them from a signalfd.
// A thread that a library started before that (LibTorch's CUDA build starts some while it loads)
// does not block them, and a signal sent to the process may be delivered there, where its
// default action would kill the launcher and leave the workers running. A handler, which every
// thread shares, passes such a signal on to the supervisor's thread, where it stays pending until
// the signalfd reads it.
std::atomic<pthread_t> g_supervisor_thread{};

void pass_to_supervisor(int sig) { ::pthread_kill(g_supervisor_thread.load(), sig); }

}  // namespace

Supervisor::Supervisor() {
  sigset_t set;
  sigemptyset(&set);
  for (int sig : kForwardedSignals) sigaddset(&set, sig);
  for (int sig : kPassedSignals) sigaddset(&set, sig);
  sigaddset(&set, SIGCHLD);
  ACCELERATE_CHECK(::pthread_sigmask(SIG_BLOCK, &set, nullptr) == 0, "[launch] cannot block signals");
  signal_fd_ = ::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  ACCELERATE_CHECK(signal_fd_ >= 0, "[launch] signalfd failed: ", std::strerror(errno));
  g_supervisor_thread.store(::pthread_self());
  struct sigaction redirect {};
  redirect.sa_handler = pass_to_supervisor;
  sigemptyset(&redirect.sa_mask);
  redirect.sa_flags = SA_RESTART;
  for (int sig : kForwardedSignals) ::sigaction(sig, &redirect, nullptr);
  for (int sig : kPassedSignals) ::sigaction(sig, &redirect, nullptr);
  ::signal(SIGPIPE, SIG_IGN);  // a closed console must not kill the supervisor
  // Note [The launcher returns last]
  int subreaper = 0;
  if (::prctl(PR_GET_CHILD_SUBREAPER, &subreaper) == 0) was_subreaper_ = subreaper != 0;
  ACCELERATE_CHECK(::prctl(PR_SET_CHILD_SUBREAPER, 1) == 0,
                   "[launch] cannot adopt the job's orphaned processes: ", std::strerror(errno));
}

Supervisor::~Supervisor() {
  if (!was_subreaper_) ::prctl(PR_SET_CHILD_SUBREAPER, 0);
  for (int sig : kForwardedSignals) ::signal(sig, SIG_DFL);
  for (int sig : kPassedSignals) ::signal(sig, SIG_DFL);
  if (signal_fd_ >= 0) ::close(signal_fd_);
}

int Supervisor::stop_requested() {
  struct signalfd_siginfo info {};
  while (pending_signal_ == 0 && ::read(signal_fd_, &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
    const int sig = static_cast<int>(info.ssi_signo);
    if (std::find(std::begin(kForwardedSignals), std::end(kForwardedSignals), sig) != std::end(kForwardedSignals)) {
      pending_signal_ = sig;
    }
    const bool passed = std::find(std::begin(kPassedSignals), std::end(kPassedSignals), sig) != std::end(kPassedSignals);
    if (passed && std::find(pending_passed_.begin(), pending_passed_.end(), sig) == pending_passed_.end()) {
      pending_passed_.push_back(sig);
    }
  }
  return pending_signal_;
}

AttemptResult Supervisor::run(const std::vector<WorkerSpec>& specs, const SuperviseOptions& options,
                              const CarrierSpec* carrier) {
  AttemptResult result = run_attempt(specs, options, carrier, signal_fd_, pending_signal_, pending_passed_);
  pending_signal_ = 0;
  return result;
}

std::vector<WorkerSpec> worker_specs(const commands::LaunchPlan& plan, const std::map<std::string, std::string>& base,
                                     const fs::path& scratch, int port, int attempt) {
  std::vector<WorkerSpec> specs(plan.local_num_processes);
  for (int local = 0; local < plan.local_num_processes; ++local) {
    auto& spec = specs[local];
    spec.local_rank = local;
    spec.rank = plan.machine_rank * plan.local_num_processes + local;
    spec.argv = plan.command;
    spec.error_file = (scratch / ("error_" + std::to_string(attempt) + "_" + std::to_string(spec.rank))).string();
    auto env = base;
    for (auto& [k, v] : commands::worker_environment(plan, local, port, attempt)) env[k] = v;
    env["ACCELERATE_ERROR_FILE"] = spec.error_file;
    for (auto& [k, v] : env) spec.env.push_back(k + "=" + v);
  }
  return specs;
}

SuperviseOptions supervise_options(const commands::LaunchPlan& plan, int attempt) {
  SuperviseOptions options;
  options.monitor_interval = plan.monitor_interval;
  options.grace_period = plan.grace_period;
  options.log_dir = plan.log_dir;
  options.tee = plan.tee;
  options.attempt = attempt;
  options.quiet = plan.quiet;
  // Note [A stop that reached another machine first] in attempt.cpp
  if (plan.num_machines > 1) options.stop_echo_window = kStopEchoWindow;
  return options;
}

}  // namespace accelerate::detail::launch
