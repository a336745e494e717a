// Tensor parallelism in real processes started by `accelerate launch` with the
// --parallelism_config_* flags, on the tier's back-end (MPI, and again on Gloo): tp alone, tp with
// fully sharded data parallelism (2-D), and with replicas of that (3-D) end equal to one process.
#include "accelerate/utils/safetensors.h"
#include "support/process.h"
#include "support/test_support.h"

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

void expect_equal_to_one_process(int replicate, int shard, int tp, const std::vector<std::string>& args = {},
                                 const std::map<std::string, std::string>& env = {}) {
  const int n = replicate * shard * tp;
  std::vector<std::string> command = {accelerate_bin(), "launch", "-n", std::to_string(n), "--main_process_port", "0",
                                      "--num_cpu_threads_per_process", "1", "--parallelism_config_dp_replicate_size",
                                      std::to_string(replicate), "--parallelism_config_dp_shard_size",
                                      std::to_string(shard), "--parallelism_config_tp_size", std::to_string(tp),
                                      built("tests/mp_tensor_parallel")};
  command.insert(command.end(), args.begin(), args.end());
  auto r = run(command, 240, env);
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

// Each process seeded differently before `prepare`: a dropout on the split MLP's replicated output
// still draws one mask for the group (its processes took process 0's generator at prepare). A
// sequence-parallel dropout draws a mask of its own for each piece of the sequence.
TEST(TensorParallelLaunch, ADropoutOnReplicatedActivationsDrawsOneMaskPerGroup) {
  auto r = run({accelerate_bin(), "launch", "-n", "4", "--main_process_port", "0", "--num_cpu_threads_per_process", "1",
                "--parallelism_config_dp_replicate_size", "2", "--parallelism_config_tp_size", "2",
                built("tests/mp_tensor_parallel"), "--dropout"},
               120);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("tp=2: the dropout masks agree"));
  EXPECT_THAT(r->out, HasSubstr("tp=2: each piece of the sequence draws its own dropout mask"));
}

// A sharded checkpoint of tp 2 x FSDP 2 (each process writes the rows of its pieces) resumes on 2
// processes of tp 2 alone and ends equal to one process; `accelerate merge-weights` joins it into
// whole tensors.
TEST(TensorParallelLaunch, AShardedCheckpointOfTpTimesFsdpResumesOnAnotherMeshAndMergesWhole) {
  TempDir dir;
  const auto ckpt = (dir.path() / "ckpt").string();
  expect_equal_to_one_process(1, 2, 2, {"--save", ckpt}, {{"FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"}});
  ASSERT_TRUE(std::filesystem::exists(ckpt + "/pytorch_model_fsdp_0/shard-1-of-2-tp-1-of-2.safetensors"));
  ASSERT_FALSE(std::filesystem::exists(ckpt + "/model.safetensors"));
  expect_equal_to_one_process(1, 1, 2, {"--resume", ckpt});
  const auto merged = (dir.path() / "merged").string();
  auto r = run({accelerate_bin(), "merge-weights", ckpt + "/pytorch_model_fsdp_0", merged}, 60);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  SafetensorsFile file(merged + "/model.safetensors");
  EXPECT_EQ(file.get_tensor("embed.weight").sizes(), (std::vector<int64_t>{32, 16}));
  EXPECT_EQ(file.get_tensor("blocks.0.fc2.weight").sizes(), (std::vector<int64_t>{16, 32}));
}

}  // namespace
}  // namespace accelerate::testing
