// Reading and writing upstream's configuration files (commands/config.h).
#include "accelerate/commands/config.h"

#include "accelerate/utils/environment.h"
#include "support/commands.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace accelerate::testing {
namespace {

using commands::ClusterConfig;
using commands::default_config_file;
using commands::load_config_from_file;
using commands::save_config_file;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

// What `accelerate config` (upstream) writes for two CPU processes in bf16.
constexpr const char* kUpstreamMultiCpu = R"(compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
)";

// ---- load_config_from_file ------------------------------------------------------------------

TEST(LoadConfigFromFile, AnUpstreamMultiCpuFileIsReadCompletely) {
  TempDir dir;
  const ClusterConfig config = load_config_from_file(write_file(dir, "default_config.yaml", kUpstreamMultiCpu));
  EXPECT_EQ(config.compute_environment, "LOCAL_MACHINE");
  EXPECT_FALSE(config.debug);
  EXPECT_EQ(config.distributed_type, DistributedType::kMultiCpu);
  EXPECT_FALSE(config.downcast_bf16);
  EXPECT_FALSE(config.enable_cpu_affinity);
  EXPECT_EQ(config.machine_rank, 0);
  EXPECT_EQ(config.main_training_function, "main");
  EXPECT_EQ(config.mixed_precision, "bf16");
  EXPECT_EQ(config.num_machines, 1);
  EXPECT_EQ(config.num_processes, 2);
  EXPECT_EQ(config.rdzv_backend, "static");
  EXPECT_TRUE(config.same_network);
  EXPECT_TRUE(config.use_cpu);
  EXPECT_EQ(config.main_process_ip, std::nullopt);
  EXPECT_EQ(config.main_process_port, std::nullopt);
  EXPECT_THAT(config.keys_present, Contains("tpu_env"));
  EXPECT_THAT(config.keys_present, Contains("num_processes"));
  EXPECT_THAT(config.keys_present, Not(Contains("gpu_ids")));
}

TEST(LoadConfigFromFile, AnUpstreamFileWithIpexTurnedOffIsAccepted) {
  TempDir dir;
  const std::string text = std::string(kUpstreamMultiCpu) + "ipex_config:\n  ipex: false\n";
  const ClusterConfig config = load_config_from_file(write_file(dir, "c.yaml", text));
  EXPECT_EQ(config.distributed_type, DistributedType::kMultiCpu);
  EXPECT_EQ(config.num_processes, 2);
}

TEST(LoadConfigFromFile, IpexTurnedOnIsRefusedAsPythonOnly) {
  TempDir dir;
  const std::string text = std::string(kUpstreamMultiCpu) + "ipex_config:\n  ipex: true\n";
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "c.yaml", text)),
                     "'ipex_config' configures a Python-only integration");
}

TEST(LoadConfigFromFile, MultiMachineSettingsAreRead) {
  TempDir dir;
  const ClusterConfig config = load_config_from_file(write_file(dir, "c.yaml", R"(distributed_type: MULTI_CPU
num_machines: 2
machine_rank: 1
num_processes: 8
main_process_ip: 10.0.0.1
main_process_port: 29600
gpu_ids: all
mpirun_config:
  mpirun_hostfile: /etc/hosts.mpi
debug: true
)"));
  EXPECT_EQ(config.num_machines, 2);
  EXPECT_EQ(config.machine_rank, 1);
  EXPECT_EQ(config.num_processes, 8);
  EXPECT_EQ(config.main_process_ip, std::optional<std::string>("10.0.0.1"));
  EXPECT_EQ(config.main_process_port, std::optional<int>(29600));
  EXPECT_EQ(config.gpu_ids, std::optional<std::string>("all"));
  EXPECT_EQ(config.mpirun_hostfile, std::optional<std::string>("/etc/hosts.mpi"));
  EXPECT_TRUE(config.debug);
  EXPECT_EQ(config.mixed_precision, "no");
}

TEST(LoadConfigFromFile, TheOldSchemaFp16FlagMeansFp16MixedPrecision) {
  TempDir dir;
  const ClusterConfig config = load_config_from_file(write_file(dir, "old.yaml", R"(compute_environment: LOCAL_MACHINE
distributed_type: 'NO'
dynamo_backend: 'NO'
fp16: true
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 1
use_cpu: false
)"));
  EXPECT_EQ(config.distributed_type, DistributedType::kNo);
  EXPECT_EQ(config.mixed_precision, "fp16");
}

TEST(LoadConfigFromFile, TheOldSchemaFp16FlagOffMeansNoMixedPrecision) {
  TempDir dir;
  const ClusterConfig config =
      load_config_from_file(write_file(dir, "old.yaml", "distributed_type: 'NO'\nfp16: false\n"));
  EXPECT_EQ(config.mixed_precision, "no");
}

TEST(LoadConfigFromFile, UnknownKeysAreAllListedInSortedOrder) {
  TempDir dir;
  const std::string path = write_file(dir, "c.yaml", "zeta_option: 1\ndistributed_type: NO\nalpha_option: 2\n");
  const std::string error = error_of([&] { (void)load_config_from_file(path); });
  EXPECT_THAT(error, HasSubstr("has unknown keys (alpha_option, zeta_option)"));
  EXPECT_THAT(error, HasSubstr(path));
}

TEST(LoadConfigFromFile, AMissingDistributedTypeIsRefused) {
  TempDir dir;
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "c.yaml", "num_processes: 2\n")),
                     "a `distributed_type` must be specified");
}

