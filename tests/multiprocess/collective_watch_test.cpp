// The collective watch end to end (Note [The collective watch] in
// src/detail/collective_watch.cpp): jobs in which some processes skip a collective end within
// seconds on every process, naming what each one does, on Gloo and MPI, with and without debug
// mode; a slow process is warned about and the job completes; a process that ends its program is
// named. The check delay is 1 s here, so each job takes seconds.
#include "accelerate/utils/environment.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const std::map<std::string, std::string> kOneSecondDelay{{"ACCELERATE_COLLECTIVE_CHECK_SECONDS", "1"}};

std::vector<std::string> launch(const std::string& backend, int processes, std::vector<std::string> extra,
                                std::vector<std::string> program_args) {
  std::vector<std::string> argv = {accelerate_bin(), "launch", "--backend", backend, "-n", std::to_string(processes),
                                   "--main_process_port", "0", "--num_cpu_threads_per_process", "1"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back(built("tests/mp_skipped_collective"));
  argv.insert(argv.end(), program_args.begin(), program_args.end());
  return argv;
}

bool skip_mpi(const std::string& backend) { return backend == "mpi" && !is_mpi_available(); }

// The launcher's last lines: the root cause, then the teardown.
std::string launcher_report(const Running& r) {
  const auto at = r.err.rfind("accelerate launch: worker rank ");
  return at == std::string::npos ? std::string() : r.err.substr(at);
}

class SkippedGather : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// Process n-1 waits for everyone while the others gather: every process raises naming both.
TEST_P(SkippedGather, EndsWithinSecondsNamingWhatEachProcessDoes) {
  const auto& [backend, n] = GetParam();
  if (skip_mpi(backend)) GTEST_SKIP() << "this build has no MPI";
  const int skipper = n - 1;
  auto r = run(launch(backend, n, {}, {"gather", std::to_string(skipper)}), 120, kOneSecondDelay);
  EXPECT_NE(r->exit_code(), 0) << r->out << r->err;
  const std::string all = r->out + r->err;
  EXPECT_THAT(all, HasSubstr("barrier #2 from wait_for_everyone"));
  EXPECT_THAT(all, HasSubstr("all_gather #2"));
  const std::string report = launcher_report(*r);
  EXPECT_THAT(report, ::testing::ContainsRegex("error: \\[(gather|wait_for_everyone)\\] (the processes wait in "
                                               "different collectives|process(es)? [0-9, ]+ ended)"))
      << r->err;
  EXPECT_THAT(report, Not(HasSubstr("a peer died"))) << r->err;
  EXPECT_LT(r->elapsed, 60);  // the group's timeout is 1800 s
}

INSTANTIATE_TEST_SUITE_P(Backends, SkippedGather,
                         ::testing::Combine(::testing::Values("gloo", "mpi"), ::testing::Values(2, 4)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) +
                                  "Processes";
                         });

class SkippedStateDict : public ::testing::TestWithParam<std::string> {};

// Under FULL_SHARD only the main process asks for the whole state dict, a gather of the FSDP
// engine named with the call it came from; the others wait for everyone.
TEST_P(SkippedStateDict, EndsWithinSecondsNamingTheEnginesGatherAndTheBarrier) {
  const std::string backend = GetParam();
  if (skip_mpi(backend)) GTEST_SKIP() << "this build has no MPI";
  auto r = run(launch(backend, 2, {"--use_fsdp"}, {"state_dict"}), 120, kOneSecondDelay);
  EXPECT_NE(r->exit_code(), 0) << r->out << r->err;
  const std::string all = r->out + r->err;
  // On MPI the barrier may complete against the engine's fifth gather; its sixth is then named.
  EXPECT_THAT(all, ::testing::ContainsRegex("all_gather #[56] from get_state_dict \\(FullyShardedDataParallel\\)"));
  EXPECT_THAT(all, HasSubstr("barrier #5 from wait_for_everyone"));
  EXPECT_THAT(launcher_report(*r), Not(HasSubstr("a peer died"))) << r->err;
  EXPECT_LT(r->elapsed, 60);
}

INSTANTIATE_TEST_SUITE_P(Backends, SkippedStateDict, ::testing::Values("gloo", "mpi"),
                         [](const auto& info) { return info.param; });

class SkippedBackward : public ::testing::TestWithParam<std::string> {};

