// `accelerate launch` end to end: real worker processes, real signals, real sockets.
#include "accelerate/utils/environment.h"
#include "support/commands.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <sstream>
#include <thread>
#include <tuple>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::vector<std::string> launch(std::vector<std::string> flags, std::vector<std::string> worker_args) {
  std::vector<std::string> argv = {accelerate_bin(), "launch"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(worker_bin());
  argv.insert(argv.end(), worker_args.begin(), worker_args.end());
  return argv;
}

// The secret the launchers of a job on several machines share.
const std::map<std::string, std::string> kJobSecret = {{"ACCELERATE_RDZV_SECRET", "0123456789abcdef"}};

// How many times `pattern` occurs in `text`.
size_t count_of(const std::string& text, const std::string& pattern) {
  const std::regex re(pattern);
  return static_cast<size_t>(std::distance(std::sregex_iterator(text.begin(), text.end(), re), std::sregex_iterator()));
}

// A process's command line, its arguments separated by spaces ("" once it is gone or a zombie).
std::string command_line(pid_t pid) {
  std::string text = read_file("/proc/" + std::to_string(pid) + "/cmdline");
  std::replace(text.begin(), text.end(), '\0', ' ');
  while (!text.empty() && text.back() == ' ') text.pop_back();
  return text;
}

// The notice naming what the workers left behind (later arrivals are named as "N more").
constexpr const char* kLeftoverNotice = "to [0-9]+ process\\(es\\) the workers left behind: ";

std::string port_of(const std::string& out, const std::string& rank_prefix) {
  std::smatch m;
  const std::regex re(rank_prefix + "MASTER_PORT=([0-9]+)");
  return std::regex_search(out, m, re) ? m[1].str() : "";
}

TEST(Launch, EachWorkerSeesTheEnvironmentContract) {
  auto r = run(launch({"--num_processes", "2", "--main_process_port", "0", "--num_cpu_threads_per_process", "1",
                       "--mixed_precision", "bf16", "--gradient_accumulation_steps", "4", "--debug"},
                      {"env", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                       "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "ACCELERATE_MIXED_PRECISION",
                       "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_DEBUG_MODE", "MASTER_PORT"}));
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  for (int rank : {0, 1}) {
    const std::string p = "[rank" + std::to_string(rank) + "]: ";
    EXPECT_THAT(r->out, HasSubstr(p + "RANK=" + std::to_string(rank) + "\n"));
    EXPECT_THAT(r->out, HasSubstr(p + "LOCAL_RANK=" + std::to_string(rank) + "\n"));
    EXPECT_THAT(r->out, HasSubstr(p + "WORLD_SIZE=2\n"));
    EXPECT_THAT(r->out, HasSubstr(p + "LOCAL_WORLD_SIZE=2\n"));
    EXPECT_THAT(r->out, HasSubstr(p + "MASTER_ADDR=127.0.0.1\n"));
    EXPECT_THAT(r->out, HasSubstr(p + "OMP_NUM_THREADS=1\n"));
    EXPECT_THAT(r->out, HasSubstr(p + "OPENBLAS_NUM_THREADS=1\n"));
    EXPECT_THAT(r->out, HasSubstr(p + "ACCELERATE_MIXED_PRECISION=bf16\n"));
    EXPECT_THAT(r->out, HasSubstr(p + "ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4\n"));
    EXPECT_THAT(r->out, HasSubstr(p + "ACCELERATE_DEBUG_MODE=true\n"));
  }
  // Port 0 means "pick one": both workers get the same real port.
  const std::string port0 = port_of(r->out, "\\[rank0\\]: ");
  EXPECT_NE(port0, "");
  EXPECT_NE(port0, "0");
  EXPECT_EQ(port0, port_of(r->out, "\\[rank1\\]: "));
}

TEST(Launch, TwoWorkersRendezvousAndRunCollectives) {
  // With --enable_cpu_affinity each worker also binds itself to a NUMA node on start-up.
  auto r = run(launch({"-n", "2", "--main_process_port", "0", "--enable_cpu_affinity"}, {"state"}));
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  // On one machine the launcher runs CPU jobs on MPI when the build has it; the suite runs again
  // with ACCELERATE_BACKEND=gloo, the launcher's and the workers' default.
  const std::string backend = get_env("ACCELERATE_BACKEND").value_or(is_mpi_available() ? "mpi" : "gloo");
  EXPECT_THAT(r->out, HasSubstr("[rank0]: process 0 of 2 local 0 type MULTI_CPU backend " + backend));
  EXPECT_THAT(r->out, HasSubstr("[rank1]: process 1 of 2 local 1 type MULTI_CPU backend " + backend));
  // The last rank raised the trigger; check_trigger is a collective, so rank 0 sees it too.
  EXPECT_THAT(r->out, HasSubstr("[rank0]: trigger seen"));
  EXPECT_THAT(r->out, HasSubstr("[rank1]: trigger seen"));
}

TEST(Launch, ASingleProcessRunsWithoutAProcessGroup) {
  auto r = run(launch({"--num_processes", "1"}, {"state"}));
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  EXPECT_THAT(r->out, HasSubstr("[rank0]: process 0 of 1 local 0 type NO backend \n"));
}

