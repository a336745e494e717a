// Process-group settings (InitProcessGroupKwargs) and rendezvous through ranks as threads.
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

TEST(InitProcessGroupKwargs, TheTimeoutEndsABarrierThatAPeerNeverReaches) {
  std::atomic<bool> rank0_done{false};
  std::string error;
  PartialStateOptions options;
  options.init_kwargs.timeout = std::chrono::seconds(1);
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