// The DDP reducer's bucket allreduce, waited for inside the backward pass, on one process, and a
// barrier on the other: the backward pass raises too, naming both (Note [Watched bucket
// allreduces] in src/distributed.cpp).
TEST_P(SkippedBackward, EndsWithinSecondsNamingTheReducersAllreduceAndTheBarrier) {
  const std::string backend = GetParam();
  if (skip_mpi(backend)) GTEST_SKIP() << "this build has no MPI";
  auto r = run(launch(backend, 2, {}, {"backward", "1"}), 120, kOneSecondDelay);
  EXPECT_NE(r->exit_code(), 0) << r->out << r->err;
  const std::string all = r->out + r->err;
  // MPI may match the allreduce with the barrier (wrong data, see the watch's Note): process 0
  // then ends its program after it, and that is what the others name.
  EXPECT_THAT(all, HasSubstr(backend == "gloo" ? "process 0: all_reduce #3 from backward (DistributedDataParallel)"
                                               : "process 0: ended its program after all_reduce #3"));
  EXPECT_THAT(all, HasSubstr("process 1: barrier #3 from wait_for_everyone"));
  EXPECT_THAT(launcher_report(*r), Not(HasSubstr("a peer died"))) << r->err;
  EXPECT_LT(r->elapsed, 60);
}

INSTANTIATE_TEST_SUITE_P(Backends, SkippedBackward, ::testing::Values("gloo", "mpi"),
                         [](const auto& info) { return info.param; });

class SkippedCollectiveInDebugMode : public ::testing::TestWithParam<std::string> {};

// Debug mode checks the barrier too: both sides are named before either collective starts.
TEST_P(SkippedCollectiveInDebugMode, RaisesOnEveryProcessWithBothSides) {
  const std::string backend = GetParam();
  if (skip_mpi(backend)) GTEST_SKIP() << "this build has no MPI";
  auto r = run(launch(backend, 2, {"--debug"}, {"gather", "1"}), 120, {{"ACCELERATE_COLLECTIVE_CHECK_SECONDS", "0"}});
  EXPECT_NE(r->exit_code(), 0) << r->out << r->err;
  const std::string all = r->out + r->err;
  EXPECT_THAT(all, HasSubstr("debug mode found processes disagreeing on a collective"));
  EXPECT_THAT(all, HasSubstr("process 0: 1 tensor(s): dtype Float device cpu shape [4], from gather"));
  EXPECT_THAT(all, HasSubstr("process 1: barrier, from wait_for_everyone"));
  EXPECT_THAT(launcher_report(*r), HasSubstr("debug mode found processes disagreeing")) << r->err;
}

TEST_P(SkippedCollectiveInDebugMode, TheStateDictOfTheMainProcessAloneIsNamed) {
  const std::string backend = GetParam();
  if (skip_mpi(backend)) GTEST_SKIP() << "this build has no MPI";
  auto r = run(launch(backend, 2, {"--debug", "--use_fsdp"}, {"state_dict"}), 120,
               {{"ACCELERATE_COLLECTIVE_CHECK_SECONDS", "0"}});
  EXPECT_NE(r->exit_code(), 0) << r->out << r->err;
  const std::string all = r->out + r->err;
  EXPECT_THAT(all, HasSubstr("debug mode found processes disagreeing on a collective"));
  EXPECT_THAT(all, HasSubstr("from get_state_dict (FullyShardedDataParallel)"));
  EXPECT_THAT(all, HasSubstr("process 1: barrier, from wait_for_everyone"));
}

INSTANTIATE_TEST_SUITE_P(Backends, SkippedCollectiveInDebugMode, ::testing::Values("gloo", "mpi"),
                         [](const auto& info) { return info.param; });

class SameSizePair : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

