// Fully sharded training in real processes started by `accelerate launch` (on MPI, and again on
// Gloo with the tier's second run): every sharding strategy at 2 and 4 processes, gradient
// accumulation, bf16 autocast, activation checkpointing and a config file with
// `distributed_type: FSDP` end where one process ends on the whole batches; a wrong setting fails
// the launch naming it.
#include "support/commands.h"
#include "support/process.h"
#include "support/test_support.h"

#include <ATen/Functions.h>
#include <torch/version.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

struct Job {
  const char* name;
  std::vector<std::string> flags;
  std::string says = "fsdp: OK";  // what the main process prints
  std::map<std::string, std::string> env = {};
};

void PrintTo(const Job& job, std::ostream* out) { *out << job.name; }

class FsdpLaunch : public ::testing::TestWithParam<Job> {};

TEST_P(FsdpLaunch, EndsWhereOneProcessEndsOnTheWholeBatches) {
  TempDir dir;
  std::vector<std::string> argv = {accelerate_bin(), "launch", "--main_process_port", "0"};
  argv.insert(argv.end(), GetParam().flags.begin(), GetParam().flags.end());
  argv.push_back(built("tests/mp_fsdp"));
  argv.push_back(dir.str());
  auto r = run(argv, 240, GetParam().env);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("[rank0]: " + GetParam().says)) << r->out;
}

