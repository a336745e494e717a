// Process-group settings (InitProcessGroupKwargs) and rendezvous through ranks as threads.
#include "detail/process_group.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

namespace accelerate::testing {
namespace {

using ::testing::ElementsAre;
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

std::string error_of_or_empty(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return detail::error_text(e);
  }
  return {};
}

// Two ranks as threads that meet only where `init_method` says (no store of the test's own).
std::vector<std::string> meet_at(const std::string& init_method, std::optional<int> master_port = std::nullopt) {
  std::vector<std::string> errors(2);
  run_threads(2, [&](int rank) {
    errors[rank] = error_of_or_empty([&] {
      PartialStateOptions options;
      options.cpu = true;
      options.process_index = rank;
      options.num_processes = 2;
      options.master_port = master_port;
      options.rdzv_timeout = std::chrono::seconds(20);
      options.init_kwargs.init_method = init_method;
      const auto state = PartialState::standalone(options);
      auto sum = accelerate::reduce(state, torch::tensor({static_cast<float>(rank + 1)}), "sum");
      EXPECT_EQ(sum.item<float>(), 3.f);
    });
  });
  return errors;
}

TEST(InitProcessGroupKwargs, InitMethodTcpNamesWhereTheProcessesMeet) {
  const int port = free_port();
  int other = free_port();
  while (other == port) other = free_port();
  // The options' port is not where the store is served: the URL's is.
  EXPECT_THAT(meet_at("tcp://127.0.0.1:" + std::to_string(port), other), ElementsAre("", ""));
}

TEST(InitProcessGroupKwargs, InitMethodFileMeetsThroughAFile) {
  TempDir dir;
  const auto file = (dir.path() / "rendezvous").string();
  EXPECT_THAT(meet_at("file://" + file), ElementsAre("", ""));
}

TEST(InitProcessGroupKwargs, BadInitMethodsAreRefusedByName) {
  for (const auto& [url, message] : std::vector<std::pair<std::string, std::string>>{
           {"etcd://host:2379", "is not supported; use env://, tcp://<host>:<port> or file:///<path>"},
           {"tcp://127.0.0.1", "must be tcp://<host>:<port>"},
           {"tcp://127.0.0.1:99999", "the port must be a number from 1 to 65535"},
           {"tcp://127.0.0.1:29500?rank=0&world_size=2", "a query (rank, world_size) is not taken"},
           {"file://relative/path", "must be file:///<absolute path>"}}) {
    const auto errors = meet_at(url);
    EXPECT_THAT(errors[0], HasSubstr(message)) << url;
    EXPECT_THAT(errors[0], HasSubstr(url)) << "the error names the URL";
  }
  PartialStateOptions options;
  options.init_kwargs.init_method = "tcp://127.0.0.1:29511";
  EXPECT_THROWS_WITH(run_ranks(2, [](const PartialState&) {}, options), "both say where to meet");
}

}  // namespace
}  // namespace accelerate::testing
