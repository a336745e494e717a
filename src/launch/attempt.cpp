// One attempt of the workers; see attempt.h.
#include "launch/attempt.h"

#include "detail/check.h"
#include "detail/durations.h"
#include "detail/exit_status.h"
#include "detail/subprocess.h"
#include "launch/processes.h"
#include "launch/worker_output.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <iterator>
#include <poll.h>
#include <set>
#include <sstream>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

namespace accelerate::detail::launch {
namespace {

namespace fs = std::filesystem;

// `s` seconds as the clock's duration.
Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

struct Worker {
  const WorkerSpec* spec = nullptr;
  pid_t pid = -1;
  bool alive = false;
  int status = 0;
  Stream out;
  Stream err;
  // A carried worker's pipes are also held open for writing by us, so that reading them never
  // ends before the worker has started; closed once it has exited.
  int keep_out = -1;
  int keep_err = -1;
  // Passed signals it does not handle yet, held until it does (Note [Signals the workers cannot
  // take yet]).
  std::vector<int> held;

  void release_pipes() {
    for (int* fd : {&keep_out, &keep_err}) {
      if (*fd >= 0) ::close(*fd);
      *fd = -1;
    }
  }
};

// The wait status a worker's exit code stands for, as its wrapper shell reports it (128 + N for
// a death by signal N).
int status_of_code(int code) {
  if (code > 128 && code < 128 + 65) return code - 128;
  return (code & 0xff) << 8;
}

int open_pipe(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags | O_NONBLOCK | O_CLOEXEC);
  ACCELERATE_CHECK(fd >= 0, "[launch] cannot open the pipe ", path, ": ", std::strerror(errno));
  return fd;
}

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + signal_name(sig) + ")";
  }
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

int exit_code_of(int status) { return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : WEXITSTATUS(status); }

// Note [Signals the workers cannot take yet]
// SIGUSR1 and SIGUSR2 are passed on for a program that handles them to stop at its next step
// (Note [Preemption] in src/preemption.cpp). While the workers are still starting, none can take
// one: before mpirun has started the ranks, a signal sent to mpirun reached nobody and the job
// trained to its end; a worker that has not yet installed its handler (before its Accelerator is
// made) is killed by it. So the launcher passes such a signal to a worker only once every process
// of the worker's group (it, and those of its descendants still in the group) catches or ignores
// it, as /proc/<pid>/status says, and holds it until then, looking again at every poll (50 ms at
// most). A worker that ends without ever handling it, as a program that does not handle the signal
// at all does, is named at the end of the attempt; it is no longer killed by the signal. A signal
// a process only blocks (to take it with sigwait or a signalfd) does not count, since a process
// may block signals for a moment while it starts. Workers the launcher does not see (under mpirun
// with a host file, on other machines) still get the signal through mpirun.

// Note [A stop that reached another machine first]
// A scheduler stops a job of several machines by signalling each machine's launcher, and those
// signals do not arrive at once: Slurm's scancel reaches one node's step some milliseconds before
// the other's. The first machine's workers end, and the collective they were in breaks on every
// other machine, so the other workers fail with "connection reset by peer" before their own
// launcher has received the very same stop. Blaming that failure would make the last line of one
// machine say the job crashed when it was cancelled. So in a job of several machines, a launcher
// whose workers failed waits, for a short window after the first failure (stop_echo_window), for a
// stop request of its own; one that comes within it makes the failure its echo: the failure is
// still shown, and the last line and the exit status are the stop's. A failure with no stop after it
// ends the attempt as before, that window later. The same holds on one machine for a worker killed
// by SIGTERM, SIGINT or SIGHUP (or ending with 128 + one of them): Slurm signals every process of a
// job step, the launcher's workers too, and the launcher may reap a worker before it reads its own
// signal. The price: a real crash on one machine that makes a scheduler stop the others (srun
// --kill-on-bad-exit) within the window is reported there as their stop; the crashed machine's own
// launcher still names the crash.

bool is_preempted(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == detail::kPreemptedExitStatus; }

