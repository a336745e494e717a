// `accelerate launch`: the steps of a launch on one machine of a job, from the job's secret to its
// attempts; see include/accelerate/commands/launch.h. The flags are read in arguments.cpp, merged
// in plan.cpp; the attempts and their restarts are in restarts.cpp (elastic.cpp for an elastic
// job, mpi.cpp for mpirun's), one attempt's supervision in supervisor.cpp.
#include "accelerate/commands/launch.h"

#include "accelerate/utils/environment.h"
#include "detail/check.h"
#include "detail/files.h"
#include "detail/network.h"
#include "detail/store_server.h"
#include "detail/topology.h"
#include "launch/elastic.h"
#include "launch/restarts.h"
#include "launch/supervisor.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <unistd.h>

namespace accelerate::detail::launch {
namespace {

namespace fs = std::filesystem;
using commands::LaunchPlan;

// Step 1. The job's secret and, for a machine numbered at the rendezvous, whether it is machine 0
// (Note [Machine ranks from the rendezvous]: machine 0 is known before its store starts): the one
// with --main_process_ip's address, unless rdzv_conf's is_host says.
void settle_identity(LaunchPlan& plan) {
  if (plan.rdzv_secret.empty() && plan.num_processes > 1) plan.rdzv_secret = detail::new_job_secret();
  if (plan.machine_rank_at_rendezvous) {
    const bool hosts = plan.is_host ? *plan.is_host : detail::is_local_address(plan.main_process_ip);
    plan.machine_rank = hosts ? 0 : -1;
  }
}

// Step 2. The job's rendezvous store, which machine 0's launcher serves; null on other machines
// and for a job of one process.
std::unique_ptr<detail::StoreServer> serve_store(const LaunchPlan& plan) {
  if (plan.num_processes <= 1 || plan.machine_rank != 0) return nullptr;
  return std::make_unique<detail::StoreServer>(
      detail::store_bind_address(plan.main_process_ip, plan.num_machines > 1), plan.main_process_port,
      plan.rdzv_secret,
      [](const std::string& line) { std::cerr << "accelerate launch: " + line + "\n" << std::flush; });
}

// Step 3. This machine's rank, when the launchers are numbered as they join the rendezvous at
// `port` (an elastic job numbers them in each of its rounds instead).
void number_machine(LaunchPlan& plan, int port) {
  if (plan.machine_rank >= 0 || plan.elastic) return;
  plan.machine_rank = machine_rank_at_rendezvous(plan, port);
  if (!plan.quiet) {
    std::cerr << "accelerate launch: this is machine " << plan.machine_rank << " of " << plan.num_machines
              << " (numbered at the rendezvous at " << plan.main_process_ip << ":" << plan.main_process_port << ")"
              << std::endl;
  }
}

// Step 4. The launcher's scratch folder (pipes of the MPI wrappers, error files), under TMPDIR,
// removed however the launch ends: an error thrown by a later attempt's rendezvous or by mpirun's
// start must not leave it behind.
class ScratchFolder {
 public:
  ScratchFolder() {
    std::string tmp_root = get_env("TMPDIR").value_or("");
    if (tmp_root.empty()) tmp_root = "/tmp";
    std::string tmpl = tmp_root + "/accelerate-launch-XXXXXX";
    const char* tmp = ::mkdtemp(tmpl.data());
    ACCELERATE_CHECK(tmp != nullptr, "[launch] cannot create a temporary folder in ", tmp_root, ": ",
                     std::strerror(errno));
    path_ = tmp;
  }
  ~ScratchFolder() { (void)detail::try_remove_tree(path_); }
  ScratchFolder(const ScratchFolder&) = delete;
  ScratchFolder& operator=(const ScratchFolder&) = delete;

  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// Step 5. The inherited environment, minus what the contract sets per worker.
std::map<std::string, std::string> inherited_environment() {
  std::map<std::string, std::string> base;
  for (auto& [key, value] : detail::environment_entries()) base.emplace(std::move(key), std::move(value));
  base.erase("ACCELERATE_ERROR_FILE");
  return base;
}

}  // namespace
}  // namespace accelerate::detail::launch

namespace accelerate::commands {

int launch_command(const LaunchPlan& given) {
  namespace launch = detail::launch;
  LaunchPlan plan = given;
  launch::settle_identity(plan);
  // Signals are blocked before the store starts its thread; see Supervisor.
  launch::Supervisor supervisor;
  const auto store = launch::serve_store(plan);
  const int port = store ? store->port() : plan.main_process_port;
  launch::number_machine(plan, port);
  const launch::ScratchFolder scratch;
  const auto base = launch::inherited_environment();
  // Step 6. The attempts, until one ends without a restart (restarts.h).
  if (plan.elastic) return launch::run_elastic(plan, supervisor, base, scratch.path(), port, store != nullptr);
  return launch::run_attempts(plan, supervisor, base, scratch.path(), port, store != nullptr);
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
