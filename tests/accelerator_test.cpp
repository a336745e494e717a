// The Accelerator's process control and collectives, with ranks as threads.
#include "accelerate/accelerator.h"
#include "support/accelerators.h"
#include "support/test_support.h"

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

// Runs `fn` with an Accelerator per rank, each over its own standalone state.
void run_accelerators(int n, const std::function<void(const Accelerator&)>& fn, AcceleratorOptions base = {}) {
  testing::run_accelerators(n, [&](const Accelerator& acc, int) { fn(acc); }, std::move(base));
}

TEST(Accelerator, ReportsItsTopologyAndMixedPrecision) {
  AcceleratorOptions options;
  options.mixed_precision = "bf16";
  run_accelerators(2, [](const Accelerator& acc) {
    EXPECT_EQ(acc.num_processes(), 2);
    EXPECT_EQ(acc.is_main_process(), acc.process_index() == 0);
    EXPECT_EQ(acc.is_last_process(), acc.process_index() == 1);
    EXPECT_EQ(acc.distributed_type(), DistributedType::kMultiCpu);
    EXPECT_EQ(acc.mixed_precision(), "bf16");
    EXPECT_TRUE(acc.device().is_cpu());
    EXPECT_TRUE(acc.sync_gradients());
  }, options);
}

TEST(Accelerator, ReduceDefaultsToSumUnlikeTheFreeFunction) {
  run_accelerators(2, [](const Accelerator& acc) {
    auto t = at::full({2}, static_cast<float>(acc.process_index() + 1));
    EXPECT_EQ(acc.reduce(t).sum().item<float>(), 6.0f);      // [3, 3]
    EXPECT_EQ(acc.reduce(t, "mean").sum().item<float>(), 3.0f);
  });
}

TEST(Accelerator, GatherAndPadAcrossProcesses) {
  run_accelerators(2, [](const Accelerator& acc) {
    auto t = at::arange(acc.process_index() + 1, at::kFloat);  // lengths 1 and 2
    auto padded = acc.pad_across_processes(t);
    EXPECT_EQ(padded.size(0), 2);
    EXPECT_EQ(acc.gather(padded).size(0), 4);
  });
}

TEST(Accelerator, GatherForMetricsDropsDuplicatesOnTheLastBatchForTensorsAndValues) {
  run_accelerators(2, [](const Accelerator& acc) {
    const auto& gs = acc.gradient_state();
    gs.set_end_of_dataloader(true);
    gs.set_remainder(3);
    auto tensors = acc.gather_for_metrics(at::full({2}, static_cast<float>(acc.process_index())));
    EXPECT_EQ(tensors.size(0), 3);
    auto labels = acc.gather_for_metrics(std::vector<std::string>{"a" + std::to_string(acc.process_index()), "b"});
    EXPECT_EQ(labels, (std::vector<std::string>{"a0", "b", "a1"}));
    auto as_objects = acc.gather_for_metrics(std::vector<at::Tensor>{at::ones({1})}, /*use_gather_object=*/true);
    EXPECT_EQ(as_objects.size(), 2u);  // one per process, fewer than the remainder
    gs.set_end_of_dataloader(false);
    EXPECT_EQ(acc.gather_for_metrics(at::ones({2})).size(0), 4);  // not the last batch: nothing dropped
  });
}

TEST(Accelerator, GatherRefusesNonTensorValuesNamingTheType) {
  run_accelerators(1, [](const Accelerator& acc) {
    std::pair<at::Tensor, std::string> data{at::ones({1}), "id"};
    EXPECT_THROWS_WITH(acc.gather(data), "[gather] unsupported type (std::__cxx11::basic_string");
    EXPECT_THROWS_WITH(acc.gather_for_metrics(data, /*use_gather_object=*/true), "use_gather_object needs a std::vector");
  });
}

TEST(Accelerator, ProcessControlForwardsToTheState) {
  std::atomic<int> ran{0};
  run_accelerators(2, [&](const Accelerator& acc) {
    acc.on_main_process([&] { ++ran; })();
    auto share = acc.split_between_processes(std::vector<int>{1, 2, 3});
    EXPECT_EQ(share.size(), acc.process_index() == 0 ? 2u : 1u);
    EXPECT_EQ(acc.main_process_first([&] { return acc.process_index() * 10; }), acc.process_index() * 10);
    if (acc.process_index() == 1) acc.set_trigger();
    EXPECT_TRUE(acc.check_trigger());
  });
  EXPECT_EQ(ran.load(), 1);
}

TEST(Accelerator, ABadMixedPrecisionIsRefused) {
  AcceleratorOptions options;
  options.mixed_precision = "fp8";
  EXPECT_THROWS_WITH(run_accelerators(1, [](const Accelerator&) {}, options), "fp8 mixed precision is not supported");
}

}  // namespace
}  // namespace accelerate::testing
