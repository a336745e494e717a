// The c10d rendezvous of the launchers: machine ranks and elastic membership; see elastic.h.
#include "launch/elastic.h"

#include "detail/check.h"
#include "detail/durations.h"
#include "detail/store_connection.h"
#include "launch/restarts.h"

#include <chrono>
#include <csignal>
#include <cstring>
#include <map>
#include <iostream>
#include <memory>
#include <thread>

namespace accelerate::detail::launch {
namespace {

namespace fs = std::filesystem;
using commands::LaunchPlan;
namespace proto = detail::store_protocol;

// Note [Elastic membership]
// An elastic job (--nnodes MIN:MAX --rdzv_backend c10d) forms its group in rounds of a rendezvous
// held in the store that the launcher of the machine with --main_process_ip's address serves (the
// host; as with torchrun's c10d rendezvous, the job ends if that machine is lost).
// - The host opens round R: it joins it first, as machine 0, then publishes R under kRoundKey.
// - Every other launcher waits for a round later than the last one it tried that is still open,
//   joins it by adding 1 to the round's count, and takes the count as its machine rank.
// - The host closes the round once MAX machines have joined, or once MIN have and no other came
//   for rdzv_conf's last_call_timeout; past `join_timeout` (rdzv_conf's, else --rdzv_timeout)
//   without MIN, the job ends, saying so.
//   The number of members is published under the round's "members" key. A launcher whose rank is
//   past it came too late, and waits for the next round.
// - Each member then runs its workers as machine `rank` of `members` machines: the world size is
//   members x processes per machine, and the workers meet under the keys of attempt R.
// - A member whose workers fail (a lost machine makes the others' collectives fail) goes on to
//   the next round, within --max_restarts failures; the host opens it. The machines that remain
//   form the group again, smaller.
// - A launcher that finds the running round closed without it (a machine that comes, or comes
//   back) is a waiter: it takes a number from kWaitersKey and beats a counter under its own key
//   while it waits, and deletes the key when it joins. The host, whose group is smaller than MAX
//   and none of whose members has finished, sees a counter that moved within the last few
//   seconds (a waiter that died stops moving its own) and sets the round's "regroup" key; every
//   member's supervisor asks for it every half second, stops its workers without blame (not a
//   restart against --max_restarts) and joins the next round, with the waiter: the group grows.
//   A member whose workers failed because a peer stopped for the regroup sees the key and takes
//   it as a regroup too.
// - When the job succeeds, the host publishes kFinishedKey and serves the store until every
//   member has said its workers are done (a bounded wait); a waiter then ends with success.
// - Signals that stop the launcher are read while it waits at the rendezvous, too.
// The program resumes each round from its newest complete checkpoint: the sharded state and the
// data loader's position are resharded to the new world size, and the user's accumulation steps
// keep the global batch.
// A job of a fixed size whose machines are numbered at the rendezvous (--rdzv_backend c10d without
// --machine_rank) and that may restart runs the same rounds with MIN = MAX: a machine lost and
// launched again (a launcher counting from 0, which static numbering would take for one launcher
// too many) joins the round that the others open after their failure, and the host waits for it
// up to `join_timeout`.
constexpr const char* kRoundKey = "accelerate/elastic/round";
constexpr const char* kWaitersKey = "accelerate/elastic/waiters";
constexpr const char* kFinishedKey = "accelerate/elastic/finished";
constexpr auto kWaiterAlive = std::chrono::seconds(3);  // a waiter's beat is at most this old

std::string round_key(int round, const char* what) {
  return "accelerate/elastic/round" + std::to_string(round) + "/" + what;
}
std::string waiter_key(int id) { return "accelerate/elastic/waiter" + std::to_string(id); }

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
}

std::string signal_text(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev != nullptr ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

// The rendezvous store, as seen by one launcher.
class Rendezvous {
 public:
  Rendezvous(const LaunchPlan& plan, int port) : plan_(plan), port_(port) {}

  // Connects, retrying until `join_timeout` (the host may start later than this machine).
  void connect() {
    const auto deadline = Clock::now() + millis(join_timeout(plan_));
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
    detail::raise_error(detail::concat("[launch] could not reach the job's rendezvous at ",
                                       plan_.main_process_ip, ":", port_, " within ",
                                       join_timeout_text(plan_), ": ", failure));
  }

  // Each request waits at most `timeout` for its answer; the supervisor's questions use a short one.
  int add(const std::string& key, int delta, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    auto reply = ask(proto::Op::kAdd, {key, std::to_string(delta)}, timeout);
    return reply.size() == 1 ? std::stoi(reply[0]) : 0;
  }
  void set(const std::string& key, const std::string& value,
           std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    ask(proto::Op::kSet, {key, value}, timeout);
  }
  void erase(const std::string& key) { ask(proto::Op::kDelete, {key}, std::chrono::seconds(10)); }
  bool has(const std::string& key, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    auto reply = ask(proto::Op::kCheck, {key}, timeout);
    return reply.size() == 1 && reply[0] == "1";
  }
  int get_int(const std::string& key, std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    if (!has(key, timeout)) return -1;
    auto reply = ask(proto::Op::kGet, {key}, timeout);
    return reply.size() == 1 ? std::stoi(reply[0]) : -1;
  }

 private:
  std::vector<std::string> ask(proto::Op op, const std::vector<std::string>& args, std::chrono::milliseconds timeout) {
    try {
      return store_->request(op, args, timeout);
    } catch (const std::exception& e) {
      detail::raise_error(detail::concat("[launch] the job's rendezvous store at ", plan_.main_process_ip,
                                         ":", port_, " stopped answering (the job ended, or the machine serving it "
                                         "was lost): ",
                                         detail::error_text(e)));
    }
  }

  const LaunchPlan& plan_;
  const int port_;
  std::unique_ptr<detail::StoreConnection> store_;
};

void say_unless_quiet(const LaunchPlan& plan, const std::string& line) {
  if (!plan.quiet) std::cerr << "accelerate launch: " << line << std::endl;
}

// Thrown out of a wait at the rendezvous when the launcher is asked to stop.
struct StopRequested {
  int signal;
};

void check_stop(Supervisor& supervisor) {
  if (const int sig = supervisor.stop_requested(); sig != 0) throw StopRequested{sig};
}

// The host: opens round `round`, joins it as machine 0 and closes it; returns the members.
int hold_round(const LaunchPlan& plan, Rendezvous& rdzv, Supervisor& supervisor, int round) {
  rdzv.add(round_key(round, "joined"), 1);  // before the round is published: the host is machine 0
  rdzv.set(kRoundKey, std::to_string(round));
  const auto opened = Clock::now();
  const auto deadline = opened + millis(join_timeout(plan));
  auto enough_since = Clock::time_point::max();
  bool said_waiting = false;
  int joined = 1;
  while (true) {
    check_stop(supervisor);
    joined = rdzv.add(round_key(round, "joined"), 0);
    if (joined >= plan.num_machines) break;
    if (!said_waiting && joined < plan.min_machines && Clock::now() - opened > std::chrono::seconds(5)) {
      said_waiting = true;
      say_unless_quiet(plan, "round " + std::to_string(round) + " of the rendezvous waits for " +
                    std::to_string(plan.min_machines) + " machine(s), " + std::to_string(joined) +
                    " joined so far (up to " + join_timeout_text(plan) + ")");
    }
    if (joined >= plan.min_machines) {
      if (enough_since == Clock::time_point::max()) enough_since = Clock::now();
      if (Clock::now() - enough_since >= millis(plan.last_call_timeout)) break;
    } else if (Clock::now() > deadline) {
      const std::string needs =
          plan.min_machines < plan.num_machines
              ? detail::concat("the elastic job needs at least ", plan.min_machines, " machine(s) (--nnodes ",
                               plan.min_machines, ":", plan.num_machines, ")")
              : detail::concat("the job needs its ", plan.num_machines, " machines (--num_machines ",
                               plan.num_machines, ")");
      detail::raise_error(detail::concat("[launch] ", needs, ", but only ", joined, " joined round ", round,
                                         " of the rendezvous at ", plan.main_process_ip, " within ",
                                         join_timeout_text(plan)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const int members = std::min(joined, plan.num_machines);
  rdzv.set(round_key(round, "members"), std::to_string(members));
  return members;
}

// Another machine: joins the next open round; returns {round, rank, members}, or round -1 when
// the job finished without it.
struct Place {
  int round = -1, rank = 0, members = 0;
};
Place join_round(const LaunchPlan& plan, Rendezvous& rdzv, Supervisor& supervisor, int tried_round,
                 int ran_round) {
  int waiter = 0;  // this launcher's number as a waiter; 0: not waiting
  int beat = 0;
  auto waiting_since = Clock::time_point::max();
  Place place;
  while (true) {
    check_stop(supervisor);
    if (rdzv.has(kFinishedKey)) break;
    const int published = rdzv.get_int(kRoundKey);
    const bool closed = published >= 0 && rdzv.has(round_key(published, "members"));
    if (published > tried_round && !closed) {
      tried_round = published;
      const int rank = rdzv.add(round_key(published, "joined"), 1) - 1;
      const auto deadline = Clock::now() + millis(join_timeout(plan) + plan.last_call_timeout);
      int members = -1;
      while ((members = rdzv.get_int(round_key(published, "members"))) < 0) {
        check_stop(supervisor);
        ACCELERATE_CHECK(Clock::now() < deadline, "[launch] round ", published, " of the elastic job's rendezvous at ",
                         plan.main_process_ip, " was not closed within ", join_timeout_text(plan));
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      if (rank < members) {
        place = {published, rank, members};
        break;
      }
      continue;  // too late for it: the next one
    }
    // A round runs without this machine: it waits, and says so while its beat moves.
    if (closed && published != ran_round) {
      if (waiter == 0) {
        waiter = rdzv.add(kWaitersKey, 1);
        waiting_since = Clock::now();
        say_unless_quiet(plan, "waiting for the running group (round " + std::to_string(published) + ") to take this machine in");
      }
      rdzv.set(waiter_key(waiter), std::to_string(++beat));
      // A job of a fixed size takes a machine in only when one of its own was lost: one that
      // waits longer than `join_timeout` while every machine runs is a launcher too many.
      if (plan.min_machines == plan.num_machines && Clock::now() - waiting_since > millis(join_timeout(plan))) {
        rdzv.erase(waiter_key(waiter));
        detail::raise_value_error(detail::concat(
            "[launch] round ", published, " of the rendezvous at ", plan.main_process_ip, " runs the job's ",
            plan.num_machines, " machines (--num_machines ", plan.num_machines, ") without this launcher, and no "
            "machine was lost within ", join_timeout_text(plan), ": more launchers than machines joined "
            "it (one started twice, or the allocation has more machines than the job)"));
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (waiter != 0) rdzv.erase(waiter_key(waiter));
  return place;
}

// The host's view of the waiters: whose beat moved lately.
class Waiters {
 public:
  bool any_alive(Rendezvous& rdzv) {
    const auto timeout = std::chrono::seconds(2);
    const int count = rdzv.add(kWaitersKey, 0, timeout);
    const auto now = Clock::now();
    bool alive = false;
    for (int id = 1; id <= count; ++id) {
      const int beat = rdzv.get_int(waiter_key(id), timeout);
      if (beat < 0) continue;  // joined, or never beat
      auto& seen = seen_[id];
      if (seen.first != beat) seen = {beat, now};
      alive = alive || now - seen.second < kWaiterAlive;
    }
    return alive;
  }

 private:
  std::map<int, std::pair<int, Clock::time_point>> seen_;  // id -> (beat, when it last changed)
};

// A member whose workers succeeded says so; the host publishes that the job is done and keeps
// serving the store until every member has said so (or a grace period has passed), since the
// others' workers may still be finishing.
void finish_round(const LaunchPlan& plan, Rendezvous& rdzv, int round, int members, bool serves_store) {
  try {
    const int done = rdzv.add(round_key(round, "done"), 1);
    if (!serves_store) return;
    rdzv.set(kFinishedKey, "1");
    const auto deadline = Clock::now() + millis(std::max(30.0, plan.grace_period));
    for (int seen = done; seen < members && Clock::now() < deadline; seen = rdzv.add(round_key(round, "done"), 0)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const std::exception&) {
    // Machine 0 is gone: nothing to wait for.
  }
}

int run(const LaunchPlan& plan, Supervisor& supervisor, const std::map<std::string, std::string>& base,
        const fs::path& scratch, int port, bool serves_store) {
  Rendezvous rdzv(plan, port);
  rdzv.connect();
  Waiters waiters;
  int tried_round = -1;  // the last round this launcher joined, or opened
  int ran_round = -1;    // the last round its workers ran in
  int failures = 0;
  while (true) {
    Place place;
    if (serves_store) {
      place.round = tried_round + 1;
      place.members = hold_round(plan, rdzv, supervisor, place.round);
    } else {
      place = join_round(plan, rdzv, supervisor, tried_round, ran_round);
      if (place.round < 0) {
        say_unless_quiet(plan, "the elastic job finished before this machine could join it");
        return 0;
      }
    }
    const int round = place.round, rank = place.rank, members = place.members;
    tried_round = ran_round = round;

    LaunchPlan group = plan;
    group.num_machines = members;
    group.num_processes = members * plan.local_num_processes;
    group.machine_rank = rank;
    say_unless_quiet(plan, "round " + std::to_string(round) + " of the rendezvous: this is machine " + std::to_string(rank) +
                  " of " + std::to_string(members) + " (" + std::to_string(group.num_processes) + " processes)");
    const auto specs = worker_specs(group, base, scratch, port, round);
    auto options = supervise_options(plan, round);
    const auto quick = std::chrono::seconds(2);  // the supervisor must not wait long on the store
    // A job of a fixed size never regroups: it takes a machine in only after losing one.
    if (plan.min_machines < plan.num_machines) options.regroup = [&, round, members, quick] {
      try {
        if (serves_store && members < plan.num_machines && rdzv.add(round_key(round, "done"), 0, quick) == 0 &&
            waiters.any_alive(rdzv)) {
          rdzv.set(round_key(round, "regroup"), "1", quick);
        }
        return rdzv.has(round_key(round, "regroup"), quick);
      } catch (const std::exception&) {
        // The store is gone: machine 0 finished, or was lost. Its workers' own end (a success, or
        // a collective that fails naming the lost machine) says which.
        return false;
      }
    };
    const auto result = supervisor.run(specs, options);
    if (result.interrupted) return result.exit_code;
    bool regroup = result.regrouped;
    if (!regroup && result.exit_code != 0) {
      try {  // stopped by a peer's regroup rather than failed
        regroup = rdzv.has(round_key(round, "regroup"), quick);
      } catch (const std::exception&) {
      }
    }
    if (regroup) {
      say_unless_quiet(plan, "a machine is waiting to join: forming the group again");
      continue;
    }
    if (!restart_after(result, failures, plan.max_restarts)) {
      if (result.exit_code == 0) finish_round(plan, rdzv, round, members, serves_store);
      return result.exit_code;
    }
    ++failures;
    say_unless_quiet(plan, std::string(plan.min_machines < plan.num_machines ? "restarting with the machines that remain"
                                                                : "restarting; a lost machine rejoins when launched again") +
                  " (restart " + std::to_string(failures) + " of " + std::to_string(plan.max_restarts) + ")");
  }
}

}  // namespace

double join_timeout(const LaunchPlan& plan) { return plan.join_timeout.value_or(plan.rdzv_timeout); }

std::string join_timeout_text(const LaunchPlan& plan) {
  return plan.join_timeout ? detail::concat("rdzv_conf's join_timeout (", *plan.join_timeout, "s)")
                           : detail::concat("--rdzv_timeout (", plan.rdzv_timeout, "s)");
}

// Note [Machine ranks from the rendezvous]
// Upstream's Slurm recipe runs the same `accelerate launch --rdzv_backend c10d` on every node,
// without --machine_rank. The launcher on the machine that has --main_process_ip's address is
// machine 0: it serves the store, as with static ranks. Every other launcher adds 1 to
// kMachinesKey, once, and takes the count it gets back as its machine rank, so machines are
// numbered in the order they join. A launcher that gets a number past --num_machines - 1 is one
// launcher too many (a second one on a machine, or a larger allocation than the job), and says so.
int machine_rank_at_rendezvous(const LaunchPlan& plan, int port) {
  constexpr const char* kMachinesKey = "accelerate/rdzv/machines_joined";
  Rendezvous rdzv(plan, port);
  rdzv.connect();
  const int rank = rdzv.add(kMachinesKey, 1);
  ACCELERATE_CHECK_VALUE(rank < plan.num_machines, "[launch] this launcher joined the rendezvous at ",
                         plan.main_process_ip, ":", port, " as machine ", rank, ", but the job has --num_machines ",
                         plan.num_machines,
                         ": more launchers than machines joined it (one started twice, or the allocation has more "
                         "machines than the job)");
  return rank;
}

int run_elastic(const LaunchPlan& plan, Supervisor& supervisor, const std::map<std::string, std::string>& base,
                const fs::path& scratch, int port, bool serves_store) {
  try {
    return run(plan, supervisor, base, scratch, port, serves_store);
  } catch (const StopRequested& stop) {
    std::cerr << "accelerate launch: stopped: the launcher received " << signal_text(stop.signal)
              << " while waiting at the elastic job's rendezvous" << std::endl;
    return 128 + stop.signal;
  }
}

}  // namespace accelerate::detail::launch