TEST(Launch, AFailingWorkerStopsTheOthersAndItsExitCodeIsReturned) {
  auto r = run(launch({"-n", "2", "--main_process_port", "0", "--grace_period", "2"}, {"exit", "7", "1"}), 30);
  EXPECT_EQ(r->exit_code(), 7);
  EXPECT_THAT(r->err, HasSubstr("worker rank 1 (local rank 1, pid "));
  EXPECT_THAT(r->err, HasSubstr("exited with code 7"));
  EXPECT_THAT(r->err, HasSubstr("error: Error: worker 1 gives up"));
  EXPECT_THAT(r->err, HasSubstr("stopped the other 1 worker(s)"));
}

TEST(Launch, AWorkerKilledBySigkillIsNamedAsTheRootCause) {
  auto r = run(launch({"-n", "2", "--main_process_port", "0", "--grace_period", "2"}, {"sigkill", "1"}), 30);
  EXPECT_EQ(r->exit_code(), 128 + SIGKILL);
  EXPECT_THAT(r->err, HasSubstr("worker rank 1"));
  EXPECT_THAT(r->err, HasSubstr("killed by signal 9 (SIGKILL)"));
}

TEST(Launch, AWorkerIgnoringSigtermIsKilledAfterTheGracePeriod) {
  TempDir dir;
  auto r = run(launch({"-n", "2", "--main_process_port", "0", "--grace_period", "1"},
                      {"ignore_term", "1", "5", dir.str()}),
               60);
  EXPECT_EQ(r->exit_code(), 5);
  EXPECT_THAT(r->out, HasSubstr("[rank0]: ignoring SIGTERM"));
  EXPECT_THAT(r->err, HasSubstr("worker rank 1 (local rank 1, pid "));
  // The run ended (its output pipes closed), so rank 0 is gone. Its killer: the launcher, after
  // the grace period; or, on the MPI back-end with Open MPI 5, mpirun's own teardown of the job,
  // which sends SIGKILL after its own short delay and can win the race.
  const bool launcher_killed = r->err.find("1 worker(s) still running 1") != std::string::npos &&
                               r->err.find("sending SIGKILL") != std::string::npos;
  const bool mpirun_killed = r->err.find("detected that one or more processes exited") != std::string::npos;
  EXPECT_TRUE(launcher_killed || mpirun_killed) << r->err;
}

TEST(Launch, AnExceptionEscapingMainIsReportedWithItsMessage) {
  auto r = run(launch({"-n", "2", "--main_process_port", "0", "--grace_period", "2"}, {"throw", "1"}), 60);
  EXPECT_EQ(r->exit_code(), 128 + SIGABRT);
  EXPECT_THAT(r->err, HasSubstr("worker rank 1"));
  EXPECT_THAT(r->err, HasSubstr("SIGABRT"));
  EXPECT_THAT(r->err, HasSubstr("error: boom from rank 1"));
}

class LaunchSignal : public ::testing::TestWithParam<int> {};

TEST_P(LaunchSignal, ASignalToTheLauncherIsForwardedToEveryWorker) {
  const int sig = GetParam();
  TempDir dir;
  Running launcher(launch({"-n", "2", "--main_process_port", "0", "--grace_period", "3"}, {"sleep", dir.str()}));
  const int pid0 = wait_for_int_file(dir.str() + "/pid_0", 30);
  const int pid1 = wait_for_int_file(dir.str() + "/pid_1", 30);
  ASSERT_GT(pid0, 0);
  ASSERT_GT(pid1, 0);
  launcher.signal(sig);
  launcher.wait(30);
  EXPECT_EQ(launcher.exit_code(), 128 + sig);
  EXPECT_THAT(launcher.err, HasSubstr("received " + detail::signal_name(sig) + ", forwarding it to 2 worker(s)"));
  EXPECT_TRUE(process_gone(pid0));
  EXPECT_TRUE(process_gone(pid1));
}

INSTANTIATE_TEST_SUITE_P(Signals, LaunchSignal, ::testing::Values(SIGTERM, SIGINT, SIGHUP),
                         [](const auto& info) { return detail::signal_name(info.param); });

// Whether signal `sig` is in the mask `field` ("SigBlk", "ShdPnd") of `pid`'s /proc status (of its
// main thread, for a thread's own mask).
bool in_signal_mask(pid_t pid, const std::string& field, int sig) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind(field + ":", 0) != 0) continue;
    return ((std::strtoull(line.c_str() + field.size() + 1, nullptr, 16) >> (sig - 1)) & 1) != 0;
  }
  return false;
}

