// A test bed of hosts on one machine: network namespaces, each with its own loopback and one
// address on a veth pair that joins them, made and removed by the tests themselves. Processes
// run in a host through `ip netns exec`; a host can be killed (every process in it) or cut off
// (its link down). Making namespaces needs CAP_SYS_ADMIN and CAP_NET_ADMIN; without them the
// bed says why, and the tests skip with that reason.
#pragma once

#include "accelerate/utils/safetensors.h"

#include <ATen/ATen.h>

#include "support/process.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace accelerate::testing {

/// Two hosts, 10.200.0.1 and 10.200.0.2, joined by a veth pair.
class HostPair {
 public:
  HostPair() {
    const std::string tag = std::to_string(::getpid());
    for (int i = 0; i < 2; ++i) names_.push_back("acc" + tag + "h" + std::to_string(i));
    for (const auto& name : names_) {
      if (!ip({"netns", "add", name})) return;
      created_.push_back(name);
    }
    const std::string link0 = "acc" + tag + "v0", link1 = "acc" + tag + "v1";
    if (!ip({"link", "add", link0, "netns", names_[0], "type", "veth", "peer", "name", link1, "netns", names_[1]})) {
      return;
    }
    links_ = {link0, link1};
    for (int i = 0; i < 2; ++i) {
      if (!ip({"-n", names_[i], "link", "set", "lo", "up"}) ||
          !ip({"-n", names_[i], "addr", "add", address(i) + "/24", "dev", links_[i]}) ||
          !ip({"-n", names_[i], "link", "set", links_[i], "up"})) {
        return;
      }
    }
    // Each host resolves both hosts' names (`ip netns exec` puts /etc/netns/<name>/hosts over
    // /etc/hosts), as a cluster's machines resolve each other's: Slurm's node lists name hosts.
    for (const auto& name : created_) {
      std::filesystem::create_directories("/etc/netns/" + name);
      std::ofstream hosts("/etc/netns/" + name + "/hosts");
      hosts << "127.0.0.1 localhost\n";
      for (int i = 0; i < 2; ++i) hosts << address(i) << " " << names_[i] << "\n";
    }
    ready_ = links_running();
  }
  ~HostPair() {
    for (size_t i = 0; i < created_.size(); ++i) kill_host(static_cast<int>(i));
    for (const auto& name : created_) {
      ip({"netns", "del", name});
      std::error_code ignored;
      std::filesystem::remove_all("/etc/netns/" + name, ignored);
    }
  }
  HostPair(const HostPair&) = delete;
  HostPair& operator=(const HostPair&) = delete;

  /// Empty when the bed is up; else why not (the first command that failed and its output).
  const std::string& unavailable() const { return why_; }
  bool ready() const { return ready_; }

  static std::string address(int host) { return "10.200.0." + std::to_string(host + 1); }
  const std::string& name(int host) const { return names_.at(host); }

  /// `argv` run inside `host`.
  std::vector<std::string> in(int host, const std::vector<std::string>& argv) const {
    std::vector<std::string> out = {"ip", "netns", "exec", names_.at(host)};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }

  /// `argv` run inside `host` as a daemon of that machine runs: with the host's name, a /dev/shm
  /// of its own and, when `private_dir` is not empty, a folder of the host's own at that path
  /// (`private_dir-<host name>`, kept from start to start, as a machine's disk is), none of the
  /// other host's files. What the daemon starts (a login's shell, a job's processes) inherits
  /// them.
  std::vector<std::string> as_machine(int host, const std::string& private_dir,
                                      const std::vector<std::string>& argv) const {
    std::vector<std::string> out = in(host, {"unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c",
                                             "hostname \"$0\" && if [ -n \"$1\" ]; then mkdir -p \"$1\" \"$1-$0\" && "
                                             "mount --bind \"$1-$0\" \"$1\"; fi && mount -t tmpfs tmpfs /dev/shm && "
                                             "shift && exec \"$@\"",
                                             names_.at(host), private_dir});
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }

  /// The pids of every process in `host`.
  std::vector<pid_t> pids(int host) const {
    auto r = run({"ip", "netns", "pids", names_.at(host)}, 10);
    std::istringstream in(r->out);
    std::vector<pid_t> out;
    for (long pid; in >> pid;) out.push_back(static_cast<pid_t>(pid));
    return out;
  }