// One attempt of the job: its workers (or the carrier that starts them), from their start until
// every one of them, and everything they left behind, has ended. run_attempt drives it
// through its steps: start, then watch (one poll at a time) until done, then report.
class Attempt {
 public:
  Attempt(const std::vector<WorkerSpec>& specs, const SuperviseOptions& options, const CarrierSpec* carrier,
          int signal_fd, int pending_signal)
      : specs_(specs),
        options_(options),
        carrier_(carrier),
        signal_fd_(signal_fd),
        workers_(specs.size()),
        interrupt_signal_(pending_signal) {
    // Children from before the attempt are not the job's (Note [The launcher returns last]).
    const std::vector<pid_t> before = own_children();
    not_the_jobs_.insert(before.begin(), before.end());
    if (options_.log_dir) attempt_dir_ = fs::path(*options_.log_dir) / ("attempt_" + std::to_string(options_.attempt));
  }

  // Step 1. Starts every worker (or the carrier that starts them); one that cannot start fails
  // the attempt like a crash would.
  void start() {
    if (carrier_ != nullptr) {
      start_carried();
    } else {
      start_directly();
    }
    if (!start_error_.empty()) say(result_.root_cause);
    for (auto& w : workers_) everyone_.push_back(&w);
    if (carrier_ != nullptr) everyone_.push_back(&carrier_proc_);
  }

  // A signal passed on to the workers: now to those that handle it, later to the others (Note
  // [Signals the workers cannot take yet]).
  void pass_on(int sig) {
    if (carrier_ != nullptr && !carrier_->reports_every_worker) {
      if (!options_.quiet) {
        say("received " + signal_name(sig) + ", passing it on to " + std::to_string(alive_workers()) + " worker(s)");
      }
      signal_all(sig);
      return;
    }
    long now = 0, later = 0;
    for (auto& w : workers_) {
      if (!w.alive) continue;
      if (w.pid > 0 && group_handles(w.pid, sig)) {
        signal_worker(w, sig);
        ++now;
      } else {
        if (std::find(w.held.begin(), w.held.end(), sig) == w.held.end()) w.held.push_back(sig);
        ++later;
      }
    }
    if (options_.quiet) return;
    const std::string name = signal_name(sig);
    if (later == 0) {
      say("received " + name + ", passing it on to " + std::to_string(now) + " worker(s)");
    } else if (now == 0) {
      say("received " + name + " before the " + std::to_string(later) + " worker(s) handle it; holding it until "
          "they do (" + name + " would kill them)");
    } else {
      say("received " + name + ", passing it on to " + std::to_string(now) + " worker(s) now and to " +
          std::to_string(later) + " more once they handle it (" + name + " would kill them)");
    }
  }

  // Step 2. Watches until every worker has ended, every stream is closed and nothing the job
  // left behind is still running.
  void watch() {
    while (true) {
      watch_orphaned_carried_workers();
      const bool any_alive = std::any_of(everyone_.begin(), everyone_.end(), [](const Worker* w) { return w->alive; });
      const bool any_open = std::any_of(everyone_.begin(), everyone_.end(),
                                        [](const Worker* w) { return w->out.fd >= 0 || w->err.fd >= 0; });
      bool settled = true;
      if (!any_alive) stop_leftovers(settled);
      if (!any_alive && !any_open && settled && !awaiting_stop()) return;
      poll_once(any_alive, settled);
    }
  }

  // Step 3. Closes what is left open and says how the attempt ended.
  AttemptResult finish() {
    for (Worker* w : everyone_) {
      w->out.close();
      w->err.close();
      w->release_pipes();
    }
    for (int fd : {status_fd_, status_keep_}) {
      if (fd >= 0) ::close(fd);
    }
    describe_held();
    if (root_ != nullptr) {
      describe_root_cause();
    } else {
      describe_preemption();
    }
    // Note [A stop that reached another machine first]
    if (interrupt_signal_ != 0 && in_echo_window(stopped_at_)) {
      result_.root_cause.clear();
    }
    if (interrupt_signal_ != 0) {
      result_.interrupted = true;
      if (!result_.preempted) result_.exit_code = 128 + interrupt_signal_;
      if (result_.root_cause.empty()) {
        result_.root_cause = "the launcher received " + signal_name(interrupt_signal_);
        // The last line says why the job ended (a scheduler's scancel or time limit, a Ctrl-C).
        const auto started =
            std::count_if(workers_.begin(), workers_.end(), [](const Worker& w) { return w.pid > 0; });
        say("stopped: the launcher received " + signal_name(interrupt_signal_) + "; its " + std::to_string(started) +
            " worker(s) have ended");
      }
    }
    return result_;
  }

