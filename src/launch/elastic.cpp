// Elastic membership; see elastic.h.
#include "launch/elastic.h"

#include "detail/check.h"
#include "detail/store_connection.h"

#include <chrono>
#include <iostream>
#include <memory>
#include <thread>

namespace accelerate::commands {
namespace {

namespace fs = std::filesystem;
namespace proto = detail::store_protocol;
using Clock = std::chrono::steady_clock;

// Note [Elastic membership]
// An elastic job (--nnodes MIN:MAX --rdzv_backend c10d) forms its group in rounds of a rendezvous
// held in the store that the launcher of the machine with --main_process_ip's address serves (the
// host; as with torchrun's c10d rendezvous, the job ends if that machine is lost).
// - The host opens round R by publishing R under kRoundKey, and joins it first, as machine 0.
// - Every other launcher waits for a round later than the last one it ran that is still open,
//   joins it by adding 1 to the round's count, and takes the count as its machine rank.
// - The host closes the round once MAX machines have joined, or once MIN have and no other came
//   for rdzv_conf's last_call_timeout; past --rdzv_timeout without MIN, the job ends, saying so.
//   The number of members is published under the round's "members" key. A launcher whose rank is
//   past it came too late, and waits for the next round.
// - Each member then runs its workers as machine `rank` of `members` machines: the world size is
//   members x processes per machine, and the workers meet under the keys of attempt R.
// - A member whose workers fail (a lost machine makes the others' collectives fail) goes on to
//   the next round, within --max_restarts failures; the host opens it. The machines that remain
//   form the group again, smaller.
// - A launcher that waits while a round runs adds 1 to kWaitingKey. The host, whose group is
//   smaller than MAX, then sets the round's "regroup" key and every member stops its workers
//   (without blame; it does not count against --max_restarts) and joins the next round, with the
//   one that waited: the group grows again.
// The program resumes each round from its newest complete checkpoint: the sharded state and the
// data loader's position are resharded to the new world size, and the user's accumulation steps
// keep the global batch.
constexpr const char* kRoundKey = "accelerate/elastic/round";
constexpr const char* kWaitingKey = "accelerate/elastic/waiting";

std::string round_key(int round, const char* what) {
  return "accelerate/elastic/round" + std::to_string(round) + "/" + what;
}

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
}

// The rendezvous store, as seen by one launcher.
class Rendezvous {
 public:
  Rendezvous(const LaunchPlan& plan, int port) : plan_(plan), port_(port) {}

