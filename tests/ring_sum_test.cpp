// The ring that sums the DDP compression hooks' 16-bit buckets over Gloo (detail::RingSum), with
// ranks as threads over real Gloo process groups: exact sums with two processes, the same bits on
// every process with three and four, tensors shorter than the ring, several tensors in the order
// given, the bytes counted, and a peer that never sends named within the timeout.
#include "accelerate/state.h"
#include "accelerate/utils/communication.h"
#include "detail/collective_watch.h"
#include "detail/ring_sum.h"
#include "detail/state_impl.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

namespace accelerate::testing {
namespace {

// Process `rank`'s values: different on every process, some of them negative, none exact sums.
torch::Tensor values_of(int rank, int64_t length, torch::ScalarType type) {
  auto x = torch::linspace(-3.0, 5.0, length, torch::kDouble) * (1.0 + 0.37 * rank) + 0.011 * rank;
  return x.sin().mul(1.0 + rank).to(type);
}

struct RingCase {
  int processes;
  torch::ScalarType type;
};

class RingSums : public ::testing::TestWithParam<RingCase> {};

TEST_P(RingSums, EveryProcessEndsWithTheSameSumOfEveryProcesssValues) {
  const auto [processes, type] = GetParam();
  const std::vector<int64_t> lengths{1, 2, 1001, 65536};
  std::mutex mutex;
  std::vector<std::vector<torch::Tensor>> results(static_cast<size_t>(processes));
  uint64_t before = 0, after = 0;
  run_ranks(processes, [&](const PartialState& state) {
    auto group = detail::process_group(state, "test");
    detail::RingSum ring(group, 0, std::chrono::seconds(20), "test");
    std::vector<torch::Tensor> tensors;
    for (auto length : lengths) tensors.push_back(values_of(state.process_index(), length, type));
    state.wait_for_everyone();
    if (state.is_main_process()) before = communication_counters().bytes_sent;
    state.wait_for_everyone();
    // All four handed over before the first is waited for: they are summed in that order.
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    for (auto& t : tensors) futures.push_back(ring.sum(t));
    for (size_t i = 0; i < futures.size(); ++i) {
      futures[i]->wait();
      ASSERT_FALSE(futures[i]->hasError()) << futures[i]->tryRetrieveErrorMessage();
      EXPECT_TRUE(futures[i]->value().toTensor().is_same(tensors[i])) << "the sum is not in place";
    }
    state.wait_for_everyone();
    if (state.is_main_process()) after = communication_counters().bytes_sent;
    std::lock_guard<std::mutex> lock(mutex);
    results[static_cast<size_t>(state.process_index())] = tensors;
  });
  uint64_t expected_bytes = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    torch::Tensor exact = torch::zeros({lengths[i]}, torch::kDouble);
    for (int r = 0; r < processes; ++r) exact += values_of(r, lengths[i], type).to(torch::kDouble);
    const auto& first = results[0][i];
    EXPECT_EQ(first.scalar_type(), type);
    for (int r = 1; r < processes; ++r) {
      EXPECT_TRUE(torch::equal(results[static_cast<size_t>(r)][i], first))
          << "process " << r << " differs from process 0 at length " << lengths[i];
    }
    if (processes == 2) {
      // One addition of two 16-bit values, rounded once: the exact sum, rounded.
      EXPECT_TRUE(torch::equal(first, exact.to(torch::kFloat).to(type))) << "length " << lengths[i];
    } else {
      // One rounding per addition: within a few units in the last place of the exact sum.
      const double unit = type == torch::kHalf ? 1.0 / 1024 : 1.0 / 128;
      const auto error = (first.to(torch::kDouble) - exact).abs();
      const auto bound = exact.abs().clamp_min(1.0) * (processes * unit);
      EXPECT_TRUE((error <= bound).all().item<bool>())
          << "length " << lengths[i] << ": largest error " << error.max().item<double>();
    }
    expected_bytes += static_cast<uint64_t>(processes) *
                      detail::all_reduce_sent(processes, static_cast<uint64_t>(lengths[i]) * 2);
  }
  // Each process counts 2 (p - 1) / p of each tensor's bytes; the threads share the counters.
  EXPECT_EQ(after - before, expected_bytes);
}

INSTANTIATE_TEST_SUITE_P(Processes, RingSums,
                         ::testing::Values(RingCase{2, torch::kHalf}, RingCase{2, torch::kBFloat16},
                                           RingCase{3, torch::kHalf}, RingCase{3, torch::kBFloat16},
                                           RingCase{4, torch::kHalf}, RingCase{4, torch::kBFloat16}),
                         [](const auto& info) {
                           return std::to_string(info.param.processes) + "Processes" +
                                  (info.param.type == torch::kHalf ? "Fp16" : "Bf16");
                         });

// Two models with compression hooks: two rings on one process group, summing at the same time,
// each with its own messages.
TEST(RingSum, TwoRingsOnOneGroupSumTheirOwnTensors) {
  std::mutex mutex;
  std::vector<torch::Tensor> firsts(3), seconds(3);
  run_ranks(3, [&](const PartialState& state) {
    auto group = detail::process_group(state, "test");
    detail::RingSum one(group, 0, std::chrono::seconds(20), "test"), two(group, 1, std::chrono::seconds(20), "test");
    const int r = state.process_index();
    auto a = torch::full({4099}, 1.0 + r, torch::kHalf), b = torch::full({4099}, 10.0 * (r + 1), torch::kHalf);
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    for (int i = 0; i < 4; ++i) {  // interleaved: the rings' threads run side by side
      futures.push_back(one.sum(a.narrow(0, 0, 4099 - i)));
      futures.push_back(two.sum(b.narrow(0, 0, 4099 - i)));
    }
    for (auto& f : futures) {
      f->wait();
      ASSERT_FALSE(f->hasError()) << f->tryRetrieveErrorMessage();
    }
    std::lock_guard<std::mutex> lock(mutex);
    firsts[static_cast<size_t>(r)] = a;
    seconds[static_cast<size_t>(r)] = b;
  });
  // Four sums in place of the prefixes: the first 4096 elements were summed four times (sums of
  // integers below 2048, exact in fp16).
  const auto head = [](const torch::Tensor& t) { return t.narrow(0, 0, 4096).to(torch::kFloat); };
  double a = 1 + 2 + 3, b = 10 + 20 + 30;
  for (int i = 1; i < 4; ++i) a *= 3, b *= 3;
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(torch::equal(head(firsts[static_cast<size_t>(r)]), torch::full({4096}, a)))
        << "process " << r << ": the first ring's sums took other messages";
    EXPECT_TRUE(torch::equal(head(seconds[static_cast<size_t>(r)]), torch::full({4096}, b)))
        << "process " << r << ": the second ring's sums took other messages";
  }
}

