// Real cluster software on the hosts of the test bed (tests/support/hosts.h), from Debian's
// packages, started and stopped by the tests themselves:
// - `SshServers`: an OpenSSH server per host, with host and login keys the test makes, and the
//   client configuration that trusts exactly those host keys;
// - `SlurmCluster`: a munge daemon, slurmctld on the first host and one slurmd per host, every
//   Slurm command run from the first host (the cluster's login node).
// Each daemon runs as its host's machine would (`HostPair::as_machine`): the host's name, its own
// /dev/shm and, when asked, a folder of its own at a path every host uses. A bed that cannot start
// says why (the package that is missing, or the daemon's last lines), and the tests fail with it
// (or skip, when the packages are not installed).
#pragma once

#include "support/hosts.h"
#include "support/process.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace accelerate::testing {

namespace cluster_detail {

inline bool installed(const std::string& program) { return std::filesystem::exists(program); }

// The last `lines` lines of a file (a daemon's log), for the reason a bed did not start.
inline std::string tail_of(const std::string& path, size_t lines = 15) {
  std::ifstream in(path);
  std::vector<std::string> all;
  for (std::string line; std::getline(in, line);) all.push_back(line);
  std::string out;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) out += all[i] + "\n";
  return out;
}

// Stops daemons: SIGTERM, then what is left is killed with their process groups (~Running).
inline void stop_all(std::vector<std::unique_ptr<Running>>& daemons) {
  for (auto& d : daemons) d->signal(SIGTERM);
  for (auto& d : daemons) wait_gone(d->pid(), 5);
  daemons.clear();
}

}  // namespace cluster_detail