// Waits until `in_signal_mask(pid, field, sig)` is `wanted`; false past `seconds`.
bool wait_for_signal_mask(pid_t pid, const std::string& field, int sig, bool wanted, double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (in_signal_mask(pid, field, sig) != wanted) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

// A SIGUSR1 that reaches the launcher while its workers are still starting (before mpirun has
// started the ranks, before a worker has made the Accelerator that handles it) is held and passed
// on once they handle it: they save and stop, as with one that comes later. The delay counts from
// the moment the launcher blocks the signals it handles (before that, SIGUSR1 ends it, as it ends
// any program that does not handle it), which is before it starts any worker.
class LaunchEarlyStop : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(LaunchEarlyStop, ASigusr1BeforeTheWorkersHandleItIsPassedOnOnceTheyDoAndTheySave) {
  const auto& [backend, delay_ms] = GetParam();
  if (backend == "mpi" && !is_mpi_available()) GTEST_SKIP() << "built without MPI";
  TempDir dir;
  Running job({accelerate_bin(), "launch", "--backend", backend, "-n", "2", "--main_process_port", "0",
               "--num_cpu_threads_per_process", "1", built("tests/mp_preemption"), "--dir", dir.str(), "--steps", "12",
               "--mark", "1"});
  ASSERT_TRUE(wait_for_signal_mask(job.pid(), "SigBlk", SIGUSR1, /*wanted=*/true, 30))
      << "the launcher never blocked SIGUSR1";
  std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
  job.signal(SIGUSR1);
  job.wait(180);
  ASSERT_EQ(job.exit_code(), 75) << job.out << job.err;  // accelerate::kPreemptedExitCode
  EXPECT_THAT(job.err, HasSubstr("received SIGUSR1"));
  EXPECT_THAT(job.err, HasSubstr("the job was preempted: 2 of 2 worker(s) saved the state"));
  EXPECT_TRUE(std::filesystem::is_directory(dir.path() / "checkpoints/checkpoint_0")) << job.err;
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "final.safetensors")) << "the job trained to its end";
}

INSTANTIATE_TEST_SUITE_P(Delays, LaunchEarlyStop,
                         ::testing::Combine(::testing::Values("mpi", "gloo"), ::testing::Values(0, 20, 50)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "ms";
                         });

// A SIGUSR1 that comes while an elastic job's launcher waits at the rendezvous (here for the
// second machine that --nnodes 1:2 allows, until last_call_timeout) is kept for the workers it then
// starts, and passed on once they handle it.
TEST(ElasticLaunch, ASigusr1ThatComesWhileTheLauncherWaitsAtTheRendezvousReachesTheWorkersItThenStarts) {
  TempDir dir;
  Running job({accelerate_bin(), "launch", "--nnodes", "1:2", "--rdzv_backend", "c10d", "-n", "4",
               "--main_process_ip", "127.0.0.1", "--main_process_port", std::to_string(free_port()), "--rdzv_conf",
               "last_call_timeout=2", "--num_cpu_threads_per_process", "1", built("tests/mp_preemption"), "--dir",
               dir.str(), "--steps", "12", "--mark", "1"},
              kJobSecret);
  ASSERT_TRUE(wait_for_signal_mask(job.pid(), "SigBlk", SIGUSR1, /*wanted=*/true, 30))
      << "the launcher never blocked SIGUSR1";
  job.signal(SIGUSR1);
  job.wait(180);
  ASSERT_EQ(job.exit_code(), 75) << job.out << job.err;  // accelerate::kPreemptedExitCode
  EXPECT_THAT(job.err, HasSubstr("round 0 of the rendezvous"));
  EXPECT_THAT(job.err, HasSubstr("the job was preempted: 2 of 2 worker(s) saved the state"));
  EXPECT_TRUE(std::filesystem::is_directory(dir.path() / "checkpoints/checkpoint_0")) << job.err;
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "final.safetensors")) << "the job trained to its end";
}

// A program that never handles SIGUSR1 is not killed by one passed on: the launcher holds it and
// says, when the workers have ended, that it never reached them.
TEST(Launch, ASigusr1TheWorkersNeverHandleIsHeldAndNamedWhenTheyEnd) {
  TempDir dir;
  Running launcher(launch({"-n", "2", "--main_process_port", "0"}, {"until_go", dir.str()}));
  ASSERT_GT(wait_for_int_file(dir.str() + "/pid_0", 60), 0);
  ASSERT_GT(wait_for_int_file(dir.str() + "/pid_1", 60), 0);
  launcher.signal(SIGUSR1);
  // Once the launcher has read it (it waits neither for the process nor for its main thread, where
  // a thread that does not block it sends it on), the workers may end.
  ASSERT_TRUE(wait_for_signal_mask(launcher.pid(), "ShdPnd", SIGUSR1, /*wanted=*/false, 60));
  ASSERT_TRUE(wait_for_signal_mask(launcher.pid(), "SigPnd", SIGUSR1, /*wanted=*/false, 60));
  std::ofstream(dir.str() + "/go") << "1\n";
  launcher.wait(60);
  EXPECT_EQ(launcher.exit_code(), 0) << launcher.err;
  EXPECT_THAT(launcher.err, HasSubstr("received SIGUSR1 before the 2 worker(s) handle it; holding it until they do "
                                      "(SIGUSR1 would kill them)"));
  EXPECT_THAT(launcher.err, HasSubstr("SIGUSR1 was not passed on to 2 worker(s) (rank 0, 1): they ended without ever "
                                      "handling it"));
}

