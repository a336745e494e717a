// GPU jobs started by `accelerate launch --multi_gpu`, in real processes: one process trains on
// the GPU and ends with the model of the CPU baseline; two processes on two GPUs rendezvous over
// NCCL, reproduce single-process training on the combined batch (upstream's equivalence check,
// tests/multiprocess/programs/training.cpp) and name a model that differs between them. Skips
// without enough GPUs.
#include "support/gpu.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

std::vector<std::string> launch_on_gpus(int processes, const std::vector<std::string>& program) {
  std::vector<std::string> argv = {
      accelerate_bin(),      "launch", "--multi_gpu", "--num_processes", std::to_string(processes),
      "--main_process_port", "0"};
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

TEST(GpuLaunch, OneProcessTrainsOnTheGpuAndEndsWithTheCpuBaselinesModel) {
  SKIP_WITHOUT_GPUS(1);
  const std::vector<std::string> modes = {"plain", "bf16", "seedable"};
  std::vector<std::string> program = {built("tests/mp_training")};
  program.insert(program.end(), modes.begin(), modes.end());
  auto r = run(launch_on_gpus(1, program), 180);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  for (const auto& mode : modes) EXPECT_THAT(r->out, HasSubstr("[rank0]: " + mode + ": OK")) << r->out;
}

TEST(GpuLaunch, TwoWorkersOnTwoGpusRendezvousOverNcclAndSeeEachOthersTrigger) {
  SKIP_WITHOUT_GPUS(2);
  auto r = run(launch_on_gpus(2, {worker_bin(), "state"}), 120);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("[rank0]: process 0 of 2 local 0 type MULTI_GPU backend nccl"));
  EXPECT_THAT(r->out, HasSubstr("[rank1]: process 1 of 2 local 1 type MULTI_GPU backend nccl"));
  EXPECT_THAT(r->out, HasSubstr("[rank0]: trigger seen"));
  EXPECT_THAT(r->out, HasSubstr("[rank1]: trigger seen"));
}

TEST(GpuLaunch, TwoGpuProcessesEndWithTheSingleProcessModelInEveryMode) {
  SKIP_WITHOUT_GPUS(2);
  const std::vector<std::string> modes = {"plain", "split_batches", "bf16", "seedable"};
  std::vector<std::string> program = {built("tests/mp_training")};
  program.insert(program.end(), modes.begin(), modes.end());
  auto r = run(launch_on_gpus(2, program), 240);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  for (const auto& mode : modes) EXPECT_THAT(r->out, HasSubstr("[rank0]: " + mode + ": OK")) << r->out;
}

// Two processes sharing one GPU (NCCL refuses two ranks on one device; Gloo stages CUDA tensors
// through host memory) reproduce single-process training, as on two GPUs.
TEST(GpuLaunch, TwoProcessesSharingOneGpuOverGlooEndWithTheSingleProcessModelInEveryMode) {
  SKIP_WITHOUT_GPUS(1);
  const std::vector<std::string> modes = {"plain", "split_batches", "bf16", "seedable"};
  std::vector<std::string> argv = {accelerate_bin(), "launch", "--num_processes", "2", "--backend", "gloo",
                                   "--main_process_port", "0", built("tests/mp_training")};
  argv.insert(argv.end(), modes.begin(), modes.end());
  auto r = run(argv, 240, {{"CUDA_VISIBLE_DEVICES", visible_gpu(0)}});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  for (const auto& mode : modes) EXPECT_THAT(r->out, HasSubstr("[rank0]: " + mode + ": OK")) << r->out;
}

TEST(GpuLaunch, AModelThatDiffersBetweenGpuProcessesFailsTheLaunchNamingTheDifference) {
  SKIP_WITHOUT_GPUS(2);
  auto r = run(launch_on_gpus(2, {built("tests/mp_training"), "mismatch"}), 120);
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_THAT(r->err, HasSubstr("the model differs between processes: process 0 has parameter weight [1, 2]"))
      << r->out << r->err;
}

}  // namespace
}  // namespace accelerate::testing