/// An OpenSSH server on each host of `hosts`, listening on port 22 of the host's address.
class SshServers {
 public:
  /// Keys and configurations go to `dir`; each server's host gets its own folder at
  /// `private_dir` when that is not empty (HostPair::as_machine).
  SshServers(const HostPair& hosts, const std::string& dir, const std::string& private_dir = "")
      : hosts_(hosts), dir_(dir + "/ssh") {
    if (!hosts.ready()) {
      why_ = hosts.unavailable();
      not_installed_ = true;
      return;
    }
    if (!cluster_detail::installed("/usr/sbin/sshd") || !cluster_detail::installed("/usr/bin/ssh")) {
      why_ = "OpenSSH is not installed (openssh-server, openssh-client; scripts/setup.sh installs them)";
      not_installed_ = true;
      return;
    }
    std::filesystem::create_directories(dir_);
    std::filesystem::create_directories("/run/sshd");  // sshd's privilege separation folder
    for (const char* key : {"host_key", "other_host_key", "login_key"}) {
      auto r = run({"ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", key, "-f", dir_ + "/" + key}, 30);
      if (r->exit_code() != 0) {
        why_ = "ssh-keygen failed: " + r->err;
        return;
      }
    }
    std::filesystem::copy_file(dir_ + "/login_key.pub", dir_ + "/authorized_keys");
    std::ofstream(dir_ + "/sshd_config") << "ListenAddress 0.0.0.0\n"
                                         << "HostKey " << dir_ << "/host_key\n"
                                         << "PidFile none\n"
                                         << "AuthorizedKeysFile " << dir_ << "/authorized_keys\n"
                                         << "StrictModes no\n"
                                         << "PermitRootLogin prohibit-password\n"
                                         << "PasswordAuthentication no\n"
                                         << "KbdInteractiveAuthentication no\n"
                                         << "UsePAM no\n"
                                         << "PrintMotd no\n";
    write_known_hosts(dir_ + "/known_hosts", dir_ + "/host_key.pub");
    write_known_hosts(dir_ + "/wrong_known_hosts", dir_ + "/other_host_key.pub");
    client_config_ = write_client_config("client_config", dir_ + "/known_hosts");
    for (int host = 0; host < 2; ++host) {
      daemons_.push_back(std::make_unique<Running>(
          hosts.as_machine(host, private_dir, {"/usr/sbin/sshd", "-D", "-e", "-f", dir_ + "/sshd_config"})));
    }
    // Up when a login from the first host to each host works.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    for (int host = 0; host < 2; ++host) {
      while (true) {
        auto r = run(hosts.in(0, {"ssh", "-F", client_config_, HostPair::address(host), "true"}), 20);
        if (r->exit_code() == 0) break;
        if (std::chrono::steady_clock::now() > deadline) {
          why_ = "the ssh server of host " + std::to_string(host) + " accepts no login: " + r->err;
          daemons_[host]->signal(SIGTERM);
          daemons_[host]->wait(10);
          why_ += "sshd said: " + daemons_[host]->err;
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    ready_ = true;
  }
  ~SshServers() { cluster_detail::stop_all(daemons_); }
  SshServers(const SshServers&) = delete;
  SshServers& operator=(const SshServers&) = delete;

  bool ready() const { return ready_; }
  bool not_installed() const { return not_installed_; }
  const std::string& unavailable() const { return why_; }

  /// The ssh command that logs in to the hosts with the test's key, trusting their host keys.
  std::string agent() const { return "ssh -F " + client_config_; }
  /// The same, but with a known_hosts file that holds another key for every host.
  std::string agent_with_wrong_host_keys() const {
    return "ssh -F " + write_client_config("wrong_client_config", dir_ + "/wrong_known_hosts");
  }
  /// The same, but logging in with a key the servers do not accept.
  std::string agent_with_unknown_login_key() const {
    return "ssh -F " + write_client_config("unknown_login_config", dir_ + "/known_hosts", "other_host_key");
  }

 private:
  void write_known_hosts(const std::string& path, const std::string& public_key) const {
    std::ifstream in(public_key);
    std::string key;
    std::getline(in, key);
    std::ofstream out(path);
    for (int host = 0; host < 2; ++host) {
      out << HostPair::address(host) << " " << key << "\n" << hosts_.name(host) << " " << key << "\n";
    }
  }
  std::string write_client_config(const std::string& name, const std::string& known_hosts,
                                  const std::string& identity = "login_key") const {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << "Host *\n"
                        << "  IdentityFile " << dir_ << "/" << identity << "\n"
                        << "  IdentitiesOnly yes\n"
                        << "  UserKnownHostsFile " << known_hosts << "\n"
                        << "  GlobalKnownHostsFile /dev/null\n"
                        << "  StrictHostKeyChecking yes\n"
                        << "  BatchMode yes\n"
                        << "  User root\n"
                        << "  ConnectTimeout 10\n"
                        << "  LogLevel ERROR\n";
    return path;
  }

  const HostPair& hosts_;
  std::string dir_;
  std::string client_config_;
  std::vector<std::unique_ptr<Running>> daemons_;
  std::string why_;
  bool ready_ = false;
  bool not_installed_ = false;
};

/// A Slurm cluster of the two hosts, each a node of 2 CPUs named as its host, in one partition.
class SlurmCluster {
 public:
  /// Configuration, state and logs go to `dir`; each slurmd's host gets its own folder at
  /// `private_dir` when that is not empty (HostPair::as_machine), as do the job steps it starts.
  SlurmCluster(const HostPair& hosts, const std::string& dir, const std::string& private_dir = "")
      : hosts_(hosts), dir_(dir + "/slurm") {
    if (!hosts.ready()) {
      why_ = hosts.unavailable();
      not_installed_ = true;
      return;
    }
    for (const char* program : {"/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/bin/srun", "/usr/sbin/munged"}) {
      if (!cluster_detail::installed(program)) {
        why_ = std::string(program) + " is not installed (slurm-wlm, munge; scripts/setup.sh installs them)";
        not_installed_ = true;
        return;
      }
    }
    // One Slurm cluster at a time on this machine: two tests' clusters side by side (ctest -j2)
    // slowed each other's job steps from 5 s to 20-80 s under Slurm 24.11. The lock is held from
    // before the daemons start until after they stopped; the daemons do not inherit it.
    lock_fd_ = ::open("/tmp/accelerate-tests-slurm-cluster.lock", O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    if (lock_fd_ >= 0) {
      while (::flock(lock_fd_, LOCK_EX) != 0 && errno == EINTR) {
      }
    }
    for (const char* sub : {"munge", "state", "spool", "log"}) std::filesystem::create_directories(dir_ + "/" + sub);
    // munge: a key of the test's own, one daemon whose socket (a file) every host reaches.
    const std::string munge = dir_ + "/munge";
    {
      std::ifstream random("/dev/urandom", std::ios::binary);
      std::string key(1024, '\0');
      random.read(key.data(), static_cast<std::streamsize>(key.size()));
      std::ofstream(munge + "/key", std::ios::binary) << key;
      ::chmod((munge + "/key").c_str(), 0400);
    }
    // --force: the test's folder is not open to every user, which munged would otherwise refuse.
    daemons_.push_back(std::make_unique<Running>(std::vector<std::string>{
        "/usr/sbin/munged", "--foreground", "--force", "--socket=" + munge + "/socket", "--key-file=" + munge + "/key",
        "--log-file=" + munge + "/log", "--pid-file=" + munge + "/pid", "--seed-file=" + munge + "/seed"}));
    std::ofstream(dir_ + "/cgroup.conf") << "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\nIgnoreSystemd=yes\n";
    std::ofstream conf(dir_ + "/slurm.conf");
    conf << "ClusterName=acc" << ::getpid() << "\n"
         << "SlurmctldHost=" << hosts.name(0) << "(" << HostPair::address(0) << ")\n"
         << "SlurmUser=root\nSlurmdUser=root\n"
         << "AuthType=auth/munge\nCredType=cred/munge\n"
         // cred_expire: a requeued job waits this long (plus 1 s) before it may start again.
         << "AuthInfo=socket=" << munge << "/socket,cred_expire=5\n"
         << "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nMpiDefault=none\n"
         << "ReturnToService=2\n"
         << "SchedulerType=sched/builtin\nSchedulerParameters=sched_interval=2\n"
         << "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
         << "StateSaveLocation=" << dir_ << "/state\n"
         << "SlurmdSpoolDir=" << dir_ << "/spool/%n\n"
         << "SlurmctldPidFile=" << dir_ << "/slurmctld.pid\n"
         << "SlurmdPidFile=" << dir_ << "/slurmd-%n.pid\n"
         << "SlurmctldLogFile=" << dir_ << "/log/slurmctld.log\n"
         << "SlurmdLogFile=" << dir_ << "/log/slurmd-%n.log\n"
         << "JobCompType=jobcomp/none\nAccountingStorageType=accounting_storage/none\n"
         << "KillWait=5\n";
    for (int host = 0; host < 2; ++host) {
      conf << "NodeName=" << hosts.name(host) << " NodeAddr=" << HostPair::address(host) << " CPUs=2 State=UNKNOWN\n";
    }
    conf << "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n";
    conf.close();
    const std::string munge_log = munge + "/log";
    if (!wait_for_file(munge + "/socket")) {
      why_ = "munged did not start:\n" + cluster_detail::tail_of(munge_log);
      return;
    }
    daemons_.push_back(std::make_unique<Running>(hosts.as_machine(0, "", {"/usr/sbin/slurmctld", "-D", "-i"}), env()));
    for (int host = 0; host < 2; ++host) {
      daemons_.push_back(std::make_unique<Running>(
          hosts.as_machine(host, private_dir, {"/usr/sbin/slurmd", "-D", "-N", hosts.name(host)}), env()));
    }
    // Up when both nodes are idle.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (true) {
      auto r = command({"sinfo", "--noheader", "--Node", "--format=%T"}, 10);
      if (r->exit_code() == 0 && r->out == "idle\nidle\n") break;
      if (std::chrono::steady_clock::now() > deadline) {
        why_ = "the Slurm nodes are not idle 30 s after the daemons started: sinfo: " + r->out + r->err +
               "\nslurmctld's log:\n" + cluster_detail::tail_of(dir_ + "/log/slurmctld.log") + "slurmd's log:\n" +
               cluster_detail::tail_of(dir_ + "/log/slurmd-" + hosts.name(1) + ".log");
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ready_ = true;
  }
  ~SlurmCluster() {
    if (ready_) command({"scancel", "--full", "--user=root"}, 10);
    cluster_detail::stop_all(daemons_);
    if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the lock
  }
  SlurmCluster(const SlurmCluster&) = delete;
  SlurmCluster& operator=(const SlurmCluster&) = delete;

  bool ready() const { return ready_; }
  bool not_installed() const { return not_installed_; }
  const std::string& unavailable() const { return why_; }

  /// The environment Slurm's commands need (the cluster's configuration file).
  std::map<std::string, std::string> env(std::map<std::string, std::string> more = {}) const {
    more["SLURM_CONF"] = dir_ + "/slurm.conf";
    return more;
  }
  /// `argv` (srun, sbatch, squeue...) on the login node, the first host, with `extra` in its
  /// environment; started, not waited for.
  std::unique_ptr<Running> start(const std::vector<std::string>& argv,
                                 const std::map<std::string, std::string>& extra = {}) const {
    return std::make_unique<Running>(hosts_.in(0, argv), env(extra));
  }
  /// `argv` on the login node, waited for up to `seconds`.
  std::unique_ptr<Running> command(const std::vector<std::string>& argv, double seconds,
                                   const std::map<std::string, std::string>& extra = {}) const {
    auto r = start(argv, extra);
    r->wait(seconds);
    return r;
  }
  /// The state of job `id` as squeue shows it ("" once the job left the queue).
  std::string job_state(const std::string& id) const {
    auto r = command({"squeue", "--noheader", "--jobs=" + id, "--format=%T"}, 10);
    std::string state = r->out;
    while (!state.empty() && (state.back() == '\n' || state.back() == ' ')) state.pop_back();
    return state;
  }
  /// The daemons' last log lines, for a failing test's message.
  std::string logs() const {
    return "slurmctld:\n" + cluster_detail::tail_of(dir_ + "/log/slurmctld.log") + "slurmd of " + hosts_.name(0) +
           ":\n" + cluster_detail::tail_of(dir_ + "/log/slurmd-" + hosts_.name(0) + ".log") + "slurmd of " +
           hosts_.name(1) + ":\n" + cluster_detail::tail_of(dir_ + "/log/slurmd-" + hosts_.name(1) + ".log");
  }

 private:
  static bool wait_for_file(const std::string& path) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!std::filesystem::exists(path)) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return true;
  }

  const HostPair& hosts_;
  std::string dir_;
  std::vector<std::unique_ptr<Running>> daemons_;
  std::string why_;
  bool ready_ = false;
  bool not_installed_ = false;
  int lock_fd_ = -1;  // the machine's one-cluster-at-a-time lock, held while this cluster lives
};

/// Skips the test when the daemons' packages are not installed (scripts/setup.sh installs them);
/// fails it, with the reason, when they are but did not start.
#define ACCELERATE_REQUIRE_DAEMONS(daemons)                                     \
  if ((daemons).not_installed()) GTEST_SKIP() << (daemons).unavailable();     \
  if (!(daemons).ready()) FAIL() << (daemons).unavailable()

}  // namespace accelerate::testing