TEST(Launch, WorkersDieWhenTheLauncherIsKilledWithSigkill) {
  TempDir dir;
  Running launcher(launch({"-n", "2", "--main_process_port", "0"}, {"sleep", dir.str()}));
  const int pid0 = wait_for_int_file(dir.str() + "/pid_0", 30);
  const int pid1 = wait_for_int_file(dir.str() + "/pid_1", 30);
  ASSERT_GT(pid0, 0);
  ASSERT_GT(pid1, 0);
  // Under mpirun each worker's parent is its wrapper script; else the launcher itself.
  const pid_t parent0 = parent_of(pid0), parent1 = parent_of(pid1);
  launcher.signal(SIGKILL);
  launcher.wait(30);
  EXPECT_EQ(launcher.exit_code(), 128 + SIGKILL);
  EXPECT_TRUE(wait_gone(pid0, 10)) << "worker 0 outlived its launcher";
  EXPECT_TRUE(wait_gone(pid1, 10)) << "worker 1 outlived its launcher";
  EXPECT_TRUE(wait_gone(parent0, 10)) << "the parent of worker 0 outlived the launcher";
  EXPECT_TRUE(wait_gone(parent1, 10)) << "the parent of worker 1 outlived the launcher";
}

TEST(Launch, ProcessesTheWorkersLeaveBehindAreStoppedBeforeTheLauncherReturns) {
  TempDir dir;
  auto r = run(launch({"-n", "2", "--main_process_port", "0", "--grace_period", "1"}, {"orphan", dir.str()}), 30);
  EXPECT_EQ(r->exit_code(), 0) << r->err;
  for (int rank : {0, 1}) {
    const int orphan = wait_for_int_file(dir.str() + "/orphan_" + std::to_string(rank), 1);
    ASSERT_GT(orphan, 0);
    // It ignored SIGTERM and lived in a process group of its own.
    EXPECT_TRUE(process_gone(orphan)) << "the child of rank " << rank << " outlived the launcher: "
                                      << read_file("/proc/" + std::to_string(orphan) + "/stat");
    EXPECT_THAT(r->err, HasSubstr(std::to_string(orphan) + " (mp_worker)")) << "the message names each one";
  }
  EXPECT_THAT(r->err, HasSubstr("sending SIGTERM to 2 process(es) the workers left behind: "));
  EXPECT_THAT(r->err, HasSubstr("2 process(es) the workers left behind still running after SIGTERM; sending SIGKILL"));
  EXPECT_EQ(count_of(r->err, kLeftoverNotice), 1u) << r->err;
}

TEST(Launch, ADaemonInASessionOfItsOwnWithoutTheJobsEnvironmentIsStoppedBeforeTheLauncherReturns) {
  TempDir dir;
  auto r = run(launch({"-n", "2", "--main_process_port", "0", "--grace_period", "1"}, {"daemon", dir.str()}), 30);
  EXPECT_EQ(r->exit_code(), 0) << r->err;
  for (int rank : {0, 1}) {
    const int daemon = wait_for_int_file(dir.str() + "/daemon_" + std::to_string(rank), 1);
    ASSERT_GT(daemon, 0);
    const bool outlived = command_line(daemon) == "sleep 302";
    EXPECT_FALSE(outlived) << "the daemon of rank " << rank << " outlived the launcher";
    if (outlived) ::kill(daemon, SIGKILL);
    EXPECT_EQ(count_of(r->err, "(^|[^0-9])" + std::to_string(daemon) + " \\(sleep\\)"), 1u) << r->err;
  }
  EXPECT_EQ(count_of(r->err, kLeftoverNotice), 1u) << r->err;
}

TEST(Launch, AChildTheLauncherHadBeforeTheJobIsNotTakenForOneOfTheJobs) {
  // A shell that starts a process and then becomes the launcher (`exec`) hands it that child.
  TempDir dir;
  auto argv = launch({"-n", "2", "--main_process_port", "0", "--grace_period", "1"}, {"daemon", dir.str()});
  const std::string script = "sleep 60 >/dev/null 2>&1 & echo $! >" + dir.str() + "/before; exec \"$@\"";
  const std::vector<std::string> shell = {"sh", "-c", script, "sh"};
  argv.insert(argv.begin(), shell.begin(), shell.end());
  auto r = run(argv, 30);
  EXPECT_EQ(r->exit_code(), 0) << r->err;
  const int before = wait_for_int_file(dir.str() + "/before", 1);
  ASSERT_GT(before, 0);
  EXPECT_EQ(command_line(before), "sleep 60") << "the launcher stopped a process that was not the job's";
  EXPECT_EQ(count_of(r->err, "(^|[^0-9])" + std::to_string(before) + " \\("), 0u) << r->err;
  if (command_line(before) == "sleep 60") ::kill(before, SIGKILL);
  // The job's own daemons are still stopped.
  for (int rank : {0, 1}) {
    const int daemon = wait_for_int_file(dir.str() + "/daemon_" + std::to_string(rank), 1);
    const bool outlived = command_line(daemon) == "sleep 302";
    EXPECT_FALSE(outlived) << "the daemon of rank " << rank << " outlived the launcher";
    if (outlived) ::kill(daemon, SIGKILL);
  }
}

