// The MPI back-end end to end: workers started by `accelerate launch --backend mpi` (through
// mpirun) or by mpirun itself, every collective against expected values, a skipped collective,
// a worker killed in the middle of one. Built without MPI, the same requests are refused by name.
#include "accelerate/utils/environment.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string collectives_bin() { return built("tests/mp_collectives"); }

std::vector<std::string> launch_mpi(int processes, std::vector<std::string> program_args) {
  std::vector<std::string> argv = {accelerate_bin(), "launch", "--backend", "mpi", "-n", std::to_string(processes),
                                   "--main_process_port", "0", "--num_cpu_threads_per_process", "1",
                                   collectives_bin()};
  argv.insert(argv.end(), program_args.begin(), program_args.end());
  return argv;
}

// Whether the mpirun on PATH is Open MPI 5 or later: PRRTE's prterun lies beside it.
bool mpirun_has_prrte() {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (std::filesystem::exists(dir + "/mpirun")) return std::filesystem::exists(dir + "/prterun");
  }
  return false;
}

// Built without MPI, a launch with the MPI back-end is refused before anything starts.
bool refused_without_mpi(const Running& r) {
  if (is_mpi_available()) return false;
  EXPECT_EQ(r.exit_code(), 2);
  EXPECT_THAT(r.err, HasSubstr("the MPI back-end is not available in this build"));
  return true;
}

class MpiCollectives : public ::testing::TestWithParam<int> {};

TEST_P(MpiCollectives, EveryCollectiveGivesTheExpectedValues) {
  const int n = GetParam();
  auto r = run(launch_mpi(n, {"all"}), 180);
  if (refused_without_mpi(*r)) return;
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, Not(HasSubstr("WRONG")));
  // Nothing but the job's own lines: Open MPI's complaints about interfaces it cannot pair (Note
  // [Only shared memory on one machine]) reached every job on Open MPI 5.
  EXPECT_THAT(r->out + r->err, Not(HasSubstr("Unable to find reachable pairing")));
  for (int rank = 0; rank < n; ++rank) {
    const std::string p = "[rank" + std::to_string(rank) + "]: ";
    EXPECT_THAT(r->out, HasSubstr(p + "backend " + (n > 1 ? "mpi" : "none") + " processes " + std::to_string(n)));
    for (const char* name : {"allreduce sum BFloat16", "allreduce large", "allreduce large varied", "allreduce large avg",
                             "allreduce large max", "allreduce large BFloat16", "broadcast large", "allgather large", "reduce_scatter large",
                             "reduce_scatter large varied", "reduce_scatter large segments", "reduce_scatter large avg", "reduce_scatter large max",
                             "reduce_scatter large BFloat16",
                             "allreduce product", "allreduce avg", "allreduce non-contiguous",
                             "allreduce_coalesced", "broadcast Long", "reduce", "allgather", "gather", "scatter",
                             "reduce_scatter", "alltoall uneven", "alltoall of tensor lists", "allreduce future",
                             "barrier", "operations gather", "gather_object", "trigger", "wait_for_everyone"}) {
      EXPECT_THAT(r->out, HasSubstr(p + "ok " + name + "\n"));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Processes, MpiCollectives, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return std::to_string(info.param) + "Processes"; });

class MpiSkippedCollective : public ::testing::TestWithParam<std::string> {};

// Small payloads are polled directly; large ones wait in an arrival barrier first.
TEST_P(MpiSkippedCollective, FailsAtTheGroupTimeoutNamingIt) {
  auto r = run(launch_mpi(2, {"skip", "1", GetParam()}), 60);
  if (refused_without_mpi(*r)) return;
  EXPECT_EQ(r->exit_code(), 3) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("[rank0]: error: [mpi] allreduce did not complete within the process group's "
                                "timeout of 2s"));
  EXPECT_THAT(r->err, HasSubstr("worker rank 0 (local rank 0"));
  EXPECT_LT(r->elapsed, 40);
}

INSTANTIATE_TEST_SUITE_P(Payloads, MpiSkippedCollective, ::testing::Values("small", "large"),
                         [](const auto& info) { return info.param; });

TEST(MpiBackend, AWorkerKilledInTheMiddleOfACollectiveTearsTheJobDownWithTheRootCause) {
  auto r = run(launch_mpi(2, {"die", "1"}), 60);
  if (refused_without_mpi(*r)) return;
  EXPECT_EQ(r->exit_code(), 128 + SIGKILL) << r->out << r->err;
  EXPECT_THAT(r->err, HasSubstr("worker rank 1 (local rank 1, pid "));
  EXPECT_THAT(r->err, HasSubstr("was killed by signal 9 (SIGKILL)"));
  EXPECT_THAT(r->out, Not(HasSubstr("completed without")));
}