TEST(LoadConfigFromFile, AMissingFileIsRefusedNamingIt) {
  TempDir dir;
  const std::string path = (dir.path() / "nowhere.yaml").string();
  EXPECT_THROWS_WITH(load_config_from_file(path), "the configuration file '" + path + "' does not exist");
}

TEST(LoadConfigFromFile, AFolderIsNotAConfigurationFile) {
  TempDir dir;
  EXPECT_THROWS_WITH(load_config_from_file(dir.str()), "does not exist");
}

TEST(LoadConfigFromFile, YamlThatIsNotAMappingIsRefused) {
  TempDir dir;
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "list.yaml", "- distributed_type\n- MULTI_CPU\n")),
                     "must hold a mapping of configuration keys");
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "empty.yaml", "")), "must hold a mapping");
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "scalar.yaml", "MULTI_CPU\n")), "must hold a mapping");
}

TEST(LoadConfigFromFile, BrokenYamlIsRefusedNamingTheFile) {
  TempDir dir;
  const std::string path = write_file(dir, "broken.yaml", "distributed_type: [MULTI_CPU\n");
  EXPECT_THROWS_WITH(load_config_from_file(path), path + " is not valid YAML");
}

TEST(LoadConfigFromFile, DeepSpeedIsRefused) {
  TempDir dir;
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "c.yaml", "distributed_type: DEEPSPEED\n")),
                     "got 'DEEPSPEED'");
}

TEST(LoadConfigFromFile, AnFsdpConfigIsReadCheckedAndWrittenBack) {
  TempDir dir;
  const std::string text = "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
                           "  fsdp_transformer_layer_cls_to_wrap: [Block, Head]\n  fsdp_offload_params: false\n";
  const ClusterConfig config = load_config_from_file(write_file(dir, "c.yaml", text));
  EXPECT_TRUE(config.use_fsdp);
  EXPECT_EQ(config.distributed_type, DistributedType::kMultiGpu);
  EXPECT_EQ(config.fsdp_config.at("fsdp_transformer_layer_cls_to_wrap"), "Block,Head");
  const auto path = (dir.path() / "back.yaml").string();
  save_config_file(config, path);
  const ClusterConfig again = load_config_from_file(path);
  EXPECT_TRUE(again.use_fsdp);
  EXPECT_EQ(again.fsdp_config, config.fsdp_config);
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "d.yaml", "distributed_type: FSDP\nfsdp_config:\n"
                                                                    "  fsdp_sharding_strategy: HALF\n")),
                     "fsdp_config] fsdp_sharding_strategy: [parse_fsdp_sharding_strategy] expected one of");
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "e.yaml", "distributed_type: FSDP\nfsdp_config:\n"
                                                                    "  fsdp_sharding: FULL_SHARD\n")),
                     "fsdp_config has an unknown key 'fsdp_sharding'");
}

TEST(LoadConfigFromFile, AParallelismConfigIsReadCheckedAndWrittenBack) {
  TempDir dir;
  const std::string text = "distributed_type: FSDP\nnum_processes: 4\nparallelism_config:\n"
                           "  parallelism_config_dp_replicate_size: 2\n  parallelism_config_dp_shard_size: 2\n";
  const ClusterConfig config = load_config_from_file(write_file(dir, "c.yaml", text));
  EXPECT_EQ(config.parallelism_config.at("parallelism_config_dp_shard_size"), "2");
  for (const char* name : {"back.yaml", "back.json"}) {
    const auto path = (dir.path() / name).string();
    save_config_file(config, path);
    EXPECT_EQ(load_config_from_file(path).parallelism_config, config.parallelism_config) << name;
  }
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "d.yaml", "distributed_type: FSDP\nparallelism_config:\n"
                                                                    "  parallelism_config_cp_comm_strategy: ring\n")),
                     "parallelism_config_cp_comm_strategy: expected 'allgather' or 'alltoall', got 'ring'");
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "e.yaml", "distributed_type: FSDP\nparallelism_config:\n"
                                                                    "  parallelism_config_sp_size: 2\n")),
                     "parallelism_config has 'parallelism_config_sp_size', which accelerate-cpp does not support");
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "f.yaml", "distributed_type: FSDP\nparallelism_config: 4\n")),
                     "key 'parallelism_config' expects a mapping, got '4'");
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "g.yaml", "distributed_type: FSDP\nfsdp_config: [1, 2]\n")),
                     "key 'fsdp_config' expects a mapping, got a list");
}