TEST(Launch, AfterSigintTheMessagesNameSigintAndTheLeftoversOnce) {
  TempDir dir;
  Running launcher(
      launch({"-n", "2", "--main_process_port", "0", "--grace_period", "1"}, {"orphan_stubborn", dir.str()}));
  ASSERT_GT(wait_for_int_file(dir.str() + "/pid_0", 30), 0);
  ASSERT_GT(wait_for_int_file(dir.str() + "/pid_1", 30), 0);
  launcher.signal(SIGINT);
  launcher.wait(30);
  EXPECT_EQ(launcher.exit_code(), 128 + SIGINT);
  EXPECT_THAT(launcher.err, HasSubstr("received SIGINT, forwarding it to 2 worker(s)"));
  // Both workers ignore SIGINT.
  EXPECT_THAT(launcher.err, HasSubstr("2 worker(s) still running 1s after SIGINT; sending SIGKILL"));
  EXPECT_THAT(launcher.err, Not(HasSubstr("after SIGTERM")));
  // Their children, adopted once the workers were killed, get no second grace period.
  EXPECT_EQ(count_of(launcher.err, kLeftoverNotice), 1u) << launcher.err;
  EXPECT_THAT(launcher.err, HasSubstr("sending SIGKILL to "));
  for (int rank : {0, 1}) {
    const int orphan = wait_for_int_file(dir.str() + "/orphan_" + std::to_string(rank), 1);
    ASSERT_GT(orphan, 0);
    EXPECT_TRUE(process_gone(orphan)) << "the child of rank " << rank << " outlived the launcher";
    EXPECT_EQ(count_of(launcher.err, "(^|[^0-9])" + std::to_string(orphan) + " \\(mp_worker\\)"), 1u) << launcher.err;
  }
}

TEST(Launch, NoShellNoticeReachesTheOutput) {
  auto r = run(launch({"-n", "2", "--main_process_port", "0", "--grace_period", "2"}, {"sigkill", "1"}), 30);
  EXPECT_EQ(r->exit_code(), 128 + SIGKILL);
  for (const char* notice : {"Terminated", "Killed  ", "]+ ", "]- ", "line "}) {
    EXPECT_THAT(r->out + r->err, Not(HasSubstr(notice)));
  }
}

TEST(Launch, MaxRestartsRestartsTheWholeGroupAfterAFailure) {
  auto r = run(launch({"-n", "2", "--main_process_port", "0", "--max_restarts", "1", "--grace_period", "2"},
                      {"fail_once", "1"}),
               60);
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  EXPECT_THAT(r->err, HasSubstr("worker rank 1 (local rank 1"));
  EXPECT_THAT(r->err, HasSubstr("restarting all 2 worker(s) (restart 1 of 1)"));
  EXPECT_THAT(r->out, HasSubstr("[rank0]: attempt 1 ok"));
  EXPECT_THAT(r->out, HasSubstr("[rank1]: attempt 1 ok"));
  EXPECT_THAT(r->out, Not(HasSubstr("attempt 0 ok")));
}

TEST(Launch, WithoutRestartsTheFirstFailureEndsTheJob) {
  auto r = run(launch({"-n", "2", "--main_process_port", "0", "--grace_period", "2"}, {"fail_once", "1"}), 60);
  EXPECT_EQ(r->exit_code(), 3);
  EXPECT_THAT(r->err, Not(HasSubstr("restarting")));
}

TEST(Launch, APortInUseIsNamedInTheError) {
  // Hold a port the way another job would.
  int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  int off = 0;
  ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof(off));
  sockaddr_in6 addr{};
  addr.sin6_family = AF_INET6;
  addr.sin6_addr = in6addr_any;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin6_port);
  auto r = run(launch({"-n", "2", "--main_process_port", std::to_string(port)}, {"state"}), 30);
  ::close(fd);
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_THAT(r->err, HasSubstr("port " + std::to_string(port) + " is already in use"));
  EXPECT_THAT(r->out, Not(HasSubstr("[rank")));  // no worker was started
}

TEST(Launch, APeerThatNeverArrivesFailsWithinTheRendezvousTimeout) {
  // Machine 0 of a two-machine job whose machine 1 never starts.
  const std::string port = std::to_string(free_port());
  auto r = run(launch({"--num_processes", "2", "--num_machines", "2", "--machine_rank", "0", "--main_process_ip",
                       "127.0.0.1", "--main_process_port", port, "--rdzv_timeout", "2"},
                      {"state"}),
               60, kJobSecret);
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_THAT(r->err, HasSubstr("rendezvous timed out after 2s: only 1 of 2 processes joined"));
}

TEST(Launch, AnUnreachableMainProcessFailsWithinTheRendezvousTimeout) {
  // Machine 1 of a job whose machine 0 (the store) is not there.
  const std::string port = std::to_string(free_port());
  auto r = run(launch({"--num_processes", "2", "--num_machines", "2", "--machine_rank", "1", "--main_process_ip",
                       "127.0.0.1", "--main_process_port", port, "--rdzv_timeout", "2"},
                      {"state"}),
               60, kJobSecret);
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_THAT(r->err, HasSubstr("could not reach the rendezvous store at 127.0.0.1:" + port));
}

