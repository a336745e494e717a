// Process-group settings (InitProcessGroupKwargs) and rendezvous through ranks as threads.
#include "detail/process_group.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

TEST(LostMachines, AFailedCollectiveNamesTheProcessesOfEachAddressItMentions) {
  const std::vector<std::string> addresses = {"10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2", "10.0.0.3"};
  EXPECT_EQ(detail::name_lost_machines(addresses, "Read error [10.0.0.2]:41234: Connection reset by peer"),
            "; 10.0.0.2 is the machine of processes 2 and 3");
  EXPECT_EQ(detail::name_lost_machines(addresses, "[10.0.0.3]:1 closed; [10.0.0.1]:2 and [10.0.0.3]:3 too"),
            "; 10.0.0.3 is the machine of process 4; 10.0.0.1 is the machine of processes 0 and 1");
  EXPECT_EQ(detail::name_lost_machines({"a", "b", "c", "b", "b"}, "lost [b]:9"),
            "; b is the machine of processes 1, 3 and 4");
  // Nothing to add: an address of no process, no address, or no table (one machine).
  EXPECT_EQ(detail::name_lost_machines(addresses, "Read error [10.0.0.9]:1: reset"), "");
  EXPECT_EQ(detail::name_lost_machines(addresses, "Timed out waiting 5000ms for recv"), "");
  EXPECT_EQ(detail::name_lost_machines({}, "Read error [10.0.0.2]:1: reset"), "");
}

TEST(InitProcessGroupKwargs, TheTimeoutEndsABarrierThatAPeerNeverReaches) {
  std::atomic<bool> rank0_done{false};
  std::string error;
  PartialStateOptions options;
  options.init_kwargs.timeout = std::chrono::seconds(3);  // also bounds the group's making, slow under TSan
  run_ranks(
      2,
      [&](const PartialState& state) {
        if (state.process_index() == 0) {
          error = error_of([&] { state.wait_for_everyone(); });
          rank0_done = true;
        } else {
          // Stay alive (connections open) without entering the barrier, so only the timeout
          // can end rank 0's wait.
          const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
          while (!rank0_done && std::chrono::steady_clock::now() < give_up) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
        }
      },
      options);
  EXPECT_THAT(error, HasSubstr("[wait_for_everyone] process 0 of 2 failed while waiting for the others"));
  EXPECT_THAT(error, ::testing::ContainsRegex("[Tt]imed out"));
}

TEST(InitProcessGroupKwargs, AnUnknownBackendIsRefusedByName) {
  PartialStateOptions options;
  options.init_kwargs.backend = "carrier-pigeon";
  EXPECT_THROWS_WITH(run_ranks(2, [](const PartialState&) {}, options), "unknown process-group backend \"carrier-pigeon\"");
}

TEST(InitProcessGroupKwargs, NcclOnCpuProcessesIsRefused) {
  PartialStateOptions options;
  options.cpu = true;
  options.init_kwargs.backend = "nccl";
  EXPECT_THROWS_WITH(run_ranks(2, [](const PartialState&) {}, options), "backend \"nccl\" needs CUDA devices");
}

TEST(InitProcessGroupKwargs, GlooIsTheDefaultForCpuProcesses) {
  std::vector<std::string> backends(2);
  run_ranks(2, [&](const PartialState& state) { backends[state.process_index()] = state.backend(); });
  EXPECT_EQ(backends, (std::vector<std::string>{"gloo", "gloo"}));
}

}  // namespace
}  // namespace accelerate::testing
