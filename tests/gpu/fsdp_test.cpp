// Fully sharded data parallelism on CUDA tensors, in real processes started by `accelerate
// launch` (tests/multiprocess/programs/fsdp.cpp): two processes shard the model on the GPU and
// end where one process ends on the whole batches, in fp32 and with bf16 autocast; with
// cpu_offload the shards, their gradients and AdamW's state stay on the CPU; sharded checkpoints
// of GPU (and offloaded) shards resume. With one GPU both processes share it over Gloo (NCCL
// refuses two ranks on one device); with two or more each has its own, over NCCL. Ranks as threads
// cannot do this on one GPU: autograd runs every CUDA backward of a process on one thread per
// device, so the second rank's backward waits behind the first's gather.
#include "support/gpu.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

auto launch_fsdp(const TempDir& dir, std::vector<std::string> flags, const std::string& mode = "") {
  std::vector<std::string> argv = {accelerate_bin(), "launch", "-n", "2", "--main_process_port", "0", "--use_fsdp",
                                   "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                                   "--fsdp_transformer_layer_cls_to_wrap", "Block"};
  if (cuda_device_count() < 2) flags.insert(flags.begin(), {"--backend", "gloo"});
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(built("tests/mp_fsdp"));
  argv.push_back(dir.str());
  if (!mode.empty()) argv.push_back(mode);
  return run(argv, 240);
}

TEST(CudaFsdp, TwoGpuProcessesEndWhereOneProcessEndsInFp32AndBf16) {
  SKIP_WITHOUT_GPUS(1);
  for (const char* precision : {"no", "bf16"}) {
    TempDir dir;
    auto r = launch_fsdp(dir, {"--mixed_precision", precision});
    ASSERT_EQ(r->exit_code(), 0) << precision << "\n" << r->out << r->err;
    EXPECT_THAT(r->out, HasSubstr("[rank0]: fsdp: OK (FULL_SHARD, 2 processes")) << r->out;
  }
}

TEST(CudaFsdp, ShardGradOpOnTwoProcessesSharingOneGpuEndsWhereOneProcessEnds) {
  SKIP_WITHOUT_GPUS(1);
  TempDir dir;
  auto r = launch_fsdp(dir, {"--fsdp_sharding_strategy", "SHARD_GRAD_OP"});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("[rank0]: fsdp: OK (SHARD_GRAD_OP, 2 processes")) << r->out;
}

// HYBRID_SHARD at 4 processes on one GPU: two launchers (machine ranks) of two processes each,
// sharding within each machine and replicating across them, over Gloo.
TEST(CudaFsdp, HybridShardOfFourProcessesOnOneGpuEndsWhereOneProcessEnds) {
  SKIP_WITHOUT_GPUS(1);
  TempDir dir;
  const std::string port = std::to_string(free_port());
  const std::map<std::string, std::string> env = {{"ACCELERATE_RDZV_SECRET", "0123456789abcdef"},
                                                  {"CUDA_VISIBLE_DEVICES", visible_gpu(0)}};
  Running machine0(hybrid_shard_launcher("0", port, dir.str()), env);
  Running machine1(hybrid_shard_launcher("1", port, dir.str()), env);
  machine0.wait(240);
  machine1.wait(240);
  ASSERT_EQ(machine0.exit_code(), 0) << machine0.out << machine0.err;
  ASSERT_EQ(machine1.exit_code(), 0) << machine1.out << machine1.err;
  EXPECT_THAT(machine0.out, HasSubstr("[rank0]: fsdp: OK (HYBRID_SHARD, 4 processes")) << machine0.out;
}

TEST(CudaFsdp, Fp16LossScalingOfGpuShardsEndsWhereOneProcessEnds) {
  SKIP_WITHOUT_GPUS(1);
  // Each process sees only its rows' gradients; the processes agree on overflow before stepping.
  TempDir dir;
  auto r = launch_fsdp(dir, {"--mixed_precision", "fp16"});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("[rank0]: fsdp: OK (FULL_SHARD, 2 processes")) << r->out;
}

TEST(CudaFsdp, CpuOffloadKeepsShardsGradientsAndAdamWStateOnTheCpuAndEndsWhereOneProcessEnds) {
  SKIP_WITHOUT_GPUS(1);
  // The program checks where the shards, their gradients and AdamW's state are (the CPU) after
  // training on the GPU; FULL_SHARD with bf16, and NO_SHARD with accumulation.
  const std::vector<std::vector<std::string>> settings = {
      {"--fsdp_offload_params", "true", "--mixed_precision", "bf16"},
      {"--fsdp_offload_params", "true", "--fsdp_sharding_strategy", "NO_SHARD", "--gradient_accumulation_steps", "2"}};
  for (const auto& flags : settings) {
    TempDir dir;
    auto r = launch_fsdp(dir, flags);
    ASSERT_EQ(r->exit_code(), 0) << flags[3] << "\n" << r->out << r->err;
    EXPECT_THAT(r->out, HasSubstr("[rank0]: fsdp: OK (")) << r->out;
  }
}

TEST(CudaFsdp, ACpuOffloadedShardedCheckpointResumes) {
  SKIP_WITHOUT_GPUS(1);
  TempDir dir;
  const std::vector<std::string> sharded = {"--fsdp_state_dict_type", "SHARDED_STATE_DICT", "--fsdp_offload_params",
                                            "true"};
  auto saved = launch_fsdp(dir, sharded, "save");
  ASSERT_EQ(saved->exit_code(), 0) << saved->out << saved->err;
  auto resumed = launch_fsdp(dir, sharded, "resume");
  ASSERT_EQ(resumed->exit_code(), 0) << resumed->out << resumed->err;
  EXPECT_THAT(resumed->out, HasSubstr("[rank0]: fsdp: OK")) << resumed->out;
}

TEST(CudaFsdp, AShardedCheckpointOfGpuShardsResumes) {
  SKIP_WITHOUT_GPUS(1);
  TempDir dir;
  const std::vector<std::string> sharded = {"--fsdp_state_dict_type", "SHARDED_STATE_DICT"};
  auto saved = launch_fsdp(dir, sharded, "save");
  ASSERT_EQ(saved->exit_code(), 0) << saved->out << saved->err;
  EXPECT_TRUE(std::filesystem::is_regular_file(dir.path() / "checkpoint" / "pytorch_model_fsdp_0" / "index.json"));
  auto resumed = launch_fsdp(dir, sharded, "resume");
  ASSERT_EQ(resumed->exit_code(), 0) << resumed->out << resumed->err;
  EXPECT_THAT(resumed->out, HasSubstr("[rank0]: fsdp: OK")) << resumed->out;
}

}  // namespace
}  // namespace accelerate::testing