TEST(Launch, TwoLaunchersFormOneJobAcrossTwoMachineRanks) {
  // The secret both launchers are given, here in a file.
  TempDir dir;
  const std::string secret_file = dir.str() + "/secret";
  std::ofstream(secret_file) << "3f1c0d9e2b7a4c68\n";
  const std::string port = std::to_string(free_port());
  auto flags = [&](const char* machine_rank) {
    return std::vector<std::string>{"--num_processes", "4", "--num_machines", "2", "--machine_rank", machine_rank,
                                    "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                                    "--rdzv_timeout", "30", "--rdzv_secret_file", secret_file};
  };
  Running machine0(launch(flags("0"), {"state"}));
  Running machine1(launch(flags("1"), {"state"}));
  machine0.wait(60);
  machine1.wait(60);
  ASSERT_EQ(machine0.exit_code(), 0) << machine0.err;
  ASSERT_EQ(machine1.exit_code(), 0) << machine1.err;
  EXPECT_THAT(machine0.out, HasSubstr("[rank0]: process 0 of 4 local 0"));
  EXPECT_THAT(machine0.out, HasSubstr("[rank1]: process 1 of 4 local 1"));
  EXPECT_THAT(machine1.out, HasSubstr("[rank2]: process 2 of 4 local 0"));
  EXPECT_THAT(machine1.out, HasSubstr("[rank3]: process 3 of 4 local 1"));
  EXPECT_THAT(machine0.out, HasSubstr("[rank0]: trigger seen"));
}

TEST(Launch, AMachinesLauncherStartedTwiceIsRefusedOnceTheJobIsFullAndLeavesNoScratchFolder) {
  // With restarts, the launcher of machine 1 joins the attempt machine 0 runs, unless that attempt
  // already has all its processes: then it waits up to --rdzv_timeout for the next one, and ends
  // with an error saying why. Its scratch folder (under TMPDIR) goes with it.
  TempDir dir, scratch;
  const std::string port = std::to_string(free_port());
  // The job's workers get a generous rendezvous timeout; the launcher started twice waits 5 s.
  auto flags = [&](const char* machine_rank, const char* rdzv_timeout) {
    return std::vector<std::string>{"--num_processes", "2", "--num_machines", "2", "--machine_rank", machine_rank,
                                    "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                                    "--max_restarts", "1", "--rdzv_timeout", rdzv_timeout, "--grace_period", "1"};
  };
  Running machine0(launch(flags("0", "30"), {"rejoin", dir.str()}), kJobSecret);
  Running machine1(launch(flags("1", "30"), {"rejoin", dir.str()}), kJobSecret);
  ASSERT_GT(wait_for_int_file(dir.str() + "/pid_0", 60), 0) << machine0.err;
  ASSERT_GT(wait_for_int_file(dir.str() + "/pid_1", 60), 0) << machine1.err;
  auto env = kJobSecret;
  env["TMPDIR"] = scratch.str();
  auto twice = run(launch(flags("1", "5"), {"rejoin", dir.str()}), 60, env);
  machine0.signal(SIGTERM);
  machine1.signal(SIGTERM);
  machine0.wait(60);
  machine1.wait(60);
  EXPECT_EQ(twice->exit_code(), 2) << twice->err;
  EXPECT_THAT(twice->err, HasSubstr("[launch] the job's attempt 0 already has all its 2 processes, and the launcher "
                                    "of machine 0 started no other within --rdzv_timeout (5s): it has no restart "
                                    "left (--max_restarts), or this machine's launcher runs twice"));
  EXPECT_THAT(twice->out, Not(HasSubstr("[rank")));
  EXPECT_TRUE(std::filesystem::is_empty(scratch.path())) << "the refused launcher left its scratch folder behind";
  EXPECT_THAT(machine0.err, Not(HasSubstr("restarting"))) << "the refused launcher disturbed the job";
}

// The last line a launcher wrote of its own.
std::string last_launcher_line(const std::string& err) {
  std::istringstream lines(err);
  std::string last;
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("accelerate launch: ", 0) == 0) last = line;
  }
  return last;
}

// Two launchers of a job of two machines, one process each, meeting in barriers; `dir` gets the
// workers' pids.
struct TwoMachineBarriers {
  explicit TwoMachineBarriers(const TempDir& dir)
      : port(std::to_string(free_port())),
        machine0(launch(flags("0"), {"barriers", dir.str(), "60"}), kJobSecret),
        machine1(launch(flags("1"), {"barriers", dir.str(), "60"}), kJobSecret) {}

  std::vector<std::string> flags(const char* machine_rank) const {
    return {"--num_processes", "2", "--num_machines", "2", "--machine_rank", machine_rank, "--main_process_ip",
            "127.0.0.1", "--main_process_port", port, "--rdzv_timeout", "30", "--grace_period", "2"};
  }

  std::string port;
  Running machine0, machine1;
};