// Note [MPI's start on one machine] and Note [Only shared memory on one machine] in
// src/launch/mpi.cpp.
TEST(MpiBackend, OnOneMachineTheWorkersUseOb1OverSharedMemoryUnlessTheUserChoseOtherwise) {
  auto shell = [](const std::map<std::string, std::string>& env) {
    return run({accelerate_bin(), "launch", "--backend", "mpi", "-n", "2", "--main_process_port", "0", "/bin/sh", "-c",
                "echo pml=$OMPI_MCA_pml btl=$OMPI_MCA_btl"},
               60, env);
  };
  auto r = shell({});
  if (refused_without_mpi(*r)) return;
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  // Shared memory and self: "vader" on Open MPI 4, "sm" from Open MPI 5 (PRRTE) on.
  const std::string btl = mpirun_has_prrte() ? "self,sm" : "self,vader";
  EXPECT_THAT(r->out, HasSubstr("[rank0]: pml=ob1 btl=" + btl + "\n"));
  EXPECT_THAT(r->out, HasSubstr("[rank1]: pml=ob1 btl=" + btl + "\n"));
  auto chosen = shell({{"OMPI_MCA_pml", "^cm"}, {"OMPI_MCA_btl", "self,vader,tcp"}});
  ASSERT_EQ(chosen->exit_code(), 0) << chosen->err;
  EXPECT_THAT(chosen->out, HasSubstr("[rank0]: pml=^cm btl=self,vader,tcp\n"));
  EXPECT_THAT(chosen->out, HasSubstr("[rank1]: pml=^cm btl=self,vader,tcp\n"));
}

TEST(MpiBackend, AProgramStartedByMpirunItselfUsesMpi) {
  // Without MPI in the build, the same program falls back to Gloo.
  const std::string backend = is_mpi_available() ? "mpi" : "gloo";
  auto r = run({"mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", worker_bin(), "state"}, 60,
               {{"OMPI_ALLOW_RUN_AS_ROOT", "1"},
                {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
                {"MASTER_PORT", std::to_string(free_port())},
                {"ACCELERATE_BACKEND", ""}});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("process 0 of 2 local 0 type MULTI_CPU backend " + backend));
  EXPECT_THAT(r->out, HasSubstr("process 1 of 2 local 1 type MULTI_CPU backend " + backend));
  EXPECT_THAT(r->out, HasSubstr("trigger seen"));
}

TEST(MpiBackend, OutsideMpirunTheBackEndIsRefusedByName) {
  // Torchrun-style variables, no MPI launcher: MPI must not even be started.
  const int port = free_port();
  std::vector<std::unique_ptr<Running>> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    ranks.push_back(std::make_unique<Running>(
        std::vector<std::string>{worker_bin(), "state"},
        std::map<std::string, std::string>{{"RANK", std::to_string(rank)},
                                           {"WORLD_SIZE", "2"},
                                           {"MASTER_ADDR", "127.0.0.1"},
                                           {"MASTER_PORT", std::to_string(port)},
                                           {"ACCELERATE_BACKEND", "mpi"}}));
  }
  for (auto& r : ranks) {
    r->wait(30);
    EXPECT_NE(r->exit_code(), 0);
    if (is_mpi_available()) {
      EXPECT_THAT(r->err, HasSubstr("backend \"mpi\" needs the processes to be started by mpirun"));
    } else {
      EXPECT_THAT(r->err, HasSubstr("the MPI backend is not available in this build"));
    }
    EXPECT_LT(r->elapsed, 20);
  }
}

TEST(MpiBackend, AHostFileDecidesWhereTheWorkersRunAndMpirunsRefusalIsTheRootCause) {
  TempDir dir;
  const std::string two = (dir.path() / "two").string();
  const std::string one = (dir.path() / "one").string();
  std::ofstream(two) << "localhost slots=2\n";
  std::ofstream(one) << "localhost slots=1\n";
  auto fits = run({accelerate_bin(), "launch", "--mpirun_hostfile", two, "-n", "2", "--main_process_port", "0",
                   worker_bin(), "state"},
                  60);
  if (refused_without_mpi(*fits)) return;
  ASSERT_EQ(fits->exit_code(), 0) << fits->out << fits->err;
  EXPECT_THAT(fits->out, HasSubstr("[rank1]: process 1 of 2 local 1 type MULTI_CPU backend mpi"));
  // Two processes on one slot: mpirun itself refuses, and the launcher says so.
  auto too_many = run({accelerate_bin(), "launch", "--mpirun_hostfile", one, "-n", "2", "--main_process_port", "0",
                       worker_bin(), "state"},
                      60);
  EXPECT_NE(too_many->exit_code(), 0);
  EXPECT_THAT(too_many->err, HasSubstr("[mpirun]: "));
  EXPECT_THAT(too_many->err, HasSubstr("accelerate launch: mpirun (pid "));
  EXPECT_THAT(too_many->out + too_many->err, Not(HasSubstr("process 0 of 2")));
}

