// Tensor parallelism in real processes started by `accelerate launch` with the
// --parallelism_config_* flags, on the tier's back-end (MPI, and again on Gloo): tp alone, tp with
// fully sharded data parallelism (2-D), and with replicas of that (3-D) end equal to one process.
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

void expect_equal_to_one_process(int replicate, int shard, int tp) {
  const int n = replicate * shard * tp;
  auto r = run({accelerate_bin(), "launch", "-n", std::to_string(n), "--main_process_port", "0",
                "--num_cpu_threads_per_process", "1", "--parallelism_config_dp_replicate_size",
                std::to_string(replicate), "--parallelism_config_dp_shard_size", std::to_string(shard),
                "--parallelism_config_tp_size", std::to_string(tp), built("tests/mp_tensor_parallel")},
               240);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("tp=" + std::to_string(tp) + " dp_shard=" + std::to_string(shard) +
                                " dp_replicate=" + std::to_string(replicate) + " ("))
      << r->out;
}

TEST(TensorParallelLaunch, TwoProcessesSplittingEveryLayerEndWithTheSingleProcessModel) {
  expect_equal_to_one_process(1, 1, 2);
}

TEST(TensorParallelLaunch, FourProcessesOfTpTimesFsdpEndWithTheSingleProcessModel) {
  expect_equal_to_one_process(1, 2, 2);
}

TEST(TensorParallelLaunch, EightProcessesOfReplicasTimesFsdpTimesTpEndWithTheSingleProcessModel) {
  expect_equal_to_one_process(2, 2, 2);
}

}  // namespace
}  // namespace accelerate::testing
