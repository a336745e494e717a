// `accelerate launch`: the restart loop around the supervisor, for every machine of a job; see
// include/accelerate/commands/launch.h. The flags are read in arguments.cpp, merged in plan.cpp;
// supervision is in supervisor.cpp and the MPI back-end in mpi.cpp.
#include "accelerate/commands/launch.h"

#include "accelerate/utils/environment.h"
#include "detail/check.h"
#include "detail/topology.h"
#include "detail/files.h"
#include "detail/network.h"
#include "detail/store_connection.h"
#include "detail/store_server.h"
#include "launch/elastic.h"
#include "launch/mpi.h"
#include "launch/supervisor.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <thread>
#include <unistd.h>

namespace accelerate::commands {
namespace {

namespace fs = std::filesystem;

// Note [A machine that comes back]
// With --max_restarts, the launchers of a job on several machines restart their workers
// together: each counts its attempts, and the workers of attempt N meet under the store keys of
// attempt N. A machine that died and is started again (a new launcher, counting from 0) would
// meet nobody. So the launcher of machine 0, which serves the store, publishes the attempt it is
// starting under kAttemptKey, and the launcher of any other machine reads it before each of its
// attempts and joins the later one: the restarted workers of machine 0, waiting for the others
// at their rendezvous (--rdzv_timeout), are joined by those of the machine that came back. An
// attempt that already has all its processes (the one that just failed, while machine 0 tears it
// down) is not joined: the launcher waits, up to --rdzv_timeout, for machine 0 to start the next.
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
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(plan.rdzv_timeout));
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
      " processes, and the launcher of machine 0 started no other within --rdzv_timeout (", plan.rdzv_timeout,
      "s): it has no restart left (--max_restarts), or this machine's launcher runs twice"));
}

}  // namespace

int launch_command(const LaunchPlan& given) {
  LaunchPlan plan = given;
  if (plan.rdzv_secret.empty() && plan.num_processes > 1) plan.rdzv_secret = detail::new_job_secret();
  // Note [Machine ranks from the rendezvous]: machine 0 is known before its store starts.
  if (plan.machine_rank_at_rendezvous) plan.machine_rank = detail::is_local_address(plan.main_process_ip) ? 0 : -1;
  // Signals are blocked before the store starts its thread; see Supervisor.
  detail::Supervisor supervisor;
  std::unique_ptr<detail::StoreServer> store;
  int port = plan.main_process_port;
  if (plan.num_processes > 1 && plan.machine_rank == 0) {
    store = std::make_unique<detail::StoreServer>(
        detail::store_bind_address(plan.main_process_ip, plan.num_machines > 1), port, plan.rdzv_secret,
        [](const std::string& line) { std::cerr << "accelerate launch: " + line + "\n" << std::flush; });
    port = store->port();
  }

  if (plan.machine_rank < 0 && !plan.elastic) {
    plan.machine_rank = machine_rank_at_rendezvous(plan, port);
    if (!plan.quiet) {
      std::cerr << "accelerate launch: this is machine " << plan.machine_rank << " of " << plan.num_machines
                << " (numbered at the rendezvous at " << plan.main_process_ip << ":" << plan.main_process_port << ")"
                << std::endl;
    }
  }

  // The launcher's scratch folder (pipes of the MPI wrappers, error files), under TMPDIR.
  std::string tmp_root = get_env("TMPDIR").value_or("");
  if (tmp_root.empty()) tmp_root = "/tmp";
  std::string tmpl = tmp_root + "/accelerate-launch-XXXXXX";
  const char* tmp = ::mkdtemp(tmpl.data());
  ACCELERATE_CHECK(tmp != nullptr, "[launch] cannot create a temporary folder in ", tmp_root, ": ",
                   std::strerror(errno));
  const fs::path scratch(tmp);
  // Removed however the launcher leaves this function: an error thrown by a later attempt's
  // rendezvous or by mpirun's start must not leave the folder behind.
  struct RemovedOnExit {
    fs::path path;
    ~RemovedOnExit() { (void)detail::try_remove_tree(path); }
  } remove_scratch{scratch};

  // The inherited environment, minus what the contract sets per worker.
  std::map<std::string, std::string> base;
  for (auto& [key, value] : detail::environment_entries()) base.emplace(std::move(key), std::move(value));
  base.erase("ACCELERATE_ERROR_FILE");

  if (plan.elastic) return run_elastic(plan, supervisor, base, scratch, port, store != nullptr);

  // Note [A machine that comes back].
  const bool restarts_together = plan.num_machines > 1 && plan.max_restarts > 0 && plan.backend != "mpi";
  std::unique_ptr<detail::StoreConnection> publisher;
  if (restarts_together && store) {
    publisher = std::make_unique<detail::StoreConnection>(plan.main_process_ip, port, plan.rdzv_secret,
                                                          std::chrono::seconds(10));
  }

  int exit_code = 0;
  for (int attempt = 0;; ++attempt) {
    if (restarts_together && !store) {
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
    if (plan.backend == "mpi") {
      exit_code = run_mpi_attempt(plan, supervisor, base, scratch, port, attempt);
      if (exit_code >= 0) break;
      exit_code = -exit_code;
      if (!plan.quiet) std::cerr << "accelerate launch: restarting all " << plan.num_processes << " worker(s) (restart "
                << attempt + 1 << " of " << plan.max_restarts << ")" << std::endl;
      continue;
    }
    const auto specs = detail::worker_specs(plan, base, scratch, port, attempt);
    auto result = supervisor.run(specs, detail::supervise_options(plan, attempt));
    exit_code = result.exit_code;
    if (exit_code == 0 || result.interrupted || result.preempted || attempt >= plan.max_restarts) break;
    if (!plan.quiet) std::cerr << "accelerate launch: restarting all " << plan.local_num_processes << " worker(s) (restart "
              << attempt + 1 << " of " << plan.max_restarts << ")" << std::endl;
  }
  return exit_code;
}

int launch_main(const std::vector<std::string>& argv) {
  try {
    LaunchArgs args = parse_launch_args(argv);
    if (args.help) {
      std::cout << launch_help();
      return 0;
    }
    return launch_command(resolve_launch(args));
  } catch (const std::exception& e) {
    std::cerr << "accelerate launch: error: " << detail::error_text(e) << std::endl;
    return 2;
  }
}

}  // namespace accelerate::commands
