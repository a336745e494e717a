// The `accelerate config` command: the questionnaire, `config default`, `config update`
// (commands/config.h), in process and through the real binary.
#include "accelerate/commands/config.h"

#include "accelerate/utils/environment.h"
#include "support/process.h"
#include "support/commands.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

namespace accelerate::testing {
namespace {

using commands::ClusterConfig;
using commands::config_main;
using commands::get_user_input;
using commands::load_config_from_file;
using ::testing::HasSubstr;
using ::testing::Not;

// `accelerate config <args>` in process, with `input` as its standard input.
CommandOutcome run_config(const std::vector<std::string>& args, const std::string& input = "") {
  return run_command(config_main, args, input);
}

// Answers: multi-CPU, 1 machine (default), no debug (default), no FSDP (default), 4 processes,
// bf16 by name.
constexpr const char* kMultiCpuAnswers = "1\n\n\n\n4\nbf16\n";

constexpr const char* kMultiCpuYaml = R"(compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: false
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
)";

// ---- the questionnaire ----------------------------------------------------------------------

TEST(ConfigQuestionnaire, PipedAnswersToTheBinaryWriteTheExpectedYaml) {
  TempDir dir;
  const std::string answers = write_file(dir, "answers.txt", kMultiCpuAnswers);
  const std::string path = (dir.path() / "nested" / "default_config.yaml").string();
  auto r = run({"/bin/sh", "-c", accelerate_bin() + " config --config_file " + path + " < " + answers});
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_EQ(read_file(path), kMultiCpuYaml);
  EXPECT_THAT(r->out, HasSubstr("accelerate configuration saved at " + path));
  EXPECT_THAT(r->out, HasSubstr("How many processes should be used for distributed training? [1]: 4\n"));
}

TEST(ConfigQuestionnaire, TheDefaultLocationIsUsedWithoutConfigFile) {
  TempDir dir;
  auto env = patch_environment({{"HF_HOME", dir.str()}});
  const CommandOutcome outcome = run_config({}, kMultiCpuAnswers);
  ASSERT_EQ(outcome.code, 0) << outcome.err;
  const std::string path = dir.str() + "/accelerate/default_config.yaml";
  EXPECT_EQ(read_file(path), kMultiCpuYaml);
  EXPECT_THAT(outcome.out, HasSubstr("accelerate configuration saved at " + path));
}

TEST(ConfigQuestionnaire, EmptyAnswersTakeTheDefaults) {
  std::istringstream in("\n\n\n\n\n");
  std::ostringstream out;
  const ClusterConfig config = get_user_input(in, out);
  EXPECT_EQ(config.distributed_type, DistributedType::kNo);
  EXPECT_FALSE(config.use_cpu);
  EXPECT_EQ(config.gpu_ids, std::optional<std::string>("all"));
  EXPECT_FALSE(config.enable_cpu_affinity);
  EXPECT_EQ(config.mixed_precision, "no");
  EXPECT_EQ(config.num_processes, 1);
}

TEST(ConfigQuestionnaire, ChoicesAreAcceptedByNumberAndByName) {
  for (const std::string type : {"1", "multi-CPU", "MULTI_CPU", "Multi-cpu"}) {
    std::istringstream in(type + "\n\n\n\n2\n2\n");
    std::ostringstream out;
    const ClusterConfig config = get_user_input(in, out);
    EXPECT_EQ(config.distributed_type, DistributedType::kMultiCpu) << type;
    EXPECT_EQ(config.num_processes, 2) << type;
    EXPECT_EQ(config.mixed_precision, "bf16") << type;
  }
}

TEST(ConfigQuestionnaire, AnInvalidAnswerIsAskedAgainWithAMessage) {
  // "x" and "7" are not machine types, "two" not a number, "maybe" not yes/no, "fp8" not offered.
  std::istringstream in("x\n7\n1\n\nmaybe\nno\n\ntwo\n0\n3\nfp8\nbf16\n");
  std::ostringstream out;
  const ClusterConfig config = get_user_input(in, out);
  EXPECT_EQ(config.distributed_type, DistributedType::kMultiCpu);
  EXPECT_EQ(config.num_processes, 3);
  EXPECT_EQ(config.mixed_precision, "bf16");
  const std::string text = out.str();
  EXPECT_THAT(text, HasSubstr("Please enter a number from 0 to 2 or one of: No distributed training, multi-CPU, "
                              "multi-GPU."));
  EXPECT_THAT(text, HasSubstr("Please enter yes or no."));
  EXPECT_THAT(text, HasSubstr("Please enter an integer."));
  EXPECT_THAT(text, HasSubstr("Please enter an integer from 1 to"));
  EXPECT_THAT(text, HasSubstr("Please enter a number from 0 to 2 or one of: no, fp16, bf16."));
  // The machine type question was asked three times.
  size_t asked = 0;
  for (size_t at = text.find("Which type of machine"); at != std::string::npos;
       at = text.find("Which type of machine", at + 1)) {
    ++asked;
  }
  EXPECT_EQ(asked, 3u);
}

TEST(ConfigQuestionnaire, MultiMachineAnswersAreAllRecorded) {
  TempDir dir;
  const std::string path = (dir.path() / "c.yaml").string();
  // multi-GPU, 2 machines, rank 1, address, port, other networks, c10d, debug, no FSDP, 8 GPUs, ids 0,1,
  // no NUMA binding, fp16.
  const CommandOutcome outcome =
      run_config({"--config_file", path}, "2\n2\n1\n10.0.0.1\n29500\nno\nc10d\nyes\nno\n8\n0,1\nno\nfp16\n");
  ASSERT_EQ(outcome.code, 0) << outcome.err;
  EXPECT_EQ(read_file(path), R"(compute_environment: LOCAL_MACHINE
debug: true
distributed_type: MULTI_GPU
downcast_bf16: false
enable_cpu_affinity: false
gpu_ids: '0,1'
machine_rank: 1
main_process_ip: 10.0.0.1
main_process_port: 29500
main_training_function: main
mixed_precision: fp16
num_machines: 2
num_processes: 8
rdzv_backend: c10d
same_network: false
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
)");
  const ClusterConfig loaded = load_config_from_file(path);
  EXPECT_EQ(loaded.machine_rank, 1);
  EXPECT_EQ(loaded.gpu_ids, std::optional<std::string>("0,1"));
}

TEST(ConfigQuestionnaire, FullyShardedAnswersWriteAnFsdpConfigThatLoadsBack) {
  TempDir dir;
  // multi-CPU, defaults, FSDP: version 1, SHARD_GRAD_OP, CPU offload, transformer-based units of Block,
  // BACKWARD_POST, sharded state dicts, forward prefetch, no efficient loading, synchronised states
  // (default), activation checkpointing; 4 processes, bf16.
  const std::string path = (dir.path() / "fsdp.yaml").string();
  const CommandOutcome outcome = run_config(
      {"--config_file", path}, "1\n\n\nyes\n1\nSHARD_GRAD_OP\nyes\n0\nBlock\nBACKWARD_POST\n2\nyes\n\n\nyes\n4\nbf16\n");
  ASSERT_EQ(outcome.code, 0) << outcome.err;
  EXPECT_THAT(read_file(path), HasSubstr("distributed_type: FSDP\n"));
  const ClusterConfig loaded = load_config_from_file(path);
  EXPECT_TRUE(loaded.use_fsdp);
  EXPECT_EQ(loaded.num_processes, 4);
  EXPECT_EQ(loaded.fsdp_config, (std::map<std::string, std::string>{
                                    {"fsdp_activation_checkpointing", "true"},
                                    {"fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"},
                                    {"fsdp_backward_prefetch", "BACKWARD_POST"},
                                    {"fsdp_cpu_ram_efficient_loading", "false"},
                                    {"fsdp_forward_prefetch", "true"},
                                    {"fsdp_offload_params", "true"},
                                    {"fsdp_sharding_strategy", "SHARD_GRAD_OP"},
                                    {"fsdp_state_dict_type", "SHARDED_STATE_DICT"},
                                    {"fsdp_sync_module_states", "true"},
                                    {"fsdp_transformer_layer_cls_to_wrap", "Block"},
                                    {"fsdp_version", "1"}}));

  // Version 2 (the default): reshard_after_forward instead of a strategy; size-based units;
  // efficient loading implies synchronised states without asking; an empty class list is refused.
  std::istringstream in("1\n\n\nyes\n\nno\n\nSIZE_BASED_WRAP\n5000\n\nyes\n\n\n2\nno\n");
  std::ostringstream out;
  const ClusterConfig second = get_user_input(in, out);
  EXPECT_EQ(second.fsdp_config.at("fsdp_version"), "2");
  EXPECT_EQ(second.fsdp_config.at("fsdp_reshard_after_forward"), "false");
  EXPECT_EQ(second.fsdp_config.at("fsdp_offload_params"), "false");
  EXPECT_EQ(second.fsdp_config.count("fsdp_sharding_strategy"), 0u);
  EXPECT_EQ(second.fsdp_config.at("fsdp_min_num_params"), "5000");
  EXPECT_EQ(second.fsdp_config.at("fsdp_state_dict_type"), "FULL_STATE_DICT");
  EXPECT_EQ(second.fsdp_config.at("fsdp_sync_module_states"), "true");
  EXPECT_EQ(second.fsdp_config.at("fsdp_activation_checkpointing"), "false");
  EXPECT_THAT(out.str(), Not(HasSubstr("sync_module_states)?")));
  EXPECT_EQ(second.num_processes, 2);
  EXPECT_TRUE(second.parallelism_config.empty());

  std::istringstream empty_classes("1\n\n\nyes\n\n\n\n0\n\nBlock\n\n\n\n\n\n2\nno\n");
  std::ostringstream asked_again;
  EXPECT_EQ(get_user_input(empty_classes, asked_again).fsdp_config.at("fsdp_transformer_layer_cls_to_wrap"), "Block");
  EXPECT_THAT(asked_again.str(), HasSubstr("An answer is required."));
}

TEST(ConfigQuestionnaire, HybridShardingAnswersWriteTheStrategyOrTheParallelismConfig) {
  // Version 1 with HYBRID_SHARD; version 2 with a parallelism config of 2 replicas (shard size left
  // to the number of processes).
  std::istringstream v1("1\n\n\nyes\n1\nHYBRID_SHARD\n\nNO_WRAP\n\n\n\n\n\n4\nno\n");
  std::ostringstream out1;
  const ClusterConfig first = get_user_input(v1, out1);
  EXPECT_EQ(first.fsdp_config.at("fsdp_sharding_strategy"), "HYBRID_SHARD");
  EXPECT_EQ(first.fsdp_config.at("fsdp_backward_prefetch"), "BACKWARD_PRE");
  EXPECT_EQ(first.fsdp_config.at("fsdp_forward_prefetch"), "false");
  EXPECT_TRUE(first.parallelism_config.empty());
  EXPECT_THAT(out1.str(), Not(HasSubstr("parallelism config")));
  EXPECT_THAT(out1.str(), Not(HasSubstr("activation checkpointing")));  // NO_WRAP has no units to recompute
  EXPECT_EQ(first.fsdp_config.count("fsdp_activation_checkpointing"), 0u);

  TempDir dir;
  const std::string path = (dir.path() / "hybrid.yaml").string();
  const CommandOutcome outcome =
      run_config({"--config_file", path}, "1\n\n\nyes\n\n\n\nNO_WRAP\n\n\n\nyes\n2\n\n\n\n4\nno\n");
  ASSERT_EQ(outcome.code, 0) << outcome.err;
  const ClusterConfig loaded = load_config_from_file(path);
  EXPECT_EQ(loaded.parallelism_config,
            (std::map<std::string, std::string>{{"parallelism_config_dp_replicate_size", "2"}}));
  EXPECT_EQ(loaded.num_processes, 4);

  // Tensor parallelism over pairs, context parallelism over pairs of those, FSDP over 2 of them:
  // the sizes the launcher takes.
  const std::string tp_path = (dir.path() / "tp.yaml").string();
  const CommandOutcome tp_outcome =
      run_config({"--config_file", tp_path}, "1\n\n\nyes\n\n\n\nNO_WRAP\n\n\n\nyes\n1\n2\n2\n2\nalltoall\n8\nno\n");
  ASSERT_EQ(tp_outcome.code, 0) << tp_outcome.err;
  EXPECT_THAT(tp_outcome.out, HasSubstr("What is the tensor parallelism size"));
  EXPECT_EQ(load_config_from_file(tp_path).parallelism_config,
            (std::map<std::string, std::string>{{"parallelism_config_dp_replicate_size", "1"},
                                                {"parallelism_config_dp_shard_size", "2"},
                                                {"parallelism_config_tp_size", "2"},
                                                {"parallelism_config_cp_size", "2"},
                                                {"parallelism_config_cp_comm_strategy", "alltoall"}}));
}

TEST(ConfigQuestionnaire, AMachineRankOutsideTheMachinesIsAskedAgain) {
  std::istringstream in("1\n2\n2\n1\n10.0.0.1\n0\n29500\n\n\n\n4\n\n");
  std::ostringstream out;
  const ClusterConfig config = get_user_input(in, out);
  EXPECT_EQ(config.machine_rank, 1);
  EXPECT_EQ(config.main_process_port, std::optional<int>(29500));
  EXPECT_THAT(out.str(), HasSubstr("Please enter an integer from 0 to 1."));
  EXPECT_THAT(out.str(), HasSubstr("Please enter an integer from 1 to 65535."));
}

TEST(ConfigQuestionnaire, PythonOnlyIntegrationsAreNotAskedAndSaidSo) {
  std::istringstream in(kMultiCpuAnswers);
  std::ostringstream out;
  (void)get_user_input(in, out);
  EXPECT_THAT(out.str(), HasSubstr("DeepSpeed, Megatron-LM and TPU"));
  EXPECT_THAT(out.str(), HasSubstr("not supported"));
  EXPECT_THAT(out.str(), Not(HasSubstr("Do you want to use DeepSpeed")));
}

TEST(ConfigQuestionnaire, InputEndingEarlyIsAnErrorNamingTheQuestion) {
  TempDir dir;
  const std::string path = (dir.path() / "c.yaml").string();
  const CommandOutcome outcome = run_config({"--config_file", path}, "1\n\n");
  EXPECT_EQ(outcome.code, 1);
  EXPECT_THAT(outcome.err, HasSubstr("the input ended before this question was answered"));
  EXPECT_THAT(outcome.err, HasSubstr("Should distributed operations be checked"));
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(ConfigQuestionnaire, TheBinaryWithNoInputFailsInsteadOfWaiting) {
  TempDir dir;
  const std::string path = (dir.path() / "c.yaml").string();
  auto r = run({"/bin/sh", "-c", accelerate_bin() + " config --config_file " + path + " < /dev/null"}, 60);
  EXPECT_EQ(r->exit_code(), 1);
  EXPECT_THAT(r->err, HasSubstr("the input ended before this question was answered: \"Which type of machine"));
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(ConfigQuestionnaire, OneGpuOnOneMachineIsRefusedAsUpstreamDoes) {
  const CommandOutcome outcome = run_config({"--config_file", "unused.yaml"}, "2\n\n\n\n1\n");
  EXPECT_EQ(outcome.code, 1);
  EXPECT_THAT(outcome.err, HasSubstr("MULTI_GPU was chosen with a single GPU on a single machine"));
}

TEST(ConfigQuestionnaire, AJsonNameWritesJson) {
  TempDir dir;
  const std::string path = (dir.path() / "c.json").string();
  ASSERT_EQ(run_config({"--config_file", path}, kMultiCpuAnswers).code, 0);
  const std::string text = read_file(path);
  EXPECT_THAT(text, HasSubstr("  \"distributed_type\": \"MULTI_CPU\",\n"));
  EXPECT_THAT(text, HasSubstr("  \"num_processes\": 4,\n"));
  EXPECT_EQ(load_config_from_file(path).mixed_precision, "bf16");
}

// ---- config default ---------------------------------------------------------------------------

TEST(ConfigDefault, WritesAConfigurationForThisMachine) {
  if (is_cuda_available()) GTEST_SKIP() << "CUDA is available here; the expected file is the CPU-only one";
  TempDir dir;
  const std::string path = (dir.path() / "default_config.yaml").string();
  const CommandOutcome outcome = run_config({"default", "--config_file", path, "--mixed_precision", "bf16"});
  ASSERT_EQ(outcome.code, 0) << outcome.err;
  EXPECT_THAT(outcome.out, HasSubstr("accelerate configuration saved at " + path));
  EXPECT_EQ(read_file(path), R"(compute_environment: LOCAL_MACHINE
debug: false
distributed_type: 'NO'
downcast_bf16: false
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 1
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
)");
}

TEST(ConfigDefault, RefusesToOverwriteAnExistingFile) {
  TempDir dir;
  const std::string path = write_file(dir, "default_config.yaml", "distributed_type: MULTI_CPU\n");
  auto r = run({accelerate_bin(), "config", "default", "--config_file", path});
  EXPECT_EQ(r->exit_code(), 0) << r->err;
  EXPECT_THAT(r->out, HasSubstr("Configuration already exists at " + path + ", will not override"));
  EXPECT_EQ(read_file(path), "distributed_type: MULTI_CPU\n");
}

TEST(ConfigDefault, GoesToTheDefaultLocationAndMixedPrecisionDefaultsToNo) {
  TempDir dir;
  auto env = patch_environment({{"HF_HOME", dir.str()}});
  ASSERT_EQ(run_config({"default"}).code, 0);
  const ClusterConfig config = load_config_from_file(dir.str() + "/accelerate/default_config.yaml");
  EXPECT_EQ(config.mixed_precision, "no");
  EXPECT_FALSE(config.debug);
}

TEST(ConfigDefault, MixedPrecisionIsCaseInsensitiveAndOtherValuesAreAUsageError) {
  TempDir dir;
  const std::string path = (dir.path() / "c.yaml").string();
  ASSERT_EQ(run_config({"default", "--config_file", path, "--mixed-precision", "FP16"}).code, 0);
  EXPECT_EQ(load_config_from_file(path).mixed_precision, "fp16");
  const CommandOutcome outcome =
      run_config({"default", "--config_file", (dir.path() / "d.yaml").string(), "--mixed_precision", "fp8"});
  EXPECT_EQ(outcome.code, 2);
  EXPECT_THAT(outcome.err, HasSubstr("--mixed_precision"));
  EXPECT_THROWS_WITH(commands::write_basic_config("fp8", (dir.path() / "e.yaml").string()),
                     "[write_basic_config] `mixed_precision` should be one of 'no', 'fp16' or 'bf16', got 'fp8'");
}

// ---- config update ----------------------------------------------------------------------------

TEST(ConfigUpdate, AnOldSchemaFileIsRewrittenInTheCurrentSchema) {
  TempDir dir;
  // As an older Python Accelerate wrote it.
  const std::string path = write_file(dir, "old.yaml", R"(compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: MULTI_CPU
dynamo_backend: 'NO'
fp16: true
fsdp_config: {}
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
megatron_lm_config: {}
num_machines: 1
num_processes: 2
use_cpu: true
)");
  auto r = run({accelerate_bin(), "config", "update", "--config_file", path});
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  EXPECT_THAT(r->out, HasSubstr("Successfully updated the configuration file at " + path));
  EXPECT_EQ(read_file(path), R"(compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: false
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
)");
}

TEST(ConfigUpdate, ACurrentUpstreamFileKeepsItsSettings) {
  TempDir dir;
  // As Python Accelerate 1.x writes it for two GPUs on two machines.
  const std::string path = write_file(dir, "new.yaml", R"(compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 1
main_process_ip: 192.168.1.2
main_process_port: 29501
main_training_function: main
mixed_precision: bf16
num_machines: 2
num_processes: 4
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
)");
  ASSERT_EQ(commands::update_config(path), path);
  const ClusterConfig config = load_config_from_file(path);
  EXPECT_EQ(config.distributed_type, DistributedType::kMultiGpu);
  EXPECT_EQ(config.gpu_ids, std::optional<std::string>("all"));
  EXPECT_EQ(config.machine_rank, 1);
  EXPECT_EQ(config.main_process_ip, std::optional<std::string>("192.168.1.2"));
  EXPECT_EQ(config.main_process_port, std::optional<int>(29501));
  EXPECT_EQ(config.mixed_precision, "bf16");
  EXPECT_EQ(config.num_processes, 4);
  EXPECT_THAT(read_file(path), HasSubstr("downcast_bf16: false\n"));
}

TEST(ConfigUpdate, UnknownKeysAreRefusedAndTheFileIsLeftAlone) {
  TempDir dir;
  const std::string text = "distributed_type: MULTI_CPU\nnum_processes: 2\nzero_option: 1\nalpha_option: 2\n";
  const std::string path = write_file(dir, "c.yaml", text);
  const CommandOutcome outcome = run_config({"update", "--config_file", path});
  EXPECT_EQ(outcome.code, 1);
  EXPECT_THAT(outcome.err, HasSubstr("has unknown keys (alpha_option, zero_option)"));
  EXPECT_EQ(read_file(path), text);
}

TEST(ConfigUpdate, AMissingFileIsAnErrorNamingIt) {
  TempDir dir;
  const std::string path = (dir.path() / "none.yaml").string();
  const CommandOutcome outcome = run_config({"update", "--config_file", path});
  EXPECT_EQ(outcome.code, 1);
  EXPECT_THAT(outcome.err, HasSubstr("[update_config] the config file " + path + " does not exist"));
  auto env = patch_environment({{"HF_HOME", dir.str()}});
  EXPECT_THAT(run_config({"update"}).err, HasSubstr("(the default one) does not exist"));
}

TEST(ConfigUpdate, TheDefaultFileIsUpdatedWithoutConfigFile) {
  TempDir dir;
  auto env = patch_environment({{"HF_HOME", dir.str()}});
  std::filesystem::create_directories(dir.path() / "accelerate");
  const std::string path = write_file(dir, "accelerate/default_config.yaml", "distributed_type: 'NO'\nfp16: true\n");
  ASSERT_EQ(run_config({"update"}).code, 0);
  EXPECT_THAT(read_file(path), HasSubstr("mixed_precision: fp16\n"));
  EXPECT_THAT(read_file(path), Not(HasSubstr("fp16: true")));
}

// ---- flags --------------------------------------------------------------------------------------

TEST(ConfigFlags, HelpOfEachCommandExitsZeroAndNamesItsOptions) {
  auto top = run({accelerate_bin(), "config", "--help"});
  EXPECT_EQ(top->exit_code(), 0);
  EXPECT_THAT(top->out, HasSubstr("--config_file"));
  EXPECT_THAT(top->out, HasSubstr("default"));
  EXPECT_THAT(top->out, HasSubstr("update"));
  const CommandOutcome basic = run_config({"default", "--help"});
  EXPECT_EQ(basic.code, 0);
  EXPECT_THAT(basic.out, HasSubstr("--mixed_precision"));
  EXPECT_THAT(basic.out, HasSubstr("--config_file"));
  const CommandOutcome update = run_config({"update", "-h"});
  EXPECT_EQ(update.code, 0);
  EXPECT_THAT(update.out, HasSubstr("accelerate config update"));
  EXPECT_THAT(update.out, HasSubstr("--config_file"));
}

TEST(ConfigFlags, AnUnknownFlagExitsTwoNamingIt) {
  auto r = run({accelerate_bin(), "config", "--bogus_flag"});
  EXPECT_EQ(r->exit_code(), 2);
  EXPECT_THAT(r->err, HasSubstr("--bogus_flag"));
  const CommandOutcome outcome = run_config({"default", "--num_processes", "2"});
  EXPECT_EQ(outcome.code, 2);
  EXPECT_THAT(outcome.err, HasSubstr("--num_processes"));
}

}  // namespace
}  // namespace accelerate::testing