TEST(Launch, AStopThatReachesTheOtherMachineAfterItsWorkersFailedIsTheCauseItsLauncherNames) {
  // Note [A stop that reached another machine first]: a scheduler's stop reaches machine 0 first;
  // machine 1's worker fails in its barrier, and the same stop reaches machine 1's launcher
  // moments later. Its last line names the stop, not the failure it caused.
  TempDir dir;
  TwoMachineBarriers job(dir);
  const pid_t worker1 = wait_for_int_file(dir.str() + "/pid_1", 60);
  ASSERT_GT(wait_for_int_file(dir.str() + "/pid_0", 60), 0);
  ASSERT_GT(worker1, 0);
  job.machine0.signal(SIGTERM);
  // Machine 1's launcher has taken its worker's failure in.
  ASSERT_TRUE(wait_reaped(worker1, 30)) << "machine 1's worker outlived machine 0's";
  job.machine1.signal(SIGTERM);
  job.machine0.wait(30);
  job.machine1.wait(30);
  EXPECT_EQ(job.machine0.exit_code(), 128 + SIGTERM);
  EXPECT_EQ(job.machine1.exit_code(), 128 + SIGTERM) << job.machine1.err;
  // The failure is still shown, above the line that says why the job ended.
  EXPECT_THAT(job.machine1.err, HasSubstr("accelerate launch: worker rank 1 (local rank 0"));
  EXPECT_THAT(job.machine1.err, HasSubstr("received SIGTERM while its workers were already stopping"));
  EXPECT_EQ(last_launcher_line(job.machine1.err),
            "accelerate launch: stopped: the launcher received SIGTERM; its 1 worker(s) have ended")
      << job.machine1.err;
}

TEST(Launch, AFailureCausedByAnotherMachineWithNoStopOfItsOwnIsNamedAsTheFailure) {
  // The same failure without a stop for machine 1: after the short window, its launcher ends
  // with the worker's failure as the cause.
  TempDir dir;
  TwoMachineBarriers job(dir);
  ASSERT_GT(wait_for_int_file(dir.str() + "/pid_0", 60), 0);
  ASSERT_GT(wait_for_int_file(dir.str() + "/pid_1", 60), 0);
  job.machine0.signal(SIGTERM);
  job.machine0.wait(30);
  job.machine1.wait(30);
  EXPECT_EQ(job.machine0.exit_code(), 128 + SIGTERM);
  EXPECT_NE(job.machine1.exit_code(), 0);
  EXPECT_NE(job.machine1.exit_code(), 128 + SIGTERM) << job.machine1.err;
  EXPECT_THAT(job.machine1.err, HasSubstr("accelerate launch: worker rank 1 (local rank 0"));
  EXPECT_THAT(job.machine1.err, Not(HasSubstr("stopped: the launcher received")));
}

// A launcher of 2 sleeping workers on Gloo (where each worker is the launcher's own child, so
// reaped means taken in), whose worker 0 is then killed by SIGTERM from outside.
struct SleepersWithOneTerminated {
  explicit SleepersWithOneTerminated(const TempDir& dir)
      : launcher(launch({"-n", "2", "--backend", "gloo", "--main_process_port", "0", "--grace_period", "3"},
                        {"sleep", dir.str()})) {
    pid0 = wait_for_int_file(dir.str() + "/pid_0", 30);
    started = pid0 > 0 && wait_for_int_file(dir.str() + "/pid_1", 30) > 0;
    if (started) ::kill(pid0, SIGTERM);
  }

  // The line that names worker 0's end.
  std::string killed_line() const {
    return "accelerate launch: worker rank 0 (local rank 0, pid " + std::to_string(pid0) +
           ") was killed by signal 15 (SIGTERM)";
  }

  Running launcher;
  pid_t pid0 = -1;
  bool started = false;
};

TEST(Launch, AWorkerStoppedBySigtermJustBeforeItsLauncherIsTheLaunchersStop) {
  // Slurm's scancel signals every process of the job step, the workers as well as the launcher:
  // when a worker's end is reaped before the launcher's own SIGTERM is read, the job still ends
  // as stopped, not as a crash of that worker.
  TempDir dir;
  SleepersWithOneTerminated job(dir);
  ASSERT_TRUE(job.started) << job.launcher.err;
  ASSERT_TRUE(wait_reaped(job.pid0, 30)) << "the launcher did not reap worker 0";
  job.launcher.signal(SIGTERM);
  job.launcher.wait(30);
  EXPECT_EQ(job.launcher.exit_code(), 128 + SIGTERM) << job.launcher.err;
  EXPECT_THAT(job.launcher.err, HasSubstr(job.killed_line()));
  EXPECT_EQ(last_launcher_line(job.launcher.err),
            "accelerate launch: stopped: the launcher received SIGTERM; its 2 worker(s) have ended")
      << job.launcher.err;
}

TEST(Launch, AWorkerKilledBySigtermWithNoStopOfTheLaunchersIsNamedAsTheFailure) {
  TempDir dir;
  SleepersWithOneTerminated job(dir);
  ASSERT_TRUE(job.started) << job.launcher.err;
  job.launcher.wait(30);
  EXPECT_EQ(job.launcher.exit_code(), 128 + SIGTERM) << job.launcher.err;
  EXPECT_THAT(job.launcher.err, HasSubstr(job.killed_line()));
  EXPECT_THAT(job.launcher.err, Not(HasSubstr("stopped: the launcher received")));
}