 private:
  // Note [A stop that reached another machine first]: the workers failed, no stop has come yet,
  // and the window after the failure is still open.
  bool awaiting_stop() const { return interrupt_signal_ == 0 && in_echo_window(Clock::now()); }

  // Whether `t` falls within the echo window after the workers' failure.
  bool in_echo_window(Clock::time_point t) const {
    return root_ != nullptr && echo_window() > 0 && t - failed_at_ <= seconds(echo_window());
  }

  // The job's window, or, for a worker that a stop signal killed, kStopEchoWindow: a scheduler
  // signals every process of a job step, the workers as well as their launcher, in no set order.
  double echo_window() const {
    if (root_ != nullptr) {
      // Killed by the signal, or ended with its status after handling it.
      const int status = root_->status;
      const int sig = WIFSIGNALED(status) ? WTERMSIG(status) : WIFEXITED(status) ? WEXITSTATUS(status) - 128 : 0;
      if (std::find(std::begin(kForwardedSignals), std::end(kForwardedSignals), sig) != std::end(kForwardedSignals)) {
        return std::max(options_.stop_echo_window, kStopEchoWindow);
      }
    }
    return options_.stop_echo_window;
  }

  void set_root(const Worker& w) {
    root_ = &w;
    failed_at_ = Clock::now();
  }

  static void signal_worker(const Worker& w, int sig) {
    if (!w.alive || w.pid <= 0) return;
    if (::kill(-w.pid, sig) != 0) ::kill(w.pid, sig);
  }