TEST(LoadConfigFromFile, EmptyIntegrationSectionsAreAccepted) {
  TempDir dir;
  const ClusterConfig config = load_config_from_file(write_file(
      dir, "c.yaml", "distributed_type: MULTI_CPU\nfsdp_config: {}\nmegatron_lm_config: {}\ndeepspeed_config: {}\n"
                 "parallelism_config: {}\n"));
  EXPECT_EQ(config.distributed_type, DistributedType::kMultiCpu);
}

TEST(LoadConfigFromFile, DynamoCompilationIsRefused) {
  TempDir dir;
  const std::string text = "distributed_type: 'NO'\ndynamo_config:\n  dynamo_backend: INDUCTOR\n";
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "c.yaml", text)),
                     "TorchDynamo compilation is a Python-only feature");
}

TEST(LoadConfigFromFile, AWrongTypedNumberOfProcessesNamesTheKey) {
  TempDir dir;
  const std::string text = "distributed_type: MULTI_CPU\nnum_processes: two\n";
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "c.yaml", text)),
                     "key 'num_processes' expects an integer, got 'two'");
}

TEST(LoadConfigFromFile, AWrongTypedBooleanNamesTheKey) {
  TempDir dir;
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "c.yaml", "distributed_type: MULTI_CPU\nuse_cpu: [1]\n")),
                     "key 'use_cpu' expects a boolean, got a list");
}

TEST(LoadConfigFromFile, AnUnsupportedMixedPrecisionNamesTheFile) {
  TempDir dir;
  const std::string path = write_file(dir, "c.yaml", "distributed_type: MULTI_CPU\nmixed_precision: fp8\n");
  EXPECT_THROWS_WITH(load_config_from_file(path), "fp8 mixed precision is not supported");
  EXPECT_THROWS_WITH(load_config_from_file(path), path);
}

TEST(LoadConfigFromFile, AMachineRankOutsideTheMachinesIsRefused) {
  TempDir dir;
  const std::string text = "distributed_type: MULTI_CPU\nnum_machines: 2\nmachine_rank: 2\n";
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "c.yaml", text)),
                     "machine_rank 2 is outside [0, num_machines=2)");
}

TEST(LoadConfigFromFile, AnotherComputeEnvironmentIsRefused) {
  TempDir dir;
  const std::string text = "compute_environment: AMAZON_SAGEMAKER\ndistributed_type: 'NO'\n";
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "c.yaml", text)),
                     "compute_environment 'AMAZON_SAGEMAKER' is not supported");
  // A value that is none of upstream's is named as such.
  const std::string misspelt = "compute_environment: LOCAL\ndistributed_type: 'NO'\n";
  EXPECT_THROWS_WITH(load_config_from_file(write_file(dir, "d.yaml", misspelt)),
                     "compute_environment 'LOCAL' is not one of LOCAL_MACHINE, AMAZON_SAGEMAKER");
}

// ---- save_config_file -----------------------------------------------------------------------

TEST(SaveConfigFile, ASavedConfigurationLoadsBackTheSame) {
  TempDir dir;
  ClusterConfig config;
  config.distributed_type = DistributedType::kMultiCpu;
  config.mixed_precision = "bf16";
  config.use_cpu = true;
  config.debug = true;
  config.num_processes = 4;
  config.num_machines = 2;
  config.machine_rank = 1;
  config.gpu_ids = "0,1";
  config.main_process_ip = "10.0.0.1";
  config.main_process_port = 29601;
  config.rdzv_backend = "c10d";
  config.same_network = false;
  config.main_training_function = "train";
  config.enable_cpu_affinity = true;
  config.downcast_bf16 = true;
  config.mpirun_hostfile = "/tmp/hosts";
  const std::string path = (dir.path() / "nested" / "default_config.yaml").string();
  save_config_file(config, path);
  const ClusterConfig loaded = load_config_from_file(path);
  EXPECT_EQ(loaded.distributed_type, DistributedType::kMultiCpu);
  EXPECT_EQ(loaded.mixed_precision, "bf16");
  EXPECT_TRUE(loaded.use_cpu);
  EXPECT_TRUE(loaded.debug);
  EXPECT_EQ(loaded.num_processes, 4);
  EXPECT_EQ(loaded.num_machines, 2);
  EXPECT_EQ(loaded.machine_rank, 1);
  EXPECT_EQ(loaded.gpu_ids, std::optional<std::string>("0,1"));
  EXPECT_EQ(loaded.main_process_ip, std::optional<std::string>("10.0.0.1"));
  EXPECT_EQ(loaded.main_process_port, std::optional<int>(29601));
  EXPECT_EQ(loaded.rdzv_backend, "c10d");
  EXPECT_FALSE(loaded.same_network);
  EXPECT_EQ(loaded.main_training_function, "train");
  EXPECT_TRUE(loaded.enable_cpu_affinity);
  EXPECT_TRUE(loaded.downcast_bf16);
  EXPECT_EQ(loaded.mpirun_hostfile, std::optional<std::string>("/tmp/hosts"));
}