// An all-reduce on one process and a broadcast of the same size on the other: a pair MPI could
// match by size. Neither back-end completes it with wrong data: by default the watch names both
// sides, in debug mode the check before the collective does.
TEST_P(SameSizePair, IsNamedAndNeverCompletesWithWrongData) {
  const auto& [backend, debug] = GetParam();
  if (skip_mpi(backend)) GTEST_SKIP() << "this build has no MPI";
  auto r = run(launch(backend, 2, debug ? std::vector<std::string>{"--debug"} : std::vector<std::string>{},
                      {"pair", "1"}),
               120, kOneSecondDelay);
  EXPECT_NE(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, Not(HasSubstr("got "))) << "a process completed the pair";
  const std::string all = r->out + r->err;
  if (debug) {
    EXPECT_THAT(all, HasSubstr("process 0: 1 tensor(s): dtype Float device cpu shape [4], from reduce"));
    EXPECT_THAT(all, HasSubstr("process 1: 1 tensor(s): dtype Float device cpu shape [4], from broadcast"));
  } else {
    EXPECT_THAT(all, HasSubstr("process 0: all_reduce #2 from reduce; process 1: broadcast #2 from broadcast"));
  }
  EXPECT_THAT(launcher_report(*r), Not(HasSubstr("a peer died"))) << r->err;
  EXPECT_LT(r->elapsed, 60);
}

INSTANTIATE_TEST_SUITE_P(Backends, SameSizePair,
                         ::testing::Combine(::testing::Values("gloo", "mpi"), ::testing::Bool()),
                         [](const auto& info) {
                           return std::get<0>(info.param) + (std::get<1>(info.param) ? "_Debug" : "_Default");
                         });

// `check_trigger` is a collective of the library like the others: skipped by one process, it is
// named.
TEST(CollectiveWatch, ASkippedTriggerCheckIsNamed) {
  auto r = run(launch("gloo", 2, {}, {"trigger", "1"}), 120, kOneSecondDelay);
  EXPECT_NE(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(launcher_report(*r), HasSubstr("process 0: all_reduce #2 from check_trigger; process 1: barrier #2 "
                                             "from wait_for_everyone"))
      << r->err;
}

// A main process that sleeps (a long save) while the other waits at a barrier is slow, not
// wrong: a warning names it, the job completes.
TEST(CollectiveWatch, ASlowProcessIsWarnedAboutAndTheJobCompletes) {
  auto r = run(launch("gloo", 2, {}, {"slow", "8"}), 120, kOneSecondDelay);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("[rank0]: done"));
  EXPECT_THAT(r->out, HasSubstr("[rank1]: done"));
  const std::string all = r->out + r->err;
  EXPECT_THAT(all, HasSubstr("[wait_for_everyone] process 1 has waited"));
  EXPECT_THAT(all, HasSubstr("in barrier #2 from wait_for_everyone for process 0, which is in no collective yet"));
}

// A process stopped (SIGSTOP) while the other waits at a barrier is warned about, and the job
// goes on once it is continued.
TEST(CollectiveWatch, AStoppedProcessIsWarnedAboutAndTheJobGoesOnOnceItIsContinued) {
  TempDir dir;
  const auto pid_file = dir.path() / "pid";
  Running job(launch("gloo", 2, {}, {"stopped", "1", pid_file.string()}), kOneSecondDelay);
  pid_t pid = 0;
  for (int i = 0; i < 600 && pid == 0; ++i) {
    std::ifstream in(pid_file);
    if (!(in >> pid)) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_NE(pid, 0) << "the worker never wrote its pid";
  // Long enough for the first warnings (at 1 s and 2 s of waiting) on a loaded machine.
  std::this_thread::sleep_for(std::chrono::seconds(8));
  ::kill(pid, SIGCONT);
  job.wait(120);
  ASSERT_EQ(job.exit_code(), 0) << job.out << job.err;
  EXPECT_THAT(job.out, HasSubstr("[rank0]: done"));
  EXPECT_THAT(job.out, HasSubstr("[rank1]: done"));
  EXPECT_THAT(job.out + job.err, HasSubstr("in barrier #2 from wait_for_everyone for process 1, which is in no "
                                           "collective yet (slow, busy or stopped"));
}

// A process that returns from main while the other waits at a barrier is named.
TEST(CollectiveWatch, AProcessThatEndedItsProgramIsNamed) {
  auto r = run(launch("gloo", 2, {}, {"ended", "1"}), 120, kOneSecondDelay);
  EXPECT_NE(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(launcher_report(*r), HasSubstr("error: [wait_for_everyone] process 1 ended its program while the "
                                             "others wait in a collective"))
      << r->err;
  EXPECT_THAT(r->err, HasSubstr("process 0: barrier #2 from wait_for_everyone"));
  EXPECT_THAT(r->err, HasSubstr("process 1: ended its program after barrier #1"));
}

}  // namespace
}  // namespace accelerate::testing
