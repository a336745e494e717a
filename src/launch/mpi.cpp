// The MPI back-end of `accelerate launch`; see mpi.h.
#include "launch/mpi.h"

#include "accelerate/utils/environment.h"
#include "build_config.h"
#include "detail/check.h"
#include "detail/network.h"
#include "detail/store_server.h"  // is_loopback_address
#include "detail/subprocess.h"
#include "launch/devices.h"

#include <cerrno>
#include <cstring>
#include <sys/stat.h>
#include <unistd.h>

namespace accelerate::detail::launch {

namespace fs = std::filesystem;
using commands::LaunchPlan;

// Note [MPI by default]
// On one machine, CPU processes communicate much faster through MPI's shared memory than through
// Gloo's loopback TCP (bench/: a 4 KiB allreduce ~15 us against ~400 us; the 2-process MLP step
// 1.3-1.6x faster), so a CPU job of several processes on one machine runs on MPI when the build
// has it and mpirun is installed. Jobs of one launcher per machine, GPU jobs and builds without
// MPI keep Gloo (or NCCL); `--backend` or ACCELERATE_BACKEND chooses explicitly.
bool mpi_is_the_default(const LaunchPlan& plan) {
  if (plan.num_processes < 2 || plan.num_machines != 1 || plan.multi_gpu) return false;
  if (!is_mpi_available()) return false;
  if (!plan.use_cpu && visible_cuda_devices() > 0) return false;
  try {
    (void)detail::resolve_program("mpirun");
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// Checks what the MPI back-end needs and finds mpirun.
void resolve_mpirun(LaunchPlan& plan) {
  ACCELERATE_CHECK_VALUE(is_mpi_available(),
                         "[launch] --backend mpi: the MPI back-end is not available in this build of "
                         "accelerate-cpp (it was built without MPI; install libopenmpi-dev and rebuild)");
  ACCELERATE_CHECK_VALUE(!plan.multi_gpu,
                         "[launch] --backend mpi handles CPU tensors only; use --cpu, or nccl for GPUs");
  if (plan.num_machines > 1) {
    ACCELERATE_CHECK_VALUE(plan.mpirun_hostfile.has_value(), "[launch] --backend mpi on ", plan.num_machines,
                           " machines needs --mpirun_hostfile, the machines mpirun starts the workers on");
    ACCELERATE_CHECK_VALUE(plan.machine_rank == 0,
                           "[launch] with --backend mpi, mpirun starts the workers of every "
                           "machine: run accelerate launch once, on the machine of rank 0 (--machine_rank 0)");
  }
  if (plan.mpirun_hostfile) {
    ACCELERATE_CHECK_VALUE(fs::is_regular_file(*plan.mpirun_hostfile), "[launch] --mpirun_hostfile ",
                           *plan.mpirun_hostfile, " is not a readable file");
  }
  try {
    plan.mpirun = detail::resolve_program("mpirun");
  } catch (const std::exception&) {
    ACCELERATE_CHECK_VALUE(std::string(ACCELERATE_MPIEXEC).size() > 0 && fs::exists(ACCELERATE_MPIEXEC),
                           "[launch] --backend mpi needs mpirun, which is not on PATH (Debian: openmpi-bin)");
    plan.mpirun = ACCELERATE_MPIEXEC;
  }
}

namespace {

// Note [Workers under mpirun]
// With the MPI back-end, mpirun starts the workers, so they are not the launcher's children.
// mpirun runs a small wrapper script per rank, which sets the same RANK/LOCAL_RANK/... variables
// as for other workers (from mpirun's own) and keeps the launcher's guarantees:
//  * the worker's stdout and stderr go to named pipes of its rank, which the launcher relays
//    with the usual "[rankN]: " prefix (mpirun's own output gets "[mpirun]: ");
//  * it reports "start <rank> <pid>" and "exit <rank> <code>" on a status pipe, so the launcher
//    knows the first failure (the root cause) and can signal workers directly;
//  * the worker runs in its own process group (job control on), with default signal handling,
//    and dies with its wrapper (PR_SET_PDEATHSIG through setpriv); a watcher kills it when the
//    launcher itself is gone, so that no worker outlives a launcher killed with SIGKILL;
//  * the reports open the status pipe for reading and writing, which never blocks: a wrapper
//    whose launcher was killed (no reader left) still ends instead of waiting forever;
//  * once the worker runs, the wrapper's own stderr (which mpirun relays) goes nowhere and the
//    watcher leaves its job table, so that no job-control notice ("Terminated", "Killed")
//    reaches the user's output; the worker's fate reaches the launcher on the status pipe;
//  * when the worker has ended, the wrapper kills its watcher and waits (up to 2 s) until the
//    watcher's group is gone before it reports: a watcher still dying when mpirun ends would be
//    adopted by the launcher and stopped as one of the processes the workers left behind.
// The script is given to bash on its command line (`bash -c`), not as a file, since other
// machines have none of the launcher's files. There (a host file) the pipes do not exist
// either: the wrapper runs the program
// directly and mpirun relays its output and exit status.
constexpr const char* kMpiWrapper = R"(#!/bin/bash
dir=$1; launcher=$2; shift 2
rank=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}
size=${OMPI_COMM_WORLD_SIZE:-${PMI_SIZE:-1}}
local_size=${OMPI_COMM_WORLD_LOCAL_SIZE:-$size}
export RANK=$rank WORLD_SIZE=$size LOCAL_RANK=${OMPI_COMM_WORLD_LOCAL_RANK:-$rank} LOCAL_WORLD_SIZE=$local_size
export ROLE_RANK=$rank ROLE_WORLD_SIZE=$size GROUP_RANK=$((rank / local_size))
if [ ! -p "$dir/status" ]; then exec "$@"; fi
export ACCELERATE_ERROR_FILE="$dir/error.$rank"
set -m
setpriv --pdeathsig KILL -- "$@" </dev/null >"$dir/out.$rank" 2>"$dir/err.$rank" &
child=$!
exec 2>/dev/null
echo "start $rank $child" 1<>"$dir/status"
for sig in TERM INT HUP USR1 USR2; do trap "kill -s $sig $child 2>/dev/null" $sig; done
( while kill -0 "$launcher" 2>/dev/null; do sleep 1; done; kill -s KILL "$child" ) </dev/null >/dev/null 2>&1 &
watcher=$!
disown "$watcher"
while :; do
  wait "$child"; code=$?
  kill -0 "$child" 2>/dev/null || break
done
kill -s KILL -- "-$watcher" 2>/dev/null  # the watcher and its sleep, gone before the report
for _ in {1..200}; do kill -0 -- "-$watcher" 2>/dev/null || break; sleep 0.01; done
echo "exit $rank $code" 1<>"$dir/status"
exit "$code"
)";

// The torchrun-style variables of one rank; under mpirun the ranks come from mpirun instead.
constexpr const char* kPerRankVariables[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                             "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE"};

// The variables every rank of an MPI job gets.
std::map<std::string, std::string> mpi_job_environment(const LaunchPlan& plan, int master_port, int restart_count) {
  auto env = commands::worker_environment(plan, 0, master_port, restart_count);
  for (const char* key : kPerRankVariables) env.erase(key);
  env["ACCELERATE_BACKEND"] = "mpi";
  return env;
}

}  // namespace

AttemptResult run_mpi_attempt(const LaunchPlan& plan, Supervisor& supervisor,
                              const std::map<std::string, std::string>& base, const fs::path& scratch, int port,
                              int attempt) {
  const fs::path dir = scratch / ("attempt_" + std::to_string(attempt));
  fs::create_directories(dir);
  auto make_fifo = [](const fs::path& path) {
    ACCELERATE_CHECK(::mkfifo(path.c_str(), 0600) == 0, "[launch] cannot create the pipe ", path.string(), ": ",
                     std::strerror(errno));
  };
  CarrierSpec carrier;
  carrier.status_pipe = (dir / "status").string();
  carrier.reports_every_worker = !plan.mpirun_hostfile;  // other machines have no status pipe
  make_fifo(carrier.status_pipe);
  std::vector<WorkerSpec> specs(plan.num_processes);
  for (int rank = 0; rank < plan.num_processes; ++rank) {
    auto& spec = specs[rank];
    spec.rank = rank;
    spec.local_rank = rank % plan.local_num_processes;
    spec.argv = plan.command;
    spec.error_file = (dir / ("error." + std::to_string(rank))).string();
    spec.stdout_pipe = (dir / ("out." + std::to_string(rank))).string();
    spec.stderr_pipe = (dir / ("err." + std::to_string(rank))).string();
    make_fifo(spec.stdout_pipe);
    make_fifo(spec.stderr_pipe);
  }
  auto env = base;
  const auto job = mpi_job_environment(plan, port, attempt);
  for (const auto& [k, v] : job) env[k] = v;
  for (const char* key : kPerRankVariables) env.erase(key);
  if (::geteuid() == 0) {  // Open MPI refuses root unless told twice
    env["OMPI_ALLOW_RUN_AS_ROOT"] = "1";
    env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1";
  }
  for (const auto& [k, v] : env) carrier.env.push_back(k + "=" + v);
  carrier.argv = {plan.mpirun, "-np", std::to_string(plan.num_processes), "--bind-to", "none"};
  // Open MPI 5 and later (PRRTE's prterun beside mpirun) renamed settings the launcher passes.
  const bool prrte = fs::exists(fs::path(plan.mpirun).parent_path() / "prterun");
  if (plan.mpirun_hostfile) {
    carrier.argv.insert(carrier.argv.end(), {"--hostfile", *plan.mpirun_hostfile});
    for (const auto& [k, v] : job) carrier.argv.insert(carrier.argv.end(), {"-x", k});
    // Note [The network MPI uses]: across machines, Open MPI's own connections (its daemons' and
    // the TCP transport's) take the network this machine reaches the main process through, as
    // Gloo does (Note [The address Gloo announces]); Open MPI's default tries every interface,
    // bridges and container networks included, and can hang on one the other machines do not
    // share. The user's own choice (OMPI_MCA_*_if_include / _exclude) is left alone.
    // Open MPI 5 and later start their daemons with PRRTE, which calls the daemons' setting
    // prte_if_include and warns on every job about oob_tcp_if_include.
    if (!detail::is_loopback_address(plan.main_process_ip)) {
      const std::string network =
          detail::network_of_address(detail::source_address_towards(plan.main_process_ip, port));
      // Whether the user set `<prefix>_if_include` or `_if_exclude` themselves.
      auto chosen = [&](const std::string& prefix) {
        return env.count(prefix + "_if_include") > 0 || env.count(prefix + "_if_exclude") > 0;
      };
      if (!network.empty() && !chosen("OMPI_MCA_btl_tcp")) {
        carrier.argv.insert(carrier.argv.end(), {"--mca", "btl_tcp_if_include", network});
      }
      if (!network.empty() && !chosen("OMPI_MCA_oob_tcp") && !chosen("PRTE_MCA_prte")) {
        carrier.argv.insert(carrier.argv.end(), {"--mca", prrte ? "prte_if_include" : "oob_tcp_if_include", network});
      }
    }
  } else {
    carrier.argv.push_back("--oversubscribe");  // more processes than cores is the user's choice
    // Note [MPI's start on one machine]: MPI_Init took 0.26 s in every worker (Open MPI 4.1,
    // two processes), 0.20 s of it opening the "cm" messaging layer, whose libfabric providers
    // look for network hardware, only for Open MPI to pick "ob1" (shared memory) on one machine
    // anyway. Naming ob1 skips that search: MPI_Init takes 0.06 s, and what the job runs on is
    // the same. The user's own choice (OMPI_MCA_pml) is left alone; jobs over a host file keep
    // Open MPI's choice, which may be a faster network there.
    if (env.count("OMPI_MCA_pml") == 0) carrier.argv.insert(carrier.argv.end(), {"--mca", "pml", "ob1"});
    // Note [Only shared memory on one machine]: every peer is on this machine, so the workers
    // open only the shared-memory transport and the one to themselves ("vader", named "sm" from
    // Open MPI 5 on), not the network ones, which have nobody to reach. Open MPI 5 still opened TCP,
    // and on some machines every worker then printed "Unable to find reachable pairing between
    // local and remote interfaces" at its first collective; and the libfabric ("ofi") and TCP
    // transports left memory hooks behind that crashed the thread sanitizer's build when a
    // thread ended. The user's own choice (OMPI_MCA_btl) is left alone.
    if (env.count("OMPI_MCA_btl") == 0) {
      carrier.argv.insert(carrier.argv.end(), {"--mca", "btl", prrte ? "self,sm" : "self,vader"});
    }
  }
  // The script travels in the command line: other machines have no copy of the launcher's files.
  carrier.argv.insert(carrier.argv.end(),
                      {"bash", "-c", kMpiWrapper, "accelerate-worker", dir.string(), std::to_string(::getpid())});
  carrier.argv.insert(carrier.argv.end(), plan.command.begin(), plan.command.end());

  return supervisor.run(specs, supervise_options(plan, attempt), &carrier);
}

}  // namespace accelerate::detail::launch