TEST(RingSum, APeerThatNeverSendsIsAnErrorWithinTheTimeout) {
  std::string first, second;
  std::atomic<bool> given_up{false};
  run_ranks(2, [&](const PartialState& state) {
    if (state.process_index() == 0) {
      [&] {
        detail::RingSum ring(detail::process_group(state, "test"), 0, std::chrono::seconds(2),
                             "DistributedDataParallel");
        auto future = ring.sum(torch::ones({1000}, torch::kHalf));
        future->wait();
        ASSERT_TRUE(future->hasError()) << "the sum completed without its peer";
        first = future->tryRetrieveErrorMessage();
        // The ring no longer knows where its peers are: a later sum fails at once, alike.
        auto later = ring.sum(torch::ones({10}, torch::kHalf));
        later->wait();
        ASSERT_TRUE(later->hasError());
        second = later->tryRetrieveErrorMessage();
      }();
    }
    // Process 1 never sums; it waits for process 0 to have given up, outside the process group
    // (Gloo closes a pair whose message timed out: the group is broken for good, as it is when a
    // collective times out).
    if (state.process_index() == 0) {
      given_up = true;
    } else {
      while (!given_up) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
  for (const char* part : {"[DistributedDataParallel] the ring sum of a compressed gradient bucket failed on process 0 of 2",
                           "sending to process 1", "did not arrive within 2s"}) {
    EXPECT_NE(first.find(part), std::string::npos) << part << " is missing from: " << first;
  }
  EXPECT_NE(second.find("failed on process 0 of 2"), std::string::npos) << second;
}

}  // namespace
}  // namespace accelerate::testing