  void signal_all(int sig) {
    for (auto& w : workers_) signal_worker(w, sig);
    // The carrier is left to end by itself once its workers have, unless it must die now or its
    // workers are not known yet.
    const bool known = std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.pid > 0; });
    if (carrier_ != nullptr && (sig == SIGKILL || !known)) signal_worker(carrier_proc_, sig);
  }

  void begin_teardown(int sig) {
    if (tearing_down_) return;
    tearing_down_ = true;
    teardown_signal_ = sig;
    signal_all(sig);
    kill_deadline_ = Clock::now() + seconds(options_.grace_period);
  }

  void setup_streams(Worker& w, const WorkerSpec& spec, const std::string& tag) {
    w.spec = &spec;
    w.out.prefix = w.err.prefix = tag;
    w.out.console_fd = STDOUT_FILENO;
    w.err.console_fd = STDERR_FILENO;
    w.err.keep_tail = true;
    if (options_.log_dir && spec.rank >= 0) {
      const fs::path dir = attempt_dir_ / ("rank_" + std::to_string(spec.rank));
      w.out.log_fd = open_log(dir / "stdout.log");
      w.err.log_fd = open_log(dir / "stderr.log");
      w.out.to_console = (options_.tee & 1) != 0;
      w.err.to_console = (options_.tee & 2) != 0;
    }
  }

  void start_carried() {
    for (size_t i = 0; i < specs_.size(); ++i) {
      Worker& w = workers_[i];
      setup_streams(w, specs_[i], "[rank" + std::to_string(specs_[i].rank) + "]: ");
      w.out.fd = open_pipe(specs_[i].stdout_pipe, O_RDONLY);
      w.keep_out = open_pipe(specs_[i].stdout_pipe, O_WRONLY);
      w.err.fd = open_pipe(specs_[i].stderr_pipe, O_RDONLY);
      w.keep_err = open_pipe(specs_[i].stderr_pipe, O_WRONLY);
    }
    status_fd_ = open_pipe(carrier_->status_pipe, O_RDONLY);
    status_keep_ = open_pipe(carrier_->status_pipe, O_WRONLY);
    carrier_spec_.rank = -1;
    carrier_spec_.argv = carrier_->argv;
    setup_streams(carrier_proc_, carrier_spec_, "[" + carrier_->name + "]: ");
    if (interrupt_signal_ == 0) {
      try {
        ChildProcess child = spawn_child(carrier_->argv, carrier_->env);
        carrier_proc_.pid = child.pid;
        carrier_proc_.alive = true;
        carrier_proc_.out.fd = child.stdout_fd;
        carrier_proc_.err.fd = child.stderr_fd;
        for (auto& w : workers_) w.alive = true;
      } catch (const std::exception& e) {
        start_error_ = detail::error_text(e);
        result_.exit_code = 127;
        result_.root_cause = carrier_->name + " could not start: " + start_error_;
      }
    }
    for (auto& w : workers_) {
      if (!w.alive) w.release_pipes();
    }
  }

  void start_directly() {
    for (size_t i = 0; i < specs_.size() && interrupt_signal_ == 0; ++i) {
      Worker& w = workers_[i];
      setup_streams(w, specs_[i], "[rank" + std::to_string(specs_[i].rank) + "]: ");
      try {
        ChildProcess child = spawn_child(specs_[i].argv, specs_[i].env);
        w.pid = child.pid;
        w.alive = true;
        w.out.fd = child.stdout_fd;
        w.err.fd = child.stderr_fd;
      } catch (const std::exception& e) {
        start_error_ = detail::error_text(e);
        result_.exit_code = 127;
        result_.root_cause = "rank " + std::to_string(specs_[i].rank) + " could not start: " + start_error_;
        w.out.close();
        w.err.close();
        begin_teardown(SIGTERM);
        break;
      }
    }
  }

  // A worker's end, as its wrapper reported it or as the launcher reaped it: the first failure is
  // the root cause.
  void worker_ended(Worker& w, int status) {
    if (!w.alive) return;
    w.alive = false;
    w.status = status;
    w.release_pipes();
    if (is_preempted(status)) {  // it saved and stopped as asked: not a failure
      // The others are expected to follow at once; those still running a grace period later
      // would wait for it in a collective: they are stopped.
      if (preempt_deadline_ == Clock::time_point::max()) {
        preempt_deadline_ = Clock::now() + seconds(options_.grace_period);
      }
      return;
    }
    // mpirun stops the other ranks once one ends with a status other than 0, the preempted
    // status included: a rank it stopped then is not the cause of anything. The preempted rank's
    // report may still be in the pipe when the launcher reaps the stopped one: it is read first.
    if (carrier_ != nullptr && WIFSIGNALED(status)) {
      read_status();
      if (any_preempted()) return;
    }
    if (status != 0 && !tearing_down_) {
      set_root(w);
      begin_teardown(SIGTERM);
    }
  }

  void read_status() {
    if (status_fd_ < 0) return;
    char buf[4096];
    ssize_t n;
    while ((n = ::read(status_fd_, buf, sizeof(buf))) > 0) status_partial_.append(buf, static_cast<size_t>(n));
    size_t start = 0;
    for (size_t nl; (nl = status_partial_.find('\n', start)) != std::string::npos; start = nl + 1) {
      std::istringstream line(status_partial_.substr(start, nl - start));
      std::string what;
      long rank = -1, value = 0;
      if (!(line >> what >> rank >> value)) continue;
      for (auto& w : workers_) {
        if (w.spec->rank != rank) continue;
        if (what == "start") {
          w.pid = static_cast<pid_t>(value);
          if (tearing_down_) signal_worker(w, killed_hard_ ? SIGKILL : teardown_signal_);
        } else if (what == "exit") {
          worker_ended(w, status_of_code(static_cast<int>(value)));
        }
      }
    }
    status_partial_.erase(0, start);
  }

  void carrier_ended(int status) {
    carrier_proc_.alive = false;
    carrier_proc_.status = status;
    // Every report its workers' wrappers wrote is in the pipe by now. A worker that never
    // reported its start never ran; one that did may outlive mpirun and is stopped like any
    // other (Note [The launcher returns last]).
    read_status();
    bool orphans = false;
    for (auto& w : workers_) {
      if (!w.alive) continue;
      if (w.pid > 0 && !process_gone(w.pid)) {
        orphans = true;
        continue;
      }
      w.alive = false;
      w.status = status == 0 ? 0 : SIGKILL;
      w.release_pipes();
    }
    // mpirun ends with its workers' status: one that stopped as asked is no failure of mpirun's.
    if (status != 0 && root_ == nullptr && !tearing_down_ && !any_preempted()) set_root(carrier_proc_);
    if (status != 0 || orphans) begin_teardown(SIGTERM);
  }

  void reap() {
    while (true) {
      int status = 0;
      pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) return;
      for (auto* pids : {&not_the_jobs_, &named_leftovers_, &termed_leftovers_, &killed_leftovers_}) pids->erase(pid);
      if (carrier_ != nullptr && pid == carrier_proc_.pid && carrier_proc_.alive) {
        carrier_ended(status);
        continue;
      }
      // A worker, or (under mpirun) one whose wrapper died first; other adopted processes of the
      // job are only reaped.
      for (auto& w : workers_) {
        if (w.pid == pid) worker_ended(w, status);
      }
    }
  }

  // A carried worker whose wrapper and mpirun are both gone is watched directly.
  void watch_orphaned_carried_workers() {
    if (carrier_ == nullptr || carrier_proc_.alive) return;
    for (auto& w : workers_) {
      if (w.alive && w.pid > 0 && process_gone(w.pid)) {
        read_status();  // its wrapper's report, when it had one to write
        if (!w.alive) continue;
        w.alive = false;
        w.status = SIGKILL;
        w.release_pipes();
      }
    }
  }

  // What is left of the job once every worker has ended: the launcher's other children, whatever
  // their session or environment (Note [The launcher returns last]), asked to stop, then killed
  // after the grace period. `settled` becomes false while one is a zombie not reaped yet, whose
  // own children may have come to the launcher after the list was read.
  void stop_leftovers(bool& settled) {
    std::vector<pid_t> left;
    settled = true;
    for (pid_t child : own_children()) {
      if (not_the_jobs_.count(child) > 0) continue;
      settled = false;
      if (!process_gone(child)) left.push_back(child);
    }
    if (left.empty()) return;
    if (leftover_deadline_ == Clock::time_point::max()) {
      leftover_deadline_ = Clock::now() + seconds(options_.grace_period);
    }
    const bool hard = killed_hard_ || Clock::now() >= leftover_deadline_;
    const int sig = hard ? SIGKILL : SIGTERM;
    // Each leftover is named once: those adopted after the first notice as "more".
    std::vector<pid_t> fresh, stubborn;
    for (pid_t pid : left) {
      if (named_leftovers_.insert(pid).second) {
        fresh.push_back(pid);
      } else if (hard && termed_leftovers_.count(pid) > 0 && killed_leftovers_.count(pid) == 0) {
        stubborn.push_back(pid);
      }
    }
    if (!options_.quiet && !fresh.empty()) {
      say("sending " + signal_name(sig) + " to " + std::to_string(fresh.size()) + (leftovers_named_ ? " more" : "") +
          " process(es) the workers left behind: " + describe_processes(fresh));
    }
    leftovers_named_ = leftovers_named_ || !fresh.empty();
    if (!stubborn.empty()) {
      say(std::to_string(stubborn.size()) +
          " process(es) the workers left behind still running after SIGTERM; sending SIGKILL");
    }
    for (pid_t pid : left) {
      auto& sent = hard ? killed_leftovers_ : termed_leftovers_;
      if (sent.insert(pid).second) ::kill(pid, sig);
    }
  }

  // Signals to the launcher: the first is forwarded to the workers, a second kills them.
  void read_signals() {
    struct signalfd_siginfo info {};
    while (::read(signal_fd_, &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
      const int sig = static_cast<int>(info.ssi_signo);
      if (sig == SIGCHLD) continue;
      if (std::find(std::begin(kPassedSignals), std::end(kPassedSignals), sig) != std::end(kPassedSignals)) {
        pass_on(sig);
        continue;
      }
      if (interrupt_signal_ != 0) {
        // A second request to stop: no more grace.
        signal_all(SIGKILL);
        killed_hard_ = true;
        continue;
      }
      interrupt_signal_ = sig;
      stopped_at_ = Clock::now();
      if (tearing_down_) {
        // The workers are already being stopped (after a failure, for a regroup or a preemption):
        // the stop lets their grace period run out, as Slurm's KillWait would.
        if (!options_.quiet) say("received " + signal_name(sig) + " while its workers were already stopping");
        continue;
      }
      const auto alive = alive_workers();
      if (!options_.quiet) {
        say("received " + signal_name(sig) + ", forwarding it to " + std::to_string(alive) + " worker(s)");
      }
      begin_teardown(sig);
    }
  }

  // Whether a running worker waits for a held signal.
  bool any_held() const {
    return std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return w.alive && !w.held.empty(); });
  }

  // The held signals, to the workers that handle them now.
  void pass_on_held() {
    if (!any_held()) return;
    for (int sig : kPassedSignals) {
      long passed = 0;
      for (auto& w : workers_) {
        auto it = std::find(w.held.begin(), w.held.end(), sig);
        if (it == w.held.end() || !w.alive || w.pid <= 0 || !group_handles(w.pid, sig)) continue;
        w.held.erase(it);
        signal_worker(w, sig);
        ++passed;
      }
      if (passed > 0 && !options_.quiet) {
        say("passing the " + signal_name(sig) + " it held on to " + std::to_string(passed) +
            " worker(s), which handle it now");
      }
    }
  }

  // Held signals that no worker took: said plainly, even when quiet, since the request was lost.
  void describe_held() const {
    for (int sig : kPassedSignals) {
      std::string ranks;
      long count = 0;
      for (const auto& w : workers_) {
        if (std::find(w.held.begin(), w.held.end(), sig) == w.held.end()) continue;
        ranks += (count++ == 0 ? "" : ", ") + std::to_string(w.spec->rank);
      }
      if (count == 0) continue;
      say(signal_name(sig) + " was not passed on to " + std::to_string(count) + " worker(s) (rank " + ranks +
          "): they ended without ever handling it, and the launcher held it rather than kill them with it");
    }
  }

  // The grace period after a teardown's SIGTERM is over: SIGKILL. Or the one after a worker
  // ended preempted while others still run: they are stopped.
  void enforce_kill_deadline() {
    if (!tearing_down_ && Clock::now() >= preempt_deadline_) {
      const auto alive = alive_workers();
      if (alive > 0) {
        say(std::to_string(alive) + " worker(s) still running " + seconds_text(options_.grace_period) +
            " after another saved its state and stopped; stopping them");
        begin_teardown(SIGTERM);
      }
    }
    if (!tearing_down_ || killed_hard_ || Clock::now() < kill_deadline_) return;
    const auto alive = alive_workers();
    if (alive > 0) {
      say(std::to_string(alive) + " worker(s) still running " + seconds_text(options_.grace_period) + " after " +
          signal_name(teardown_signal_) + "; sending SIGKILL");
    }
    if (alive > 0 || carrier_proc_.alive) signal_all(SIGKILL);
    killed_hard_ = true;
  }

  // One wait for output, a signal or a death, and what follows from it.
  void poll_once(bool any_alive, bool settled) {
    std::vector<struct pollfd> fds;
    std::vector<Stream*> streams;
    fds.push_back({signal_fd_, POLLIN, 0});
    fds.push_back({status_fd_, POLLIN, 0});  // ignored by poll while -1
    for (Worker* wp : everyone_) {
      Worker& w = *wp;
      for (Stream* s : {&w.out, &w.err}) {
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
        }
      }
    }
    auto timeout = std::chrono::duration<double>(options_.monitor_interval);
    if (tearing_down_ && !killed_hard_) {
      timeout = std::min<std::chrono::duration<double>>(timeout, kill_deadline_ - Clock::now());
    }
    if (!any_alive) timeout = std::min<std::chrono::duration<double>>(timeout, std::chrono::milliseconds(200));
    if (!settled) timeout = std::min<std::chrono::duration<double>>(timeout, std::chrono::milliseconds(10));
    if (any_held()) timeout = std::min<std::chrono::duration<double>>(timeout, std::chrono::milliseconds(50));
    const int timeout_ms = std::max(0, static_cast<int>(std::ceil(timeout.count() * 1000)));
    int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR)
      detail::raise_error(detail::concat("[launch] poll failed: ", std::strerror(errno)));

    if (ready > 0 && (fds[0].revents & POLLIN) != 0) read_signals();
    // Deaths the launcher reaps itself come first: a worker it reaps died before its wrapper
    // could report it, so before the ranks mpirun stopped because of it.
    reap();
    if ((fds[1].revents & POLLIN) != 0) read_status();
    for (size_t i = 2; i < fds.size(); ++i) {
      if ((fds[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      Stream* s = streams[i - 2];
      if (!s->pump()) {
        ::close(s->fd);
        s->fd = -1;
      }
    }
    reap();
    pass_on_held();
    enforce_kill_deadline();
    ask_regroup(any_alive);
    // Streams held open by a process outside our groups must not keep us waiting forever.
    if (!any_alive) {
      for (Worker* w : everyone_) {
        for (Stream* s : {&w->out, &w->err}) {
          if (s->fd >= 0 && !(ready > 0)) {
            s->flush();
            ::close(s->fd);
            s->fd = -1;
          }
        }
      }
    }
  }

  // Note [Elastic membership]: the group is stopped, without blame, to be formed again.
  void ask_regroup(bool any_alive) {
    if (!options_.regroup || !any_alive || tearing_down_ || Clock::now() < next_regroup_check_) return;
    next_regroup_check_ = Clock::now() + std::chrono::milliseconds(500);
    if (!options_.regroup()) return;
    result_.regrouped = true;
    begin_teardown(SIGTERM);
  }

  long alive_workers() const {
    return std::count_if(workers_.begin(), workers_.end(), [](const Worker& w) { return w.alive; });
  }

  bool any_preempted() const {
    return std::any_of(workers_.begin(), workers_.end(), [](const Worker& w) { return !w.alive && is_preempted(w.status); });
  }

  // Workers that ended with the preempted status, and none that failed: the job stopped as asked.
  void describe_preemption() {
    const auto saved = std::count_if(workers_.begin(), workers_.end(), [](const Worker& w) {
      return w.pid > 0 && !w.alive && is_preempted(w.status);
    });
    if (saved == 0) return;
    result_.preempted = true;
    result_.exit_code = detail::kPreemptedExitStatus;
    result_.root_cause = "the job was preempted: " + std::to_string(saved) + " of " +
                         std::to_string(workers_.size()) + " worker(s) saved the state and ended with exit status " +
                         std::to_string(detail::kPreemptedExitStatus) + "; launch it again to resume";
    say(result_.root_cause);
  }

  void describe_root_cause() {
    std::ostringstream msg;
    if (root_ == &carrier_proc_) {
      msg << carrier_->name << " (pid " << root_->pid << ") " << describe_status(root_->status);
    } else {
      msg << "rank " << root_->spec->rank << " (local rank " << root_->spec->local_rank << ", pid " << root_->pid
          << ") " << describe_status(root_->status);
    }
    // Note [A machine that ssh cannot reach]: only mpirun's own output is read for ssh's lines.
    std::string error = root_ == &carrier_proc_ ? ssh_failure(root_->err.tail) : std::string();
    if (error.empty()) error = last_error(root_->spec->error_file, root_->err.tail);
    if (!error.empty()) msg << "\n  error: " << error;
    result_.root_cause = msg.str();
    result_.exit_code = exit_code_of(root_->status);
    say((root_ == &carrier_proc_ ? "" : "worker ") + result_.root_cause);
    const auto others = std::count_if(workers_.begin(), workers_.end(),
                                      [&](const Worker& w) { return &w != root_ && w.pid > 0 && w.status != 0; });
    if (others > 0) say("stopped the other " + std::to_string(others) + " worker(s) of the group");
  }

  const std::vector<WorkerSpec>& specs_;
  const SuperviseOptions& options_;
  const CarrierSpec* carrier_;
  const int signal_fd_;
  AttemptResult result_;
  std::set<pid_t> not_the_jobs_;
  std::vector<Worker> workers_;
  std::vector<Worker*> everyone_;  // the workers, and the carrier when there is one
  fs::path attempt_dir_;
  std::string start_error_;

  int interrupt_signal_;
  bool tearing_down_ = false;
  int teardown_signal_ = SIGTERM;  // what the workers were asked to stop with
  Clock::time_point kill_deadline_ = Clock::time_point::max();
  Clock::time_point preempt_deadline_ = Clock::time_point::max();  // see worker_ended
  bool killed_hard_ = false;
  Clock::time_point next_regroup_check_ = Clock::time_point::min();
  const Worker* root_ = nullptr;  // the root cause of a failure
  Clock::time_point failed_at_;   // when root_ ended
  Clock::time_point stopped_at_;  // when the launcher was first asked to stop

  Worker carrier_proc_;
  WorkerSpec carrier_spec_;
  int status_fd_ = -1;
  int status_keep_ = -1;
  std::string status_partial_;

  // Leftovers already named or signalled are not again. A pid leaves these sets once reaped.
  std::set<pid_t> named_leftovers_, termed_leftovers_, killed_leftovers_;
  Clock::time_point leftover_deadline_ = Clock::time_point::max();
  bool leftovers_named_ = false;
};

}  // namespace

AttemptResult run_attempt(const std::vector<WorkerSpec>& specs, const SuperviseOptions& options,
                          const CarrierSpec* carrier, int signal_fd, int stop_signal, std::vector<int>& passed) {
  Attempt attempt(specs, options, carrier, signal_fd, stop_signal);
  attempt.start();
  // Note [Signals the workers cannot take yet]: those that came between attempts, for these workers.
  for (int sig : passed) attempt.pass_on(sig);
  passed.clear();
  attempt.watch();
  return attempt.finish();
}

}  // namespace accelerate::detail::launch