  /// Kills every process in `host` with SIGKILL, as a power cut would.
  void kill_host(int host) const {
    for (pid_t pid : pids(host)) ::kill(pid, SIGKILL);
  }

  /// The name of `host`'s end of the link, in that host.
  const std::string& link(int host) const { return links_.at(host); }

  /// Limits the link to `mbit` Mbit/s in each direction (a token bucket on each end: `tc qdisc
  /// … tbf`), as a machine's network card limits what it sends. The bucket holds 4 ms at that
  /// rate (at least 64 KiB), so a step's seconds see the rate and no burst beyond it. False, with
  /// the reason in `unavailable()`, where the kernel or iproute2 cannot shape.
  bool shape(int64_t mbit) const {
    const int64_t burst = std::max<int64_t>(65536, mbit * 1000000 / 8 / 250);
    for (int i = 0; i < 2; ++i) {
      auto r = run({"ip", "netns", "exec", names_.at(i), "tc", "qdisc", "replace", "dev", links_.at(i), "root", "tbf",
                    "rate", std::to_string(mbit) + "mbit", "burst", std::to_string(burst), "latency", "100ms"},
                   10);
      if (r->exit_code() != 0) {
        if (why_.empty()) why_ = "cannot shape the test bed's link (tc qdisc tbf): " + r->out + r->err;
        return false;
      }
    }
    return true;
  }

  /// Takes `host`'s link down: its packets no longer reach the other host, nor the other's it.
  bool cut_link(int host) const { return ip({"-n", names_.at(host), "link", "set", links_.at(host), "down"}); }
  /// Brings a cut link up again.
  bool restore_link(int host) const { return ip({"-n", names_.at(host), "link", "set", links_.at(host), "up"}); }

 private:
  // Waits until both ends of the link report a carrier (operational state UP), as a machine's
  // network is before a job starts. The kernel sets it a moment after `link set up`, and Open
  // MPI 6 leaves out an interface without it ("administratively up but no carrier"), after which
  // its processes cannot reach each other.
  bool links_running() const {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (int i = 0; i < 2; ++i) {
      while (true) {
        auto r = run({"ip", "-n", names_[i], "-o", "link", "show", "dev", links_[i]}, 10);
        if (r->exit_code() == 0 && r->out.find("state UP") != std::string::npos) break;
        if (std::chrono::steady_clock::now() > deadline) {
          why_ = "cannot make the hosts of the test bed: " + links_[i] + " has no carrier 10 s after it was set up: " +
                 r->out + r->err;
          return false;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    return true;
  }

  bool ip(const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {"ip"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto r = run(argv, 10);
    if (r->exit_code() == 0) return true;
    if (why_.empty()) {
      std::string command;
      for (const auto& a : argv) command += (command.empty() ? "" : " ") + a;
      why_ = "cannot make the hosts of the test bed: `" + command + "` failed: " + r->err;
    }
    return false;
  }

  std::vector<std::string> names_;
  std::vector<std::string> created_;
  std::vector<std::string> links_;
  mutable std::string why_;  // the first failure, kept by the const helpers too
  bool ready_ = false;
};

/// Skips the test, with the reason, when the bed could not be made.
#define ACCELERATE_REQUIRE_HOSTS(bed) \
  if (!(bed).ready()) GTEST_SKIP() << (bed).unavailable()

/// Expects `<dir>/resumed.<rank>.safetensors` to hold exactly `<dir>/full.<rank>.safetensors` for
/// each of the job's `processes` (the multi-host checkpoint tests' verdict).
inline void expect_resumed_like_full(const std::string& dir, int processes) {
  for (int rank = 0; rank < processes; ++rank) {
    SCOPED_TRACE("process " + std::to_string(rank));
    const auto suffix = "." + std::to_string(rank) + ".safetensors";
    SafetensorsFile full(dir + "/full" + suffix);
    SafetensorsFile resumed(dir + "/resumed" + suffix);
    ASSERT_EQ(full.keys(), resumed.keys());
    for (const auto& key : full.keys()) EXPECT_TRUE(at::equal(full.get_tensor(key), resumed.get_tensor(key))) << key;
  }
}

}  // namespace accelerate::testing
