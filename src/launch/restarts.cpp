// When the launcher starts its workers again; see restarts.h.
#include "launch/restarts.h"

#include "detail/check.h"
#include "detail/store_connection.h"
#include "launch/elastic.h"
#include "launch/mpi.h"

#include <algorithm>
#include <chrono>
#include <iostream>
#include <memory>
#include <thread>

namespace accelerate::detail::launch {
namespace {

namespace fs = std::filesystem;
using commands::LaunchPlan;

// Note [A machine that comes back]
// With --max_restarts, the launchers of a job on several machines restart their workers
// together: each counts its attempts, and the workers of attempt N meet under the store keys of
// attempt N. A machine that died and is started again (a new launcher, counting from 0) would
// meet nobody. So the launcher of machine 0, which serves the store, publishes the attempt it is
// starting under kAttemptKey, and the launcher of any other machine reads it before each of its
// attempts and joins the later one: the restarted workers of machine 0, waiting for the others
// at their rendezvous (--rdzv_timeout), are joined by those of the machine that came back. An
// attempt that already has all its processes (the one that just failed, while machine 0 tears it
// down) is not joined: the launcher waits, up to `join_timeout` (rdzv_conf's, else
// --rdzv_timeout), for machine 0 to start the next.
// The job's restart budget is shared: the attempt a launcher joins counts against its
// --max_restarts.
// A machine 0 that dies takes the store with it, and the job with it (as with torchrun's static
// rendezvous). MPI jobs are restarted by machine 0's launcher alone.
constexpr const char* kAttemptKey = "accelerate/launcher_attempt";

// The attempt a launcher of another machine runs, given its own count: machine 0's when that is
// later and still takes processes (Note [A machine that comes back]). When machine 0 cannot be
// asked, its own count (the workers then report what is wrong with the store).
int attempt_to_join(const LaunchPlan& plan, int port, int own) {
  namespace proto = detail::store_protocol;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(join_timeout(plan)));
  std::unique_ptr<detail::StoreConnection> store;
  int published = 0;
  try {
    store = std::make_unique<detail::StoreConnection>(plan.main_process_ip, port, plan.rdzv_secret,
                                                      std::chrono::seconds(5));
    while (true) {
      const auto found = store->request(proto::Op::kCheck, {kAttemptKey}, std::chrono::seconds(5));
      if (found.size() == 1 && found[0] == "1") {
        const auto value = store->request(proto::Op::kGet, {kAttemptKey}, std::chrono::seconds(5));
        if (value.size() == 1) published = std::stoi(value[0]);
      }
      if (own > published) return own;  // machine 0 will come to it
      const std::string full = "accelerate/attempt" + std::to_string(published) + "/joined/complete";
      const auto taken = store->request(proto::Op::kCheck, {full}, std::chrono::seconds(5));
      if (taken.size() != 1 || taken[0] != "1") return published;
      if (std::chrono::steady_clock::now() > deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  } catch (const std::exception&) {
    return std::max(own, published);
  }
  detail::raise_error(detail::concat(
      "[launch] the job's attempt ", published, " already has all its ", plan.num_processes,
      " processes, and the launcher of machine 0 started no other within ", join_timeout_text(plan),
      ": it has no restart left (--max_restarts), or this machine's launcher runs twice"));
}

// A restarted attempt's line: "restarting all 4 worker(s) (restart 1 of 3)".
void say_restarting(const LaunchPlan& plan, int workers, int restart) {
  if (!plan.quiet) {
    std::cerr << "accelerate launch: restarting all " << workers << " worker(s) (restart " << restart << " of "
              << plan.max_restarts << ")" << std::endl;
  }
}

}  // namespace

bool restart_after(const AttemptResult& result, int restarts, int max_restarts) {
  return result.exit_code != 0 && !result.interrupted && !result.preempted && restarts < max_restarts;
}

int run_attempts(const LaunchPlan& plan, Supervisor& supervisor, const std::map<std::string, std::string>& base,
                 const fs::path& scratch, int port, bool serves_store) {
  // Note [A machine that comes back].
  const bool restarts_together = plan.num_machines > 1 && plan.max_restarts > 0 && plan.backend != "mpi";
  std::unique_ptr<detail::StoreConnection> publisher;
  if (restarts_together && serves_store) {
    publisher = std::make_unique<detail::StoreConnection>(plan.main_process_ip, port, plan.rdzv_secret,
                                                          std::chrono::seconds(10));
  }
  for (int attempt = 0;; ++attempt) {
    if (restarts_together && !serves_store) {
      const int joined = attempt_to_join(plan, port, attempt);
      if (joined > attempt) {
        attempt = joined;
        if (!plan.quiet) {
          std::cerr << "accelerate launch: joining the job at restart " << attempt << " of " << plan.max_restarts
                    << ", where the launcher of machine 0 is" << std::endl;
        }
      }
    }
    if (publisher) {
      publisher->request(detail::store_protocol::Op::kSet, {kAttemptKey, std::to_string(attempt)},
                         std::chrono::seconds(10));
    }
    // mpirun starts every worker of the job; otherwise this machine's launcher starts its own.
    const bool mpi = plan.backend == "mpi";
    const AttemptResult result =
        mpi ? run_mpi_attempt(plan, supervisor, base, scratch, port, attempt)
            : supervisor.run(worker_specs(plan, base, scratch, port, attempt), supervise_options(plan, attempt));
    if (!restart_after(result, attempt, plan.max_restarts)) return result.exit_code;
    say_restarting(plan, mpi ? plan.num_processes : plan.local_num_processes, attempt + 1);
  }
}

}  // namespace accelerate::detail::launch