// Of the model's 540566 parameters, a process sharding over 2 holds 270308 and over 4, 135179.
INSTANTIATE_TEST_SUITE_P(
    Jobs, FsdpLaunch,
    ::testing::Values(
        Job{"FullShardTwoBlocks", {"-n", "2", "--use_fsdp", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                                   "--fsdp_transformer_layer_cls_to_wrap", "Block"}},
        Job{"FullShardFourProcesses", {"-n", "4", "--use_fsdp", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                                       "--fsdp_transformer_layer_cls_to_wrap", "Block"}},
        Job{"ShardGradOpFourProcesses", {"-n", "4", "--fsdp_sharding_strategy", "SHARD_GRAD_OP"}},
        Job{"NoShardTwoProcesses", {"-n", "2", "--fsdp_sharding_strategy", "NO_SHARD", "--fsdp_auto_wrap_policy",
                                    "SIZE_BASED_WRAP", "--fsdp_min_num_params", "700"}},
        Job{"Version2Accumulation", {"-n", "2", "--use_fsdp", "--fsdp_version", "2", "--fsdp_reshard_after_forward",
                                     "true", "--gradient_accumulation_steps", "2", "--fsdp_auto_wrap_policy",
                                     "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Block"}},
        Job{"Bf16Autocast", {"-n", "2", "--use_fsdp", "--mixed_precision", "bf16", "--fsdp_auto_wrap_policy",
                             "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Block"}},
        Job{"Bf16Accumulation", {"-n", "2", "--use_fsdp", "--mixed_precision", "bf16", "--gradient_accumulation_steps",
                                 "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                                 "--fsdp_transformer_layer_cls_to_wrap", "Block"}},
        Job{"Bf16ReducedInFp32Accumulation",
            {"-n", "2", "--use_fsdp", "--mixed_precision", "bf16", "--gradient_accumulation_steps", "2",
             "--fsdp_activation_checkpointing", "true", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
             "--fsdp_transformer_layer_cls_to_wrap", "Block"},
            "fsdp: OK",
            {{"MP_FSDP_REDUCE_DTYPE", "fp32"}}},
        Job{"CpuOffloadNoShardAndAccumulation",
            {"-n", "2", "--use_fsdp", "--fsdp_offload_params", "true", "--fsdp_sharding_strategy", "NO_SHARD",
             "--gradient_accumulation_steps", "2"}},
        Job{"CpuOffloadFourProcesses", {"-n", "4", "--use_fsdp", "--fsdp_offload_params", "true",
                                        "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                                        "--fsdp_transformer_layer_cls_to_wrap", "Block"}},
        Job{"ActivationCheckpointingBf16",
            {"-n", "2", "--use_fsdp", "--fsdp_activation_checkpointing", "true", "--mixed_precision", "bf16",
             "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Block"}},
        Job{"ActivationCheckpointingAccumulation",
            {"-n", "2", "--use_fsdp", "--fsdp_activation_checkpointing", "true", "--gradient_accumulation_steps", "2",
             "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Block"}},
        Job{"HybridTwoReplicasOfTwoShards",
            {"-n", "4", "--use_fsdp", "--use_parallelism_config", "--parallelism_config_dp_replicate_size", "2",
             "--parallelism_config_dp_shard_size", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
             "--fsdp_transformer_layer_cls_to_wrap", "Block"},
            "fsdp: OK (FULL_SHARD, 4 processes, 270308 of 540566 parameters"},
        Job{"PrefetchingFourProcesses", {"-n", "4", "--use_fsdp", "--fsdp_backward_prefetch", "BACKWARD_PRE",
                                         "--fsdp_forward_prefetch", "true", "--fsdp_auto_wrap_policy",
                                         "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "Block"}},
        Job{"FullShardFourProcessesHoldAQuarter", {"-n", "4", "--use_fsdp"},
            "fsdp: OK (FULL_SHARD, 4 processes, 135179 of 540566 parameters"},
        Job{"HybridZero2Accumulation",
            {"-n", "4", "--fsdp_sharding_strategy", "_HYBRID_SHARD_ZERO2", "--parallelism_config_dp_replicate_size",
             "2", "--gradient_accumulation_steps", "2"},
            "fsdp: OK (_HYBRID_SHARD_ZERO2, 4 processes, 270308 of 540566 parameters"}),
    [](const ::testing::TestParamInfo<Job>& info) { return std::string(info.param.name); });

TEST(FsdpLaunch, AConfigFileWithDistributedTypeFsdpShardsTheModel) {
  TempDir dir;
  const auto config = write_file(dir, "fsdp.yaml",
             "distributed_type: FSDP\nuse_cpu: true\nnum_processes: 2\nfsdp_config:\n"
             "  fsdp_sharding_strategy: FULL_SHARD\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
             "  fsdp_transformer_layer_cls_to_wrap: Block\n");
  auto r = run({accelerate_bin(), "launch", "--config_file", config, "--main_process_port", "0",
                built("tests/mp_fsdp"), dir.str()},
               240);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("[rank0]: fsdp: OK (FULL_SHARD, 2 processes")) << r->out;
}

// With fp16 parameters and reduction and the loss scaled as a GradScaler scales it, a process's
// own gradient (the mean over its rows) once passed 65504 in the backward pass where one process's
// on the whole batch did not, and the job skipped a step that one process took (Note [Dividing an
// fp16 sum]). The program checks every step's skip against one process computing in fp16.
TEST(FsdpLaunch, ALossScaledFp16JobSkipsTheStepsOneProcessSkips) {
  try {
    (void)at::mm(at::ones({2, 2}, at::kHalf), at::ones({2, 2}, at::kHalf));
  } catch (const c10::Error&) {
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION_MAJOR << "." << TORCH_VERSION_MINOR << " has no fp16 matrix product on the CPU; the Debian 13 tier "
                 << "(LibTorch 2.6) runs this test";
  }
  for (const char* n : {"2", "4"}) {
    TempDir dir;
    auto r = run({accelerate_bin(), "launch", "-n", n, "--main_process_port", "0", "--use_fsdp",
                  "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap",
                  "Block", built("tests/mp_fsdp"), dir.str()},
                 240, {{"MP_FSDP_FP16", "1"}});
    ASSERT_EQ(r->exit_code(), 0) << n << " processes\n" << r->out << r->err;
    EXPECT_THAT(r->out, HasSubstr(std::string("[rank0]: fsdp: OK (FULL_SHARD, ") + n + " processes")) << r->out;
  }
}

TEST(FsdpLaunch, AShardedCheckpointOfFourProcessesResumesOnTwo) {
  TempDir dir;
  const std::vector<std::string> fsdp = {"--main_process_port", "0", "--use_fsdp", "--fsdp_state_dict_type",
                                         "SHARDED_STATE_DICT", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                                         "--fsdp_transformer_layer_cls_to_wrap", "Block"};
  const auto launch = [&](const char* n, const char* mode) {
    std::vector<std::string> argv = {accelerate_bin(), "launch", "-n", n};
    argv.insert(argv.end(), fsdp.begin(), fsdp.end());
    argv.insert(argv.end(), {built("tests/mp_fsdp"), dir.str(), mode});
    return run(argv, 240);
  };
  auto saved = launch("4", "save");
  ASSERT_EQ(saved->exit_code(), 0) << saved->out << saved->err;
  EXPECT_TRUE(std::filesystem::is_regular_file(dir.path() / "checkpoint" / "pytorch_model_fsdp_0" /
                                               "shard-3-of-4.safetensors"));
  auto resumed = launch("2", "resume");
  ASSERT_EQ(resumed->exit_code(), 0) << resumed->out << resumed->err;
  EXPECT_THAT(resumed->out, HasSubstr("[rank0]: fsdp: OK (FULL_SHARD, 2 processes")) << resumed->out;
}

TEST(FsdpLaunch, AHybridShardedCheckpointIsWrittenByOneReplicaAndResumesOnTwoProcesses) {
  TempDir dir;
  const std::vector<std::string> fsdp = {"--main_process_port", "0", "--use_fsdp", "--fsdp_state_dict_type",
                                         "SHARDED_STATE_DICT"};
  std::vector<std::string> save = {accelerate_bin(), "launch", "-n", "4", "--parallelism_config_dp_replicate_size", "2"};
  save.insert(save.end(), fsdp.begin(), fsdp.end());
  save.insert(save.end(), {built("tests/mp_fsdp"), dir.str(), "save"});
  auto saved = run(save, 240);
  ASSERT_EQ(saved->exit_code(), 0) << saved->out << saved->err;
  const auto shards = dir.path() / "checkpoint" / "pytorch_model_fsdp_0";
  EXPECT_TRUE(std::filesystem::is_regular_file(shards / "shard-1-of-2.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(shards / "shard-0-of-4.safetensors"));
  std::vector<std::string> resume = {accelerate_bin(), "launch", "-n", "2"};
  resume.insert(resume.end(), fsdp.begin(), fsdp.end());
  resume.insert(resume.end(), {built("tests/mp_fsdp"), dir.str(), "resume"});
  auto resumed = run(resume, 240);
  ASSERT_EQ(resumed->exit_code(), 0) << resumed->out << resumed->err;
  EXPECT_THAT(resumed->out, HasSubstr("[rank0]: fsdp: OK (FULL_SHARD, 2 processes")) << resumed->out;
}

TEST(FsdpLaunch, HybridShardShardsWithinEachOfTwoMachinesAndReplicatesAcrossThem) {
  // Two launchers, one per machine rank, of two processes each (on Gloo: MPI jobs have one launcher).
  TempDir dir;
  const std::string port = std::to_string(free_port());
  const std::map<std::string, std::string> secret = {{"ACCELERATE_RDZV_SECRET", "0123456789abcdef"}};
  Running machine0(hybrid_shard_launcher("0", port, dir.str()), secret);
  Running machine1(hybrid_shard_launcher("1", port, dir.str()), secret);
  machine0.wait(240);
  machine1.wait(240);
  ASSERT_EQ(machine0.exit_code(), 0) << machine0.out << machine0.err;
  ASSERT_EQ(machine1.exit_code(), 0) << machine1.out << machine1.err;
  EXPECT_THAT(machine0.out, HasSubstr("[rank0]: fsdp: OK (HYBRID_SHARD, 4 processes, 270308 of 540566 parameters"))
      << machine0.out;
}

TEST(FsdpLaunch, ActivationCheckpointingWithoutWrappedUnitsFailsTheLaunchNamingIt) {
  TempDir dir;
  auto r = run({accelerate_bin(), "launch", "-n", "2", "--main_process_port", "0", "--use_fsdp",
                "--fsdp_activation_checkpointing", "true", built("tests/mp_fsdp"), dir.str()},
               120);
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_THAT(r->err, HasSubstr("activation_checkpointing recomputes the forward of each unit that "
                                "auto_wrap_policy wraps, and the policy wraps no submodule")) << r->err;
}

TEST(FsdpLaunch, AUnitWhoseModuleIsCalledDirectlyFailsTheBackwardNamingIt) {
  // 500 makes each small block's Linear a unit, which the block calls as fc(x), past its hook (the
  // last block calls its own through accelerate::forward).
  TempDir dir;
  auto r = run({accelerate_bin(), "launch", "-n", "2", "--main_process_port", "0", "--fsdp_sharding_strategy",
                "NO_SHARD", "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP", "--fsdp_min_num_params", "500",
                built("tests/mp_fsdp"), dir.str()},
               120);
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_THAT(r->err, HasSubstr("the parameters of unit blocks.1.fc got gradients")) << r->err;
  EXPECT_THAT(r->err, HasSubstr("accelerate::forward")) << r->err;
}

}  // namespace
}  // namespace accelerate::testing