  // Connects, retrying until --rdzv_timeout (the host may start later than this machine).
  void connect() {
    const auto deadline = Clock::now() + millis(plan_.rdzv_timeout);
    std::string failure;
    while (true) {
      try {
        store_ = std::make_unique<detail::StoreConnection>(plan_.main_process_ip, port_, plan_.rdzv_secret,
                                                           std::chrono::seconds(5));
        return;
      } catch (const std::exception& e) {
        failure = detail::error_text(e);
      }
      if (Clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    detail::raise_error(detail::concat("[launch] could not reach the elastic job's rendezvous at ",
                                       plan_.main_process_ip, ":", port_, " within --rdzv_timeout (",
                                       plan_.rdzv_timeout, "s): ", failure));
  }

  int add(const std::string& key, int delta) {
    auto reply = ask(proto::Op::kAdd, {key, std::to_string(delta)});
    return reply.size() == 1 ? std::stoi(reply[0]) : 0;
  }
  void set(const std::string& key, const std::string& value) { ask(proto::Op::kSet, {key, value}); }
  bool has(const std::string& key) {
    auto reply = ask(proto::Op::kCheck, {key});
    return reply.size() == 1 && reply[0] == "1";
  }
  int get_int(const std::string& key) {
    if (!has(key)) return -1;
    auto reply = ask(proto::Op::kGet, {key});
    return reply.size() == 1 ? std::stoi(reply[0]) : -1;
  }

 private:
  std::vector<std::string> ask(proto::Op op, const std::vector<std::string>& args) {
    try {
      return store_->request(op, args, std::chrono::seconds(10));
    } catch (const std::exception& e) {
      detail::raise_error(detail::concat("[launch] the elastic job's rendezvous store at ", plan_.main_process_ip,
                                         ":", port_, " stopped answering (the job ended, or the machine serving it "
                                         "was lost): ",
                                         detail::error_text(e)));
    }
  }

  const LaunchPlan& plan_;
  const int port_;
  std::unique_ptr<detail::StoreConnection> store_;
};

void say(const LaunchPlan& plan, const std::string& line) {
  if (!plan.quiet) std::cerr << "accelerate launch: " << line << std::endl;
}

// The host: opens round `round`, joins it as machine 0 and closes it; returns the members.
int hold_round(const LaunchPlan& plan, Rendezvous& rdzv, int round) {
  rdzv.set(kRoundKey, std::to_string(round));
  rdzv.add(round_key(round, "joined"), 1);
  const auto deadline = Clock::now() + millis(plan.rdzv_timeout);
  auto enough_since = Clock::time_point::max();
  int joined = 1;
  while (true) {
    joined = rdzv.add(round_key(round, "joined"), 0);
    if (joined >= plan.num_machines) break;
    if (joined >= plan.min_machines) {
      if (enough_since == Clock::time_point::max()) enough_since = Clock::now();
      if (Clock::now() - enough_since >= millis(plan.last_call_timeout)) break;
    } else if (Clock::now() > deadline) {
      detail::raise_error(detail::concat(
          "[launch] the elastic job needs at least ", plan.min_machines, " machine(s) (--nnodes ", plan.min_machines,
          ":", plan.num_machines, "), but only ", joined, " joined the rendezvous at ", plan.main_process_ip,
          " within --rdzv_timeout (", plan.rdzv_timeout, "s)"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const int members = std::min(joined, plan.num_machines);
  rdzv.set(round_key(round, "members"), std::to_string(members));
  return members;
}

// A member whose workers succeeded says so; machine 0 keeps serving the store until every member
// has (or a grace period has passed), since the others' workers may still be finishing.
void finish_round(const LaunchPlan& plan, Rendezvous& rdzv, int round, int members, bool serves_store) {
  try {
    const int done = rdzv.add(round_key(round, "done"), 1);
    if (!serves_store) return;
    const auto deadline = Clock::now() + millis(std::max(30.0, plan.grace_period));
    for (int seen = done; seen < members && Clock::now() < deadline; seen = rdzv.add(round_key(round, "done"), 0)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const std::exception&) {
    // Machine 0 is gone: nothing to wait for.
  }
}

}  // namespace

int run_elastic(const LaunchPlan& plan, detail::Supervisor& supervisor, const std::map<std::string, std::string>& base,
                const fs::path& scratch, int port, bool serves_store) {
  Rendezvous rdzv(plan, port);
  rdzv.connect();
  int last_round = -1;
  int failures = 0;
  while (true) {
    int round = 0, rank = 0, members = 0;
    if (serves_store) {
      round = last_round + 1;
      members = hold_round(plan, rdzv, round);
    } else {
      // The next open round; while a round runs without this machine, it is counted as waiting.
      bool waiting = false;
      while (true) {
        const int published = rdzv.get_int(kRoundKey);
        if (published > last_round && !rdzv.has(round_key(published, "members"))) {
          round = published;
          rank = rdzv.add(round_key(round, "joined"), 1) - 1;
          const auto deadline = Clock::now() + millis(plan.rdzv_timeout + plan.last_call_timeout);
          while ((members = rdzv.get_int(round_key(round, "members"))) < 0) {
            ACCELERATE_CHECK(Clock::now() < deadline, "[launch] round ", round, " of the elastic job's rendezvous at ",
                             plan.main_process_ip, ":", port, " was not closed within --rdzv_timeout (",
                             plan.rdzv_timeout, "s)");
            std::this_thread::sleep_for(std::chrono::milliseconds(100));
          }
          if (rank < members) break;
          last_round = round;  // too late for it: the next one
        }
        if (!waiting) {
          rdzv.add(kWaitingKey, 1);
          waiting = true;
          if (published >= 0) say(plan, "waiting for the running group (round " + std::to_string(published) + ") to take this machine in");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
      if (waiting) rdzv.add(kWaitingKey, -1);
    }

    LaunchPlan group = plan;
    group.num_machines = members;
    group.num_processes = members * plan.local_num_processes;
    group.machine_rank = rank;
    say(plan, "round " + std::to_string(round) + " of the rendezvous: this is machine " + std::to_string(rank) +
                  " of " + std::to_string(members) + " (" + std::to_string(group.num_processes) + " processes)");
    std::vector<detail::WorkerSpec> specs(plan.local_num_processes);
    for (int local = 0; local < plan.local_num_processes; ++local) {
      auto& spec = specs[local];
      spec.local_rank = local;
      spec.rank = rank * plan.local_num_processes + local;
      spec.argv = plan.command;
      spec.error_file = (scratch / ("error_" + std::to_string(round) + "_" + std::to_string(spec.rank))).string();
      auto env = base;
      for (auto& [k, v] : worker_environment(group, local, port, round)) env[k] = v;
      env["ACCELERATE_ERROR_FILE"] = spec.error_file;
      for (auto& [k, v] : env) spec.env.push_back(k + "=" + v);
    }
    auto options = detail::supervise_options(plan, round);
    options.regroup = [&, round, members] {
      try {
        if (serves_store && members < plan.num_machines && rdzv.get_int(kWaitingKey) > 0) {
          rdzv.set(round_key(round, "regroup"), "1");
        }
        return rdzv.has(round_key(round, "regroup"));
      } catch (const std::exception&) {
        // The store is gone: machine 0 finished, or was lost. Its workers' own end (a success, or
        // a collective that fails naming the lost machine) says which.
        return false;
      }
    };
    const auto result = supervisor.run(specs, options);
    last_round = round;
    if (result.interrupted || result.preempted) return result.exit_code;
    if (result.regrouped) {
      say(plan, "a machine is waiting to join: forming the group again");
      continue;
    }
    if (result.exit_code == 0) {
      finish_round(plan, rdzv, round, members, serves_store);
      return 0;
    }
    if (++failures > plan.max_restarts) return result.exit_code;
    say(plan, "restarting with the machines that remain (restart " + std::to_string(failures) + " of " +
                  std::to_string(plan.max_restarts) + ")");
  }
}

}  // namespace accelerate::commands