TEST(SaveConfigFile, TheDefaultConfigurationLoadsBackTheSame) {
  TempDir dir;
  const std::string path = (dir.path() / "c.yaml").string();
  save_config_file(ClusterConfig{}, path);
  const ClusterConfig loaded = load_config_from_file(path);
  EXPECT_EQ(loaded.distributed_type, DistributedType::kNo);
  EXPECT_EQ(loaded.mixed_precision, "no");
  EXPECT_EQ(loaded.num_processes, 1);
  EXPECT_EQ(loaded.gpu_ids, std::nullopt);
  EXPECT_EQ(loaded.main_process_ip, std::nullopt);
}

TEST(SaveConfigFile, KeysAreWrittenInUpstreamsSortedOrder) {
  TempDir dir;
  const std::string path = (dir.path() / "c.yaml").string();
  ClusterConfig config;
  config.distributed_type = DistributedType::kMultiCpu;
  config.mixed_precision = "bf16";
  config.num_processes = 2;
  config.use_cpu = true;
  save_config_file(config, path);
  // The top-level keys of the file, in order.
  std::vector<std::string> keys;
  std::istringstream lines(read_file(path));
  for (std::string line; std::getline(lines, line);) {
    const size_t colon = line.find(':');
    if (!line.empty() && line[0] != ' ' && colon != std::string::npos) keys.push_back(line.substr(0, colon));
  }
  EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end())) << read_file(path);
  for (const char* key : {"compute_environment", "debug", "distributed_type", "downcast_bf16", "enable_cpu_affinity",
                          "machine_rank", "main_training_function", "mixed_precision", "num_machines", "num_processes",
                          "rdzv_backend", "same_network", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "use_cpu"}) {
    EXPECT_THAT(keys, Contains(key));
  }
  EXPECT_THAT(read_file(path), HasSubstr("distributed_type: MULTI_CPU\n"));
  EXPECT_THAT(read_file(path), HasSubstr("num_processes: 2\n"));
  EXPECT_THAT(read_file(path), HasSubstr("tpu_env: []\n"));
}

TEST(SaveConfigFile, WordsPythonYamlReadsAsBooleansAreQuoted) {
  TempDir dir;
  const std::string path = (dir.path() / "c.yaml").string();
  ClusterConfig config;  // distributed_type NO, mixed_precision no
  config.main_training_function = "On";
  save_config_file(config, path);
  const std::string text = read_file(path);
  EXPECT_THAT(text, HasSubstr("distributed_type: 'NO'\n"));
  EXPECT_THAT(text, HasSubstr("mixed_precision: 'no'\n"));
  EXPECT_THAT(text, HasSubstr("main_training_function: 'On'\n"));
  EXPECT_EQ(load_config_from_file(path).main_training_function, "On");
}

TEST(SaveConfigFile, AnUnwritablePathIsAnError) {
  TempDir dir;
  const std::string blocker = write_file(dir, "file", "x");
  EXPECT_THROWS_WITH(save_config_file(ClusterConfig{}, blocker + "/c.yaml"), blocker);
}

// ---- default_config_file --------------------------------------------------------------------

TEST(DefaultConfigFile, HfHomeComesFirst) {
  auto env = patch_environment({{"HF_HOME", "/hf"}, {"XDG_CACHE_HOME", "/xdg"}, {"HOME", "/home/u"}});
  EXPECT_EQ(default_config_file(), "/hf/accelerate/default_config.yaml");
}

TEST(DefaultConfigFile, XdgCacheHomeComesWithoutHfHome) {
  auto cleared = clear_environment();
  auto env = patch_environment({{"XDG_CACHE_HOME", "/xdg"}, {"HOME", "/home/u"}});
  EXPECT_EQ(default_config_file(), "/xdg/huggingface/accelerate/default_config.yaml");
}

TEST(DefaultConfigFile, HomeCacheComesLast) {
  auto cleared = clear_environment();
  auto env = patch_environment({{"HOME", "/home/u"}});
  EXPECT_EQ(default_config_file(), "/home/u/.cache/huggingface/accelerate/default_config.yaml");
}

}  // namespace
}  // namespace accelerate::testing