TEST(Launch, ATemporaryFolderThatCannotBeMadeIsNamedBeforeAnyWorkerStarts) {
  TempDir dir;
  const std::string missing = dir.str() + "/no-such-folder";
  auto r = run(launch({"-n", "2", "--main_process_port", "0"}, {"state"}), 30, {{"TMPDIR", missing}});
  EXPECT_EQ(r->exit_code(), 2) << r->err;
  EXPECT_THAT(r->err,
              HasSubstr("[launch] cannot create a temporary folder in " + missing + ": No such file or directory"));
  EXPECT_THAT(r->out, Not(HasSubstr("[rank")));
}

TEST(Launch, ALauncherWithAnotherSecretIsRefusedAndBothSidesSaySo) {
  const std::string port = std::to_string(free_port());
  auto flags = [&](const char* machine_rank) {
    return std::vector<std::string>{"--num_processes", "4", "--num_machines", "2", "--machine_rank", machine_rank,
                                    "--main_process_ip", "127.0.0.1", "--main_process_port", port,
                                    "--rdzv_timeout", "3", "--grace_period", "1"};
  };
  Running machine0(launch(flags("0"), {"state"}), {{"ACCELERATE_RDZV_SECRET", "the-job"}});
  ASSERT_TRUE(wait_for_port(std::stoi(port), 30));
  Running intruder(launch(flags("1"), {"state"}), {{"ACCELERATE_RDZV_SECRET", "another-job"}});
  intruder.wait(60);
  machine0.wait(60);
  EXPECT_NE(intruder.exit_code(), 0);
  EXPECT_THAT(intruder.err, HasSubstr("the rendezvous store at 127.0.0.1:" + port +
                                      " refused this process: it does not know the job's secret"));
  EXPECT_NE(machine0.exit_code(), 0);
  EXPECT_THAT(machine0.err, HasSubstr("accelerate launch: refused a rendezvous connection from 127.0.0.1:"));
  EXPECT_THAT(machine0.err, HasSubstr("it does not know the job's secret (ACCELERATE_RDZV_SECRET)"));
  EXPECT_THAT(machine0.err, HasSubstr("rendezvous timed out after 3s: only 2 of 4 processes joined"));
}

TEST(Launch, ASeveralMachineJobWithoutASecretIsRefusedBeforeAnythingStarts) {
  auto r = run(launch({"--num_processes", "4", "--num_machines", "2", "--machine_rank", "0", "--main_process_ip",
                       "127.0.0.1", "--main_process_port", "29500"},
                      {"state"}),
               30, {{"ACCELERATE_RDZV_SECRET", ""}});
  EXPECT_EQ(r->exit_code(), 2);
  EXPECT_THAT(r->err, HasSubstr("needs a secret that every machine's launcher knows"));
  EXPECT_THAT(r->out, Not(HasSubstr("[rank")));
}

TEST(Launch, LogDirKeepsEachWorkersOutputInItsOwnFiles) {
  TempDir dir;
  auto r = run(launch({"-n", "2", "--main_process_port", "0", "--log_dir", dir.str(), "--tee", "0"},
                      {"env", "RANK"}));
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  EXPECT_THAT(r->out, Not(HasSubstr("RANK=")));  // --tee 0: nothing on the console
  for (int rank : {0, 1}) {
    std::ifstream in(dir.path() / "attempt_0" / ("rank_" + std::to_string(rank)) / "stdout.log");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text, "RANK=" + std::to_string(rank) + "\n");
  }
}

TEST(Launch, DebugModeMakesEveryWorkerReportAMismatchedCollective) {
  auto r = run(launch({"-n", "2", "--main_process_port", "0", "--debug", "--grace_period", "2"}, {"mismatch"}), 60);
  EXPECT_EQ(r->exit_code(), 3);
  for (const char* rank : {"[rank0]: ", "[rank1]: "}) {
    EXPECT_THAT(r->err, HasSubstr(std::string(rank) + "caught: [gather] debug mode found processes disagreeing"));
  }
  EXPECT_THAT(r->err, HasSubstr("process 0: 1 tensor(s): dtype Float device cpu shape [3]"));
  EXPECT_THAT(r->err, HasSubstr("process 1: 1 tensor(s): dtype Float device cpu shape [4]"));
}

TEST(Launch, AMissingProgramIsAClearError) {
  auto r = run({accelerate_bin(), "launch", "-n", "2", "no-such-program-here"}, 30);
  EXPECT_EQ(r->exit_code(), 2);
  EXPECT_THAT(r->err, HasSubstr("the program 'no-such-program-here' was not found in PATH"));
}

TEST(Launch, AnUnknownFlagIsAClearError) {
  auto r = run({accelerate_bin(), "launch", "--num_procs", "2", worker_bin(), "state"}, 30);
  EXPECT_EQ(r->exit_code(), 2);
  EXPECT_THAT(r->err, HasSubstr("--num_procs"));
}

TEST(Launch, HelpListsTheFlagsAndSucceeds) {
  auto r = run({accelerate_bin(), "launch", "--help"}, 30);
  EXPECT_EQ(r->exit_code(), 0);
  EXPECT_THAT(r->out, HasSubstr("--num_processes"));
  EXPECT_THAT(r->out, HasSubstr("--max_restarts"));
}

}  // namespace
}  // namespace accelerate::testing