// The lines a worker appends to its liveness file (mode "stubborn").
size_t lines_in(const std::string& path) {
  std::ifstream in(path);
  size_t n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

// The launcher's only child: mpirun.
pid_t child_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
  long child = -1;
  in >> child;
  return static_cast<pid_t>(child);
}

// Two MPI workers that ignore SIGTERM, started and past their pid files.
struct StubbornJob {
  TempDir dir;
  Running launcher{{accelerate_bin(), "launch", "--backend", "mpi", "-n", "2", "--main_process_port", "0",
                    "--grace_period", "1", worker_bin(), "stubborn", dir.str()}};
  int pid0 = wait_for_int_file(dir.str() + "/pid_0", 30);
  int pid1 = wait_for_int_file(dir.str() + "/pid_1", 30);
};

TEST(MpiBackend, WhenMpirunIsKilledTheLauncherReturnsOnlyAfterEveryWorkerIsGone) {
  if (!is_mpi_available()) GTEST_SKIP() << "built without MPI: no mpirun to kill";
  StubbornJob job;
  auto& [dir, launcher, pid0, pid1] = job;
  ASSERT_GT(pid0, 0);
  ASSERT_GT(pid1, 0);
  const pid_t mpirun = child_of(launcher.pid());
  ASSERT_GT(mpirun, 0);
  ::kill(mpirun, SIGKILL);
  launcher.wait(30);
  // Both workers ignore SIGTERM: they are gone only because the launcher killed them after the
  // grace period, and before it returned.
  EXPECT_TRUE(process_gone(pid0)) << "worker 0 outlived its launcher";
  EXPECT_TRUE(process_gone(pid1)) << "worker 1 outlived its launcher";
  const size_t lines0 = lines_in(dir.str() + "/alive_0");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(lines_in(dir.str() + "/alive_0"), lines0) << "worker 0 still writes after the launcher returned";
  EXPECT_EQ(launcher.exit_code(), 128 + SIGKILL);
  EXPECT_THAT(launcher.err, HasSubstr("mpirun (pid " + std::to_string(mpirun) + ") was killed by signal 9"));
  EXPECT_THAT(launcher.err, HasSubstr("2 worker(s) still running 1s after SIGTERM; sending SIGKILL"));
}

TEST(MpiBackend, AWorkerWhoseWrapperDiesIsTheRootCauseAndNoShellNoticeIsShown) {
  if (!is_mpi_available()) GTEST_SKIP() << "built without MPI: no wrappers";
  StubbornJob job;
  auto& [dir, launcher, pid0, pid1] = job;
  ASSERT_GT(pid0, 0);
  ASSERT_GT(pid1, 0);
  const pid_t wrapper = parent_of(pid1);
  ASSERT_GT(wrapper, 1);
  ::kill(wrapper, SIGKILL);  // the worker dies with it (its parent-death signal)
  launcher.wait(30);
  EXPECT_TRUE(process_gone(pid0));
  EXPECT_TRUE(process_gone(pid1));
  EXPECT_EQ(launcher.exit_code(), 128 + SIGKILL);
  // Rank 0, which mpirun then stopped, is not blamed.
  EXPECT_THAT(launcher.err, HasSubstr("worker rank 1 (local rank 1, pid " + std::to_string(pid1) +
                                      ") was killed by signal 9 (SIGKILL)"));
  EXPECT_THAT(launcher.err, Not(HasSubstr("worker rank 0")));
  for (const char* notice : {"Terminated", "Killed  ", "]+ ", "]- "}) {
    EXPECT_THAT(launcher.out + launcher.err, Not(HasSubstr(notice)));
  }
}

TEST(MpiBackend, TheLauncherRefusesMpiSettingsItCannotHonour) {
  auto gloo_hostfile = run({accelerate_bin(), "launch", "--backend", "gloo", "--mpirun_hostfile", "/etc/hostname", "-n",
                            "2", worker_bin(), "state"},
                           30);
  EXPECT_EQ(gloo_hostfile->exit_code(), 2);
  EXPECT_THAT(gloo_hostfile->err, HasSubstr("--mpirun_hostfile"));
  if (!is_mpi_available()) return;
  auto missing = run({accelerate_bin(), "launch", "--mpirun_hostfile", "/no/such/hosts", "-n", "2", worker_bin(),
                      "state"},
                     30);
  EXPECT_EQ(missing->exit_code(), 2);
  EXPECT_THAT(missing->err, HasSubstr("--mpirun_hostfile /no/such/hosts is not a readable file"));
  auto machines = run({accelerate_bin(), "launch", "--backend", "mpi", "--num_machines", "2", "--machine_rank", "0",
                       "--main_process_ip", "10.0.0.1", "-n", "4", worker_bin(), "state"},
                      30);
  EXPECT_EQ(machines->exit_code(), 2);
  EXPECT_THAT(machines->err, HasSubstr("needs --mpirun_hostfile"));
}

}  // namespace
}  // namespace accelerate::testing
