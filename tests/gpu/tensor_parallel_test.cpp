// Tensor parallelism on CUDA tensors, in real processes started by `accelerate launch`
// (tests/multiprocess/programs/tensor_parallel.cpp): tp 2, and tp 2 × FULL_SHARD 2, with the
// processes sharing one GPU over Gloo (NCCL refuses two ranks on one device), each ending where
// one process ends on the whole batches, as the CPU tests do.
#include "support/gpu.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

void expect_equal_to_one_process_on_the_gpu(int shard, int tp) {
  const int n = shard * tp;
  auto r = run({accelerate_bin(), "launch", "-n", std::to_string(n), "--main_process_port", "0", "--backend", "gloo",
                "--parallelism_config_dp_shard_size", std::to_string(shard), "--parallelism_config_tp_size",
                std::to_string(tp), built("tests/mp_tensor_parallel")},
               240, {{"CUDA_VISIBLE_DEVICES", visible_gpu(0)}});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("tp=" + std::to_string(tp) + " dp_shard=" + std::to_string(shard) +
                                " dp_replicate=1 (gloo): OK on cuda"))
      << r->out;
}

TEST(CudaTensorParallel, TwoProcessesSharingOneGpuEndWhereOneProcessEnds) {
  SKIP_WITHOUT_GPUS(1);
  expect_equal_to_one_process_on_the_gpu(1, 2);
}

TEST(CudaTensorParallel, TpTimesFullShardOfFourProcessesSharingOneGpuEndsWhereOneProcessEnds) {
  SKIP_WITHOUT_GPUS(1);
  expect_equal_to_one_process_on_the_gpu(2, 2);
}

}  // namespace
}  // namespace accelerate::testing
