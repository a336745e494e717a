// `accelerate launch` flags, their merge with the configuration file, and the environment each
// worker receives (commands/launch.h), without starting any process.
#include "accelerate/commands/launch.h"

#include "accelerate/utils/environment.h"
#include "detail/topology.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace accelerate::testing {
namespace {

using commands::LaunchArgs;
using commands::LaunchPlan;
using commands::parse_launch_args;
using commands::resolve_launch;
using commands::worker_environment;
using ::testing::ElementsAre;
using ::testing::EndsWith;
using ::testing::HasSubstr;

using Args = std::vector<std::string>;

// Every test sees an empty HF_HOME, so a default configuration file of this machine never leaks in,
// and a rendezvous secret, which jobs on several machines need.
class LaunchTest : public ::testing::Test {
 protected:
  std::string write_config(const std::string& name, const std::string& text) const {
    const std::string path = (home_.path() / name).string();
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    std::ofstream(path) << text;
    return path;
  }
  LaunchPlan resolve(const Args& argv) const { return resolve_launch(parse_launch_args(argv)); }

  TempDir home_;
  EnvironmentPatch env_{std::map<std::string, std::string>{{"HF_HOME", home_.str()},
                                                          {"ACCELERATE_RDZV_SECRET", "from-the-environment"}}};
};

class ParseLaunchArgs : public LaunchTest {};
class ResolveLaunch : public LaunchTest {};
class WorkerEnvironment : public LaunchTest {};

// ---- parse_launch_args ----------------------------------------------------------------------

TEST_F(ParseLaunchArgs, HyphenatedFlagsAreAccepted) {
  const LaunchArgs args = parse_launch_args({"--num-processes", "2", "--mixed-precision", "bf16",
                                             "--main-process-port", "0", "--num-cpu-threads-per-process", "3",
                                             "/bin/true"});
  EXPECT_EQ(args.num_processes, std::optional<int>(2));
  EXPECT_EQ(args.mixed_precision, std::optional<std::string>("bf16"));
  EXPECT_EQ(args.main_process_port, std::optional<int>(0));
  EXPECT_EQ(args.num_cpu_threads_per_process, std::optional<int>(3));
  EXPECT_EQ(args.training_script, "/bin/true");
  EXPECT_TRUE(args.training_script_args.empty());
}

TEST_F(ParseLaunchArgs, UnderscoredFlagsShortNamesAndEqualsSignsAreAccepted) {
  const LaunchArgs args =
      parse_launch_args({"-n", "3", "--machine_rank=1", "--num_machines", "3", "--cpu", "--debug", "/bin/true"});
  EXPECT_EQ(args.num_processes, std::optional<int>(3));
  EXPECT_EQ(args.machine_rank, std::optional<int>(1));
  EXPECT_EQ(args.num_machines, std::optional<int>(3));
  EXPECT_TRUE(args.cpu);
  EXPECT_TRUE(args.debug);
  EXPECT_FALSE(args.multi_gpu);
}

TEST_F(ParseLaunchArgs, UnsetFlagsStayUnset) {
  const LaunchArgs args = parse_launch_args({"/bin/true"});
  EXPECT_EQ(args.num_processes, std::nullopt);
  EXPECT_EQ(args.mixed_precision, std::nullopt);
  EXPECT_EQ(args.config_file, std::nullopt);
  EXPECT_FALSE(args.cpu);
  EXPECT_FALSE(args.help);
  EXPECT_EQ(args.max_restarts, 0);
}

TEST_F(ParseLaunchArgs, AnUnknownFlagIsRefusedNamingIt) {
  EXPECT_THROWS_WITH(parse_launch_args({"--num_proceses", "2", "/bin/true"}), "--num_proceses");
  // Upstream's flags of Python-only integrations are named as such.
  EXPECT_THROWS_WITH(parse_launch_args({"--use_deepspeed", "/bin/true"}),
                     "'--use_deepspeed' configures DeepSpeed, a Python-only integration");
  EXPECT_THROWS_WITH(parse_launch_args({"--fsdp_shardingstrategy=FULL_SHARD", "/bin/true"}),
                     "unknown flag '--fsdp_shardingstrategy=FULL_SHARD'");
  EXPECT_THROWS_WITH(parse_launch_args({"--dynamo_backend", "inductor", "/bin/true"}), "configures TorchDynamo");
  EXPECT_THROWS_WITH(parse_launch_args({"--use_megatron_lm", "/bin/true"}), "configures Megatron-LM");
  EXPECT_THROWS_WITH(parse_launch_args({"--tpu", "/bin/true"}), "configures XLA/TPU");
  EXPECT_THROWS_WITH(parse_launch_args({"--tpuu", "/bin/true"}), "unknown flag '--tpuu'");
}

TEST_F(ParseLaunchArgs, ANonIntegerProcessCountIsRefusedNamingTheFlag) {
  EXPECT_THROWS_WITH(parse_launch_args({"--num_processes", "two", "/bin/true"}), "num_processes");
}

TEST_F(ParseLaunchArgs, AnIntegerFlagBeyondIntIsRefusedByName) {
  for (const std::string flag : {"--num_processes", "--num_machines", "--machine_rank", "--main_process_port",
                                 "--num_cpu_threads_per_process", "--gradient_accumulation_steps", "--max_restarts"}) {
    for (const std::string value : {"4294967297", "2147483648", "-2147483649", "99999999999999999999"}) {
      EXPECT_THROWS_WITH(parse_launch_args({flag, value, "/bin/true"}),
                         flag + " must be an integer that fits an int (-2147483648 to 2147483647), got '" + value + "'");
    }
    EXPECT_THROWS_WITH(parse_launch_args({flag, "12abc", "/bin/true"}), flag + " must be an integer");
  }
  // Named as given in any spelling; the limits themselves are numbers.
  EXPECT_THROWS_WITH(parse_launch_args({"-n", "4294967297", "/bin/true"}), "--num_processes must be an integer");
  EXPECT_THROWS_WITH(parse_launch_args({"--max-restarts=4294967297", "/bin/true"}), "--max_restarts must be an integer");
  EXPECT_EQ(parse_launch_args({"-n", "2147483647", "/bin/true"}).num_processes, std::optional<int>(2147483647));
  EXPECT_EQ(parse_launch_args({"--max_restarts", "-2147483648", "/bin/true"}).max_restarts, -2147483647 - 1);
}

TEST_F(ParseLaunchArgs, ArgumentsAfterTheProgramBelongToItEvenWhenTheyLookLikeFlags) {
  const LaunchArgs args =
      parse_launch_args({"--cpu", "./prog", "--num_processes", "7", "-n", "3", "--help", "--", "x"});
  EXPECT_EQ(args.training_script, "./prog");
  EXPECT_THAT(args.training_script_args, ElementsAre("--num_processes", "7", "-n", "3", "--help", "--", "x"));
  EXPECT_EQ(args.num_processes, std::nullopt);
  EXPECT_FALSE(args.help);
  EXPECT_TRUE(args.cpu);
}

TEST_F(ParseLaunchArgs, HelpIsRecognised) {
  EXPECT_TRUE(parse_launch_args({"--help"}).help);
  EXPECT_TRUE(parse_launch_args({"-h"}).help);
  EXPECT_THAT(commands::launch_help(), HasSubstr("--num_processes"));
}

// ---- resolve_launch -------------------------------------------------------------------------

TEST_F(ParseLaunchArgs, FsdpFlagsBecomeTheWorkersFsdpVariablesOverTheConfigFile) {
  const std::string config = write_config("fsdp.yaml", "distributed_type: FSDP\nuse_cpu: true\nnum_processes: 2\n"
                                          "fsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
                                          "  fsdp_min_num_params: 1000\n");
  const LaunchPlan plan = resolve({"--config_file", config, "--fsdp-sharding-strategy", "NO_SHARD",
                                   "--fsdp_transformer_layer_cls_to_wrap", "Block", "/bin/true"});
  EXPECT_TRUE(plan.use_fsdp);
  EXPECT_TRUE(plan.use_cpu);
  const auto env = worker_environment(plan, 0, 29500, 0);
  EXPECT_EQ(env.at("ACCELERATE_USE_FSDP"), "true");
  EXPECT_EQ(env.at("FSDP_SHARDING_STRATEGY"), "NO_SHARD");
  EXPECT_EQ(env.at("FSDP_MIN_NUM_PARAMS"), "1000");
  EXPECT_EQ(env.at("FSDP_TRANSFORMER_CLS_TO_WRAP"), "Block");
  EXPECT_FALSE(worker_environment(resolve({"/bin/true"}), 0, 29500, 0).count("ACCELERATE_USE_FSDP"));
  EXPECT_TRUE(resolve({"--use_fsdp", "/bin/true"}).use_fsdp);
}

TEST_F(ParseLaunchArgs, AnFsdpFlagWithAWrongValueIsRefusedNamingIt) {
  EXPECT_THROWS_WITH(resolve({"--fsdp_sharding_strategy", "HALF_SHARD", "/bin/true"}),
                     "[launch] fsdp_sharding_strategy: [parse_fsdp_sharding_strategy] expected one of FULL_SHARD");
  EXPECT_THROWS_WITH(resolve({"--fsdp_offload_params", "maybe", "/bin/true"}), "fsdp_offload_params");
  EXPECT_THROWS_WITH(resolve({"--fsdp_min_num_params", "1e8x", "/bin/true"}),
                     "fsdp_min_num_params: expected a positive integer, got '1e8x'");
}

TEST_F(ParseLaunchArgs, ParallelismConfigFlagsBecomeTheWorkersVariablesOverTheConfigFile) {
  const std::string config = write_config("hybrid.yaml", "distributed_type: FSDP\nuse_cpu: true\nnum_processes: 4\n"
                                          "parallelism_config:\n  parallelism_config_dp_replicate_size: 4\n"
                                          "  parallelism_config_dp_shard_size: 1\n");
  const LaunchPlan plan = resolve({"--config_file", config, "--parallelism-config-dp-replicate-size", "2",
                                   "--parallelism_config_dp_shard_size", "2", "/bin/true"});
  const auto env = worker_environment(plan, 0, 29500, 0);
  EXPECT_EQ(env.at("ACCELERATE_USE_PARALLELISM_CONFIG"), "true");
  EXPECT_EQ(env.at("PARALLELISM_CONFIG_DP_REPLICATE_SIZE"), "2");
  EXPECT_EQ(env.at("PARALLELISM_CONFIG_DP_SHARD_SIZE"), "2");
  EXPECT_FALSE(env.count("PARALLELISM_CONFIG_TP_SIZE"));
  // From the file alone.
  const auto from_file = worker_environment(resolve({"--config_file", config, "/bin/true"}), 0, 29500, 0);
  EXPECT_EQ(from_file.at("PARALLELISM_CONFIG_DP_REPLICATE_SIZE"), "4");
  EXPECT_FALSE(worker_environment(resolve({"--use_fsdp", "/bin/true"}), 0, 29500, 0)
                   .count("ACCELERATE_USE_PARALLELISM_CONFIG"));
}

TEST_F(ParseLaunchArgs, ParallelismConfigSettingsThatCannotApplyAreRefusedNamingThem) {
  EXPECT_THROWS_WITH(resolve({"-n", "4", "--use_parallelism_config", "--parallelism_config_dp_shard_size", "2",
                              "/bin/true"}),
                     "--use_parallelism_config (and the parallelism_config settings) needs --use_fsdp, "
                     "--parallelism_config_tp_size above 1 or --parallelism_config_cp_size above 1");
  EXPECT_THROWS_WITH(resolve({"-n", "4", "--use_fsdp", "--parallelism_config_dp_replicate_size", "3", "/bin/true"}),
                     "dp_replicate_size (3) x dp_shard_size (1) x tp_size (1) must equal --num_processes (4)");
  EXPECT_THROWS_WITH(resolve({"-n", "4", "--parallelism_config_tp_size", "3", "/bin/true"}),
                     "dp_replicate_size (1) x dp_shard_size (1) x tp_size (3) must equal --num_processes (4)");
  EXPECT_THROWS_WITH(resolve({"-n", "4", "--parallelism_config_cp_size", "3", "/bin/true"}),
                     "dp_replicate_size (1) x dp_shard_size (1) x tp_size (1) x cp_size (3) must equal --num_processes "
                     "(4)");
  {
    const LaunchPlan plan = resolve({"-n", "4", "--parallelism_config_cp_size", "2",
                                     "--parallelism_config_cp_comm_strategy", "alltoall", "/bin/true"});
    EXPECT_EQ(plan.parallelism_environment.at("PARALLELISM_CONFIG_CP_SIZE"), "2");
    EXPECT_EQ(plan.parallelism_environment.at("PARALLELISM_CONFIG_CP_COMM_STRATEGY"), "alltoall");
  }
  EXPECT_THROWS_WITH(resolve({"-n", "2", "--parallelism_config_cp_size", "2", "--parallelism_config_cp_comm_strategy",
                              "ring", "/bin/true"}),
                     "parallelism_config_cp_comm_strategy: expected 'allgather' or 'alltoall', got 'ring'");
  {
    const LaunchPlan plan = resolve({"-n", "4", "--parallelism_config_tp_size", "2", "/bin/true"});
    EXPECT_EQ(plan.parallelism_environment.at("PARALLELISM_CONFIG_TP_SIZE"), "2");
  }
  EXPECT_THROWS_WITH(resolve({"--use_fsdp", "--parallelism_config_dp_shard_size", "two", "/bin/true"}),
                     "parallelism_config_dp_shard_size: expected a positive integer, got 'two'");
  EXPECT_THROWS_WITH(parse_launch_args({"--parallelism_config_sp_size", "2", "/bin/true"}),
                     "configures parallelism_config's sequence parallelism (DeepSpeed's Ulysses)");
}

TEST_F(ResolveLaunch, WithoutFlagsOrConfigOneLocalProcessRuns) {
  const LaunchPlan plan = resolve({"/bin/true", "a", "b"});
  EXPECT_EQ(plan.num_processes, 1);
  EXPECT_EQ(plan.num_machines, 1);
  EXPECT_EQ(plan.machine_rank, 0);
  EXPECT_EQ(plan.local_num_processes, 1);
  EXPECT_EQ(plan.main_process_ip, "127.0.0.1");
  EXPECT_EQ(plan.main_process_port, 29500);
  EXPECT_EQ(plan.mixed_precision, "no");
  EXPECT_FALSE(plan.debug);
  EXPECT_EQ(plan.tee, 3);
  EXPECT_THAT(plan.command, ElementsAre("/bin/true", "a", "b"));
}

TEST_F(ResolveLaunch, ConfigFileValuesAreUsedWhenFlagsAreAbsent) {
  const std::string config = write_config("c.yaml", R"(distributed_type: MULTI_CPU
mixed_precision: bf16
num_processes: 4
main_process_port: 29610
use_cpu: true
debug: true
enable_cpu_affinity: true
)");
  const LaunchPlan plan = resolve({"--config_file", config, "/bin/true"});
  EXPECT_EQ(plan.num_processes, 4);
  EXPECT_EQ(plan.local_num_processes, 4);
  EXPECT_EQ(plan.mixed_precision, "bf16");
  EXPECT_EQ(plan.main_process_port, 29610);
  EXPECT_TRUE(plan.use_cpu);
  EXPECT_TRUE(plan.debug);
  EXPECT_TRUE(plan.enable_cpu_affinity);
}

TEST_F(ResolveLaunch, FlagsOverrideTheConfigFile) {
  const std::string config =
      write_config("c.yaml", "distributed_type: MULTI_CPU\nmixed_precision: bf16\nnum_processes: 4\n"
                             "main_process_port: 29610\n");
  const LaunchPlan plan = resolve({"--config_file", config, "--num_processes", "2", "--mixed_precision", "no",
                                   "--main_process_port", "29620", "/bin/true"});
  EXPECT_EQ(plan.num_processes, 2);
  EXPECT_EQ(plan.mixed_precision, "no");
  EXPECT_EQ(plan.main_process_port, 29620);
}

TEST_F(ResolveLaunch, TheDefaultConfigFileIsUsedWithoutConfigFileFlag) {
  write_config("accelerate/default_config.yaml",
               "distributed_type: MULTI_CPU\nnum_processes: 3\nmixed_precision: fp16\n");
  const LaunchPlan plan = resolve({"/bin/true"});
  EXPECT_EQ(plan.num_processes, 3);
  EXPECT_EQ(plan.mixed_precision, "fp16");
}

TEST_F(ResolveLaunch, AMissingConfigFileIsAnError) {
  EXPECT_THROWS_WITH(resolve({"--config_file", (home_.path() / "none.yaml").string(), "/bin/true"}),
                     "does not exist");
}

TEST_F(ResolveLaunch, ProcessesMustBeAMultipleOfMachines) {
  EXPECT_THROWS_WITH(resolve({"--num_processes", "3", "--num_machines", "2", "--main_process_ip", "10.0.0.1",
                              "/bin/true"}),
                     "must be a multiple of --num_machines (2)");
}

TEST_F(ResolveLaunch, SeveralMachinesNeedTheMainProcessAddress) {
  EXPECT_THROWS_WITH(resolve({"--num_processes", "4", "--num_machines", "2", "/bin/true"}),
                     "needs --main_process_ip");
}

TEST_F(ResolveLaunch, TheMainProcessAddressCanComeFromTheConfigFile) {
  const std::string config =
      write_config("c.yaml", "distributed_type: MULTI_CPU\nnum_machines: 2\nnum_processes: 4\n"
                             "main_process_ip: 10.0.0.7\n");
  const LaunchPlan plan = resolve({"--config_file", config, "--machine_rank", "1", "/bin/true"});
  EXPECT_EQ(plan.main_process_ip, "10.0.0.7");
  EXPECT_EQ(plan.machine_rank, 1);
  EXPECT_EQ(plan.local_num_processes, 2);
}

TEST_F(ResolveLaunch, SeveralMachinesNeedASecretEveryLauncherKnows) {
  EnvironmentPatch no_secret(std::map<std::string, std::string>{{"ACCELERATE_RDZV_SECRET", ""}});
  EXPECT_THROWS_WITH(resolve({"--num_processes", "4", "--num_machines", "2", "--main_process_ip", "10.0.0.1",
                              "/bin/true"}),
                     "needs a secret that every machine's launcher knows");
  // One machine makes its own when the job starts.
  EXPECT_EQ(resolve({"--num_processes", "2", "/bin/true"}).rdzv_secret, "");
}

TEST_F(ResolveLaunch, TheSecretComesFromItsFileElseTheEnvironment) {
  const Args machines = {"--num_processes", "4", "--num_machines", "2", "--main_process_ip", "10.0.0.1"};
  auto with = [&](Args extra) {
    Args argv = machines;
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.push_back("/bin/true");
    return argv;
  };
  EXPECT_EQ(resolve(with({})).rdzv_secret, "from-the-environment");
  const std::string file = write_config("secret", "from-the-file\n");
  EXPECT_EQ(resolve(with({"--rdzv_secret_file", file})).rdzv_secret, "from-the-file");
  const std::string empty = write_config("empty", "\n");
  EXPECT_THROWS_WITH(resolve(with({"--rdzv_secret_file", empty})), "--rdzv_secret_file " + empty + " is empty");
  EXPECT_THROWS_WITH(resolve(with({"--rdzv_secret_file", home_.str() + "/none"})),
                     "--rdzv_secret_file: ");
  const auto env = worker_environment(resolve(with({"--rdzv_secret_file", file})), 0, 29500, 0);
  EXPECT_EQ(env.at("ACCELERATE_RDZV_SECRET"), "from-the-file");
}

TEST_F(ResolveLaunch, SeveralMachinesNeedAFixedPort) {
  EXPECT_THROWS_WITH(resolve({"--num_processes", "4", "--num_machines", "2", "--main_process_ip", "10.0.0.1",
                              "--main_process_port", "0", "/bin/true"}),
                     "needs a fixed --main_process_port");
}

TEST_F(ResolveLaunch, AMachineRankOutsideTheMachinesIsRefused) {
  EXPECT_THROWS_WITH(resolve({"--num_machines", "2", "--machine_rank", "2", "--num_processes", "2",
                              "--main_process_ip", "10.0.0.1", "/bin/true"}),
                     "--machine_rank 2 is outside [0, --num_machines=2)");
}

TEST_F(ResolveLaunch, TheRendezvousBackendIsStaticOrC10d) {
  const Args machines = {"--num_processes", "4", "--num_machines", "2", "--main_process_ip", "10.0.0.1"};
  auto with = [&](Args more) {
    Args argv = machines;
    argv.insert(argv.end(), more.begin(), more.end());
    argv.push_back("/bin/true");
    return resolve(argv);
  };
  EXPECT_FALSE(with({}).machine_rank_at_rendezvous);
  EXPECT_EQ(with({}).rdzv_backend, "static");
  // c10d without --machine_rank: numbered at the rendezvous; with one, the rank given.
  EXPECT_TRUE(with({"--rdzv_backend", "c10d"}).machine_rank_at_rendezvous);
  const LaunchPlan ranked = with({"--rdzv-backend", "c10d", "--machine_rank", "1"});
  EXPECT_FALSE(ranked.machine_rank_at_rendezvous);
  EXPECT_EQ(ranked.machine_rank, 1);
  // Numbered at the rendezvous and restarting: rounds of a fixed size, which a relaunched machine
  // joins; with the rank given, or without restarts, no rounds.
  const LaunchPlan rounds = with({"--rdzv_backend", "c10d", "--max_restarts", "2"});
  EXPECT_TRUE(rounds.elastic);
  EXPECT_EQ(rounds.min_machines, 2);
  EXPECT_EQ(rounds.num_machines, 2);
  EXPECT_FALSE(with({"--rdzv_backend", "c10d"}).elastic);
  EXPECT_FALSE(with({"--rdzv_backend", "c10d", "--machine_rank", "1", "--max_restarts", "2"}).elastic);
  EXPECT_FALSE(with({"--max_restarts", "2", "--machine_rank", "1"}).elastic);
  EXPECT_THROWS_WITH(with({"--rdzv_backend", "etcd"}), "--rdzv_backend must be static or c10d, got 'etcd'");
}

TEST_F(ResolveLaunch, NumbersBeyondIntFromTheConfigFileAndTheEnvironmentAreRefusedByName) {
  const std::string config = write_config("big.yaml", "distributed_type: MULTI_CPU\nnum_processes: 4294967297\n");
  EXPECT_THROWS_WITH(resolve({"--config_file", config, "/bin/true"}),
                     "key 'num_processes' expects an integer, got '4294967297'");
  {
    EnvironmentPatch slurm(std::map<std::string, std::string>{{"SLURM_JOB_NUM_NODES", "4294967298"}});
    EXPECT_THROWS_WITH(resolve({"-n", "4", "--num_machines", "2", "--main_process_ip", "10.0.0.1", "/bin/true"}),
                       "SLURM_JOB_NUM_NODES must be an integer that fits an int (-2147483648 to 2147483647), got "
                       "'4294967298'");
  }
  {
    EnvironmentPatch threads(std::map<std::string, std::string>{{"OMP_NUM_THREADS", "4294967297"}});
    EXPECT_THROWS_WITH(resolve({"-n", "2", "/bin/true"}), "OMP_NUM_THREADS must be an integer, got '4294967297'");
  }
  // The product of the parallelism sizes is beyond int: 1300 x 2501 x 1321 = 2^32 + 4, which an int
  // product would take for --num_processes 4.
  EXPECT_THROWS_WITH(resolve({"-n", "4", "--parallelism_config_dp_replicate_size", "1300",
                              "--parallelism_config_dp_shard_size", "2501", "--parallelism_config_tp_size", "1321",
                              "/bin/true"}),
                     "dp_replicate_size (1300) x dp_shard_size (2501) x tp_size (1321) must equal --num_processes (4)");
  // Without dp_shard_size, 65536 x 65536 (2^32) divides --num_processes.
  EXPECT_THROWS_WITH(resolve({"-n", "4", "--parallelism_config_dp_replicate_size", "65536",
                              "--parallelism_config_tp_size", "65536", "/bin/true"}),
                     "must equal --num_processes (4)");
}

TEST_F(ResolveLaunch, NnodesIsTheNumberOfMachinesOrAnElasticRange) {
  auto with = [&](Args more) {
    Args argv = {"--num_processes", "4", "--main_process_ip", "10.0.0.1"};
    argv.insert(argv.end(), more.begin(), more.end());
    argv.push_back("/bin/true");
    return resolve(argv);
  };
  const LaunchPlan fixed = with({"--nnodes", "2"});
  EXPECT_EQ(fixed.num_machines, 2);
  EXPECT_FALSE(fixed.elastic);
  const LaunchPlan elastic = with({"--nnodes", "1:2", "--rdzv_backend", "c10d", "--rdzv_conf", "last_call_timeout=4"});
  EXPECT_TRUE(elastic.elastic);
  EXPECT_EQ(elastic.min_machines, 1);
  EXPECT_EQ(elastic.num_machines, 2);
  EXPECT_EQ(elastic.local_num_processes, 2);
  EXPECT_TRUE(elastic.machine_rank_at_rendezvous);
  EXPECT_DOUBLE_EQ(elastic.last_call_timeout, 4);
  EXPECT_DOUBLE_EQ(with({"--nnodes", "1:2", "--rdzv_backend", "c10d"}).last_call_timeout, 30);
  EXPECT_THROWS_WITH(with({"--nnodes", "1:2"}), "--nnodes 1:2 (an elastic job) needs --rdzv_backend c10d");
  EXPECT_THROWS_WITH(with({"--nnodes", "2:1", "--rdzv_backend", "c10d"}),
                     "--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got '2:1'");
  EXPECT_THROWS_WITH(with({"--nnodes", "two"}), "got 'two'");
  // A number beyond int is refused, not cut to one machine (4294967297 = 2^32 + 1).
  for (const std::string nnodes : {"4294967297", "1:4294967297", "4294967297:4294967297", "2147483648"}) {
    EXPECT_THROWS_WITH(with({"--nnodes", nnodes, "--rdzv_backend", "c10d"}),
                       "--nnodes must be N or MIN:MAX, whole numbers from 1 to 2147483647, got '" + nnodes + "'");
  }
  EXPECT_THROWS_WITH(with({"--nnodes", "1:2", "--num_machines", "3", "--rdzv_backend", "c10d"}),
                     "--nnodes 1:2 and --num_machines 3 disagree");
  EXPECT_THROWS_WITH(with({"--nnodes", "1:2", "--rdzv_backend", "c10d", "--machine_rank", "1"}),
                     "--machine_rank cannot be given with --nnodes 1:2");
  EXPECT_THROWS_WITH(with({"--nnodes", "1:2", "--rdzv_backend", "c10d", "--rdzv_conf", "join_timeout_s=3"}),
                     "--rdzv_conf: unknown setting 'join_timeout_s'");
  EXPECT_THROWS_WITH(with({"--nnodes", "1:2", "--rdzv_backend", "c10d", "--rdzv_conf", "last_call_timeout=soon"}),
                     "last_call_timeout must be a number of seconds, from 0 to 31536000, got 'soon'");
}

TEST_F(ResolveLaunch, MachinesNumberedAtTheRendezvousAreRefusedUnderMpi) {
  if (!accelerate::is_mpi_available()) GTEST_SKIP() << "built without MPI";
  // A host file chooses MPI, as --backend mpi does.
  const std::string hosts = (home_.path() / "hosts").string();
  std::ofstream(hosts) << "10.0.0.1 slots=2\n10.0.0.2 slots=2\n";
  auto with = [&](Args more) {
    Args argv = {"--num_processes", "4", "--main_process_ip", "10.0.0.1", "--mpirun_hostfile", hosts};
    argv.insert(argv.end(), more.begin(), more.end());
    argv.push_back("/bin/true");
    return resolve(argv);
  };
  EXPECT_THROWS_WITH(with({"--num_machines", "2", "--rdzv_backend", "c10d"}),
                     "with --backend mpi, one launcher on the machine of rank 0 starts every machine's workers");
  EXPECT_THROWS_WITH(with({"--nnodes", "1:2", "--rdzv_backend", "c10d"}),
                     "an elastic job (--nnodes MIN:MAX) runs one launcher per machine");
  EXPECT_THROWS_WITH(with({"--num_machines", "2", "--rdzv_backend", "c10d", "--max_restarts", "1"}),
                     "with --backend mpi, one launcher on the machine of rank 0 starts every machine's workers");
}

// The config file's rdzv_backend is the default of --rdzv_backend, as every other key is of its
// flag (upstream parses it and never uses it: its flag's default, "static", always wins).
TEST_F(ResolveLaunch, TheConfigFilesRdzvBackendIsTheDefaultOfTheFlag) {
  const std::string c10d = write_config("c10d.yaml", "distributed_type: MULTI_CPU\nrdzv_backend: c10d\n");
  const std::string fixed = write_config("static.yaml", "distributed_type: MULTI_CPU\nrdzv_backend: static\n");
  auto with = [&](const std::string& config, Args more) {
    Args argv = {"--config_file", config, "--num_processes", "4", "--main_process_ip", "10.0.0.1"};
    argv.insert(argv.end(), more.begin(), more.end());
    argv.push_back("/bin/true");
    return resolve(argv);
  };
  // An elastic job from the file alone, which a static rendezvous refuses.
  const LaunchPlan elastic = with(c10d, {"--nnodes", "1:2"});
  EXPECT_EQ(elastic.rdzv_backend, "c10d");
  EXPECT_TRUE(elastic.elastic);
  EXPECT_TRUE(elastic.machine_rank_at_rendezvous);
  EXPECT_TRUE(with(c10d, {"--num_machines", "2"}).machine_rank_at_rendezvous);
  // The flag wins over the file, either way.
  EXPECT_THROWS_WITH(with(c10d, {"--nnodes", "1:2", "--rdzv_backend", "static"}),
                     "--nnodes 1:2 (an elastic job) needs --rdzv_backend c10d (or rdzv_backend: c10d in the config "
                     "file)");
  EXPECT_EQ(with(c10d, {"--num_machines", "2", "--rdzv_backend", "static"}).rdzv_backend, "static");
  EXPECT_FALSE(with(c10d, {"--num_machines", "2", "--rdzv_backend", "static"}).machine_rank_at_rendezvous);
  EXPECT_EQ(with(fixed, {"--nnodes", "1:2", "--rdzv_backend", "c10d"}).rdzv_backend, "c10d");
  EXPECT_THROWS_WITH(with(fixed, {"--nnodes", "1:2"}), "needs --rdzv_backend c10d");
  // The default configuration file too.
  write_config("accelerate/default_config.yaml", "distributed_type: MULTI_CPU\nrdzv_backend: c10d\n");
  const LaunchPlan from_default = resolve({"-n", "4", "--nnodes", "1:2", "--main_process_ip", "10.0.0.1", "/bin/true"});
  EXPECT_EQ(from_default.rdzv_backend, "c10d");
  EXPECT_TRUE(from_default.elastic);
  // ... whose c10d-only rdzv_conf keys it allows.
  EXPECT_DOUBLE_EQ(with(c10d, {"--nnodes", "1:2", "--rdzv_conf", "join_timeout=5"}).join_timeout.value_or(0), 5);
}

// Note [The keys of --rdzv_conf] in src/launch/plan.cpp: torchrun's keys that accelerate-cpp's
// rendezvous has no notion of are refused by name, saying why.
TEST_F(ResolveLaunch, TorchrunsRdzvConfKeysWithoutAMeaningHereAreRefusedByNameWithTheReason) {
  auto with = [&](const std::string& conf) {
    return resolve({"--num_processes", "4", "--main_process_ip", "10.0.0.1", "--nnodes", "1:2", "--rdzv_backend",
                    "c10d", "--rdzv_conf", conf, "/bin/true"});
  };
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"close_timeout", "machine 0 publishes the job's end in its store"},
      {"heartbeat_timeout", "keeps no keep-alive of its members"},
      {"keep_alive_interval", "keeps no keep-alive of its members"},
      {"keep_alive_max_attempt", "keeps no keep-alive of its members"},
      {"read_timeout", "bound each of their requests to the rendezvous store themselves"},
      {"use_libuv", "no libuv server to choose"},
      {"rank", "give --machine_rank"},
      {"protocol", "torchrun's etcd rendezvous"},
      {"cacert", "torchrun's etcd rendezvous"},
      {"cert", "torchrun's etcd rendezvous"},
      {"key", "torchrun's etcd rendezvous"},
  };
  for (const auto& [key, reason] : refused) {
    SCOPED_TRACE(key);
    EXPECT_THROWS_WITH(with(key + "=1"), "[launch] --rdzv_conf: " + key + " is not supported: ");
    EXPECT_THROWS_WITH(with(key + "=1"), reason);
    // Among honoured keys, and whatever its value.
    EXPECT_THROWS_WITH(with("last_call_timeout=2," + key + "=no"), "--rdzv_conf: " + key + " is not supported");
  }
  EXPECT_THROWS_WITH(with("store_type=file"), "store_type=file is not supported: the rendezvous store is the TCP "
                                              "store that the launcher of machine 0 serves");
  EXPECT_THROWS_WITH(with("store_type=etcd"), "store_type must be tcp or file, got 'etcd'");
  EXPECT_THROWS_WITH(with("local_addr=10.0.0.2"), "--rdzv_conf: unknown setting 'local_addr' (accelerate-cpp's "
                                                  "rendezvous takes timeout, join_timeout, last_call_timeout, "
                                                  "is_host and store_type)");
  EXPECT_THROWS_WITH(with("Join_Timeout=3"), "unknown setting 'Join_Timeout'");
  // Hostile spellings of the list itself.
  for (const std::string conf : {"join_timeout", "join_timeout=", "=3", ",", "join_timeout=3,", " = "}) {
    SCOPED_TRACE(conf);
    EXPECT_THROWS_WITH(with(conf), "--rdzv_conf must be key=value[,key=value...], got '");
  }
}

TEST_F(ResolveLaunch, TorchrunsRdzvConfTimeoutsReachThePlan) {
  auto with = [&](Args more) {
    Args argv = {"--num_processes", "4", "--main_process_ip", "10.0.0.1", "--nnodes", "1:2"};
    argv.insert(argv.end(), more.begin(), more.end());
    argv.push_back("/bin/true");
    return resolve(argv);
  };
  // timeout: --rdzv_timeout, which the workers read too; with the flag, they must agree.
  const LaunchPlan timed = with({"--rdzv_backend", "c10d", "--rdzv_conf", "timeout=30"});
  EXPECT_DOUBLE_EQ(timed.rdzv_timeout, 30);
  EXPECT_EQ(worker_environment(timed, 0, 29500, 0).at("ACCELERATE_RDZV_TIMEOUT"), std::to_string(30.0));
  EXPECT_DOUBLE_EQ(with({"--rdzv_backend", "c10d", "--rdzv_conf", "timeout=30", "--rdzv_timeout", "30"}).rdzv_timeout,
                   30);
  EXPECT_THROWS_WITH(with({"--rdzv_backend", "c10d", "--rdzv_conf", "timeout=30", "--rdzv_timeout", "10"}),
                     "[launch] --rdzv_timeout 10 and --rdzv_conf timeout=30 disagree; give one of them");
  EXPECT_DOUBLE_EQ(with({"--rdzv_backend", "c10d"}).rdzv_timeout, 900);
  EXPECT_DOUBLE_EQ(with({"--rdzv_backend", "c10d", "--rdzv_timeout", "12"}).rdzv_timeout, 12);
  // join_timeout: the launchers' wait at their rendezvous, apart from the workers'.
  const LaunchPlan joined = with({"--rdzv_backend", "c10d", "--rdzv_conf", "join_timeout=7, last_call_timeout=0"});
  EXPECT_EQ(joined.join_timeout, std::optional<double>(7));
  EXPECT_DOUBLE_EQ(joined.last_call_timeout, 0);
  EXPECT_DOUBLE_EQ(joined.rdzv_timeout, 900);
  EXPECT_EQ(with({"--rdzv_backend", "c10d"}).join_timeout, std::nullopt);
  // A repeated key takes its last value, as torchrun's.
  EXPECT_DOUBLE_EQ(with({"--rdzv_backend", "c10d", "--rdzv_conf", "last_call_timeout=1,last_call_timeout=3"})
                       .last_call_timeout,
                   3);
  EXPECT_NO_THROW(with({"--rdzv_backend", "c10d", "--rdzv_conf", "store_type=TCP"}));
  for (const std::string bad : {"0", "-1", "soon", "nan", "inf", "1e9", "3s"}) {
    SCOPED_TRACE(bad);
    EXPECT_THROWS_WITH(with({"--rdzv_backend", "c10d", "--rdzv_conf", "join_timeout=" + bad}),
                       "--rdzv_conf: join_timeout must be a number of seconds, above 0 to 31536000, got '" + bad + "'");
    EXPECT_THROWS_WITH(with({"--rdzv_backend", "c10d", "--rdzv_conf", "timeout=" + bad}),
                       "timeout must be a number of seconds, above 0 to 31536000, got '" + bad + "'");
  }
  EXPECT_THROWS_WITH(with({"--rdzv_backend", "c10d", "--rdzv_conf", "last_call_timeout=-1"}),
                     "last_call_timeout must be a number of seconds, from 0 to 31536000, got '-1'");
  // The c10d rendezvous's keys, under a static one (--nnodes N: a fixed number of machines).
  for (const std::string key : {"join_timeout=3", "last_call_timeout=3", "is_host=true"}) {
    SCOPED_TRACE(key);
    EXPECT_THROWS_WITH(resolve({"-n", "4", "--main_process_ip", "10.0.0.1", "--nnodes", "2", "--machine_rank", "0",
                                "--rdzv_conf", key, "/bin/true"}),
                       " is a setting of the c10d rendezvous, but this job's is static: give --rdzv_backend c10d");
  }
  EXPECT_DOUBLE_EQ(resolve({"-n", "4", "--main_process_ip", "10.0.0.1", "--nnodes", "2", "--machine_rank", "0",
                            "--rdzv_conf", "timeout=40", "/bin/true"})
                       .rdzv_timeout,
                   40);
}

TEST_F(ResolveLaunch, RdzvConfIsHostChoosesMachineZeroOnlyWhereTheRendezvousNumbersTheMachines) {
  auto with = [&](Args more) {
    Args argv = {"--num_processes", "4", "--main_process_ip", "10.0.0.1", "--rdzv_backend", "c10d"};
    argv.insert(argv.end(), more.begin(), more.end());
    argv.push_back("/bin/true");
    return resolve(argv);
  };
  EXPECT_EQ(with({"--nnodes", "1:2", "--rdzv_conf", "is_host=true"}).is_host, std::optional<bool>(true));
  EXPECT_EQ(with({"--num_machines", "2", "--rdzv_conf", "is_host=0"}).is_host, std::optional<bool>(false));
  EXPECT_EQ(with({"--num_machines", "2"}).is_host, std::nullopt);
  EXPECT_THROWS_WITH(with({"--num_machines", "2", "--rdzv_conf", "is_host=maybe"}),
                     "--rdzv_conf: is_host must be a boolean (true or false), got 'maybe'");
  // With the rank given, it must agree with it.
  EXPECT_NO_THROW(with({"--num_machines", "2", "--machine_rank", "0", "--rdzv_conf", "is_host=yes"}));
  EXPECT_THROWS_WITH(with({"--num_machines", "2", "--machine_rank", "1", "--rdzv_conf", "is_host=true"}),
                     "--rdzv_conf: is_host=true disagrees with --machine_rank 1: the machine of rank 0 hosts the "
                     "rendezvous");
  EXPECT_THROWS_WITH(with({"--num_machines", "1", "--rdzv_conf", "is_host=false"}),
                     "is_host=false disagrees with a job on one machine, whose launcher hosts its rendezvous");
}

TEST_F(ResolveLaunch, TeeAcceptsOnlyZeroToThree) {
  EXPECT_THROWS_WITH(resolve({"--tee", "5", "/bin/true"}), "--tee must be 0, 1, 2 or 3, got '5'");
  EXPECT_THROWS_WITH(resolve({"--tee", "12", "/bin/true"}), "got '12'");
  EXPECT_EQ(resolve({"--tee", "2", "/bin/true"}).tee, 2);
}

TEST_F(ResolveLaunch, Fp8MixedPrecisionIsRefused) {
  EXPECT_THROWS_WITH(resolve({"--mixed_precision", "fp8", "/bin/true"}), "fp8 mixed precision is not supported");
}

TEST_F(ResolveLaunch, AnUnknownMixedPrecisionIsRefusedNamingTheChoices) {
  EXPECT_THROWS_WITH(resolve({"--mixed_precision", "fp32", "/bin/true"}),
                     "expected one of 'no', 'fp16', 'bf16', got 'fp32'");
  const std::string config = write_config("mp.yaml", "distributed_type: NO\nmixed_precision: half\n");
  EXPECT_THROWS_WITH(resolve({"--config_file", config, "/bin/true"}), "got 'half'");
}

TEST_F(ResolveLaunch, AnUnsupportedRendezvousBackendInTheConfigFileIsRefused) {
  const std::string config = write_config("rdzv.yaml", "distributed_type: MULTI_CPU\nrdzv_backend: etcd\n");
  EXPECT_THROWS_WITH(resolve({"--config_file", config, "/bin/true"}),
                     config + ": rdzv_backend 'etcd' is not supported; use 'static' or 'c10d'");
}

TEST_F(ResolveLaunch, AProgramWithoutTheExecutableBitIsRefusedNamingIt) {
  const std::string script = write_config("train.sh", "#!/bin/sh\necho hi\n");
  std::filesystem::permissions(script, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  EXPECT_THROWS_WITH(resolve({script}),
                     "[launch] the program '" + script + "' is not an executable file (check its permissions)");
  EXPECT_THROWS_WITH(resolve({script + ".missing"}), "the program '" + script + ".missing' does not exist");
}

TEST_F(ResolveLaunch, MixedPrecisionIsNormalisedToUpstreamsSpelling) {
  EXPECT_EQ(resolve({"--mixed_precision", "BF16", "/bin/true"}).mixed_precision, "bf16");
}

TEST_F(ResolveLaunch, MultiGpuNeedsCuda) {
  if (is_cuda_available()) GTEST_SKIP() << "CUDA is available here, so --multi_gpu is valid";
  EXPECT_THROWS_WITH(resolve({"--multi_gpu", "/bin/true"}), "needs CUDA devices");
  const std::string config = write_config("gpu.yaml", "distributed_type: MULTI_GPU\nnum_processes: 2\n");
  EXPECT_THROWS_WITH(resolve({"--config_file", config, "/bin/true"}), "needs CUDA devices");
}

TEST_F(ResolveLaunch, CpuOverridesAMultiGpuConfigFile) {
  const std::string config = write_config("gpu.yaml", "distributed_type: MULTI_GPU\nnum_processes: 2\n");
  const LaunchPlan plan = resolve({"--config_file", config, "--cpu", "/bin/true"});
  EXPECT_FALSE(plan.multi_gpu);
  EXPECT_TRUE(plan.use_cpu);
  EXPECT_EQ(plan.num_processes, 2);
}

TEST_F(ResolveLaunch, CpuAndMultiGpuExcludeEachOther) {
  EXPECT_THROWS_WITH(resolve({"--cpu", "--multi_gpu", "/bin/true"}), "--cpu and --multi_gpu exclude each other");
}

TEST_F(ResolveLaunch, APythonScriptRunsUnderPython3) {
  const std::string script = write_config("train.py", "print('hi')\n");
  const LaunchPlan plan = resolve({script, "--lr", "0.1"});
  ASSERT_EQ(plan.command.size(), 4u);
  EXPECT_THAT(plan.command[0], EndsWith("/python3"));
  EXPECT_EQ(plan.command[1], script);
  EXPECT_EQ(plan.command[2], "--lr");
  EXPECT_EQ(plan.command[3], "0.1");
}

TEST_F(ResolveLaunch, AModuleRunsUnderPython3DashM) {
  const LaunchPlan plan = resolve({"-m", "pkg.train", "--epochs", "2"});
  ASSERT_EQ(plan.command.size(), 5u);
  EXPECT_THAT(plan.command[0], EndsWith("/python3"));
  EXPECT_THAT(std::vector<std::string>(plan.command.begin() + 1, plan.command.end()),
              ElementsAre("-m", "pkg.train", "--epochs", "2"));
}

TEST_F(ResolveLaunch, AProgramNotInPathIsRefusedByName) {
  EXPECT_THROWS_WITH(resolve({"no-such-program-for-accelerate"}),
                     "the program 'no-such-program-for-accelerate' was not found in PATH");
}

TEST_F(ResolveLaunch, NoProgramIsAnError) {
  EXPECT_THROWS_WITH(resolve({"--cpu"}), "no program to run was given");
}

TEST_F(ResolveLaunch, ZeroAccumulationStepsAreRefused) {
  EXPECT_THROWS_WITH(resolve({"--gradient_accumulation_steps", "0", "/bin/true"}),
                     "--gradient_accumulation_steps must be at least 1, got 0");
}

TEST_F(ResolveLaunch, AnUnknownBackendIsRefused) {
  EXPECT_THROWS_WITH(resolve({"--backend", "carrier-pigeon", "/bin/true"}),
                     "--backend must be gloo, nccl or mpi, got 'carrier-pigeon'");
}

TEST_F(ResolveLaunch, NumbersOutsideTheirRangeAreRefusedNamingTheFlagAndTheValue) {
  const std::vector<std::pair<Args, std::string>> cases = {
      {{"--num_processes", "0"}, "[launch] --num_processes must be at least 1, got 0"},
      {{"--num_processes", "-2"}, "[launch] --num_processes must be at least 1, got -2"},
      {{"--num_machines", "0"}, "[launch] --num_machines must be at least 1, got 0"},
      {{"--main_process_port", "70000"}, "[launch] --main_process_port must be a TCP port (0-65535), got 70000"},
      {{"--main_process_port", "-1"}, "[launch] --main_process_port must be a TCP port (0-65535), got -1"},
      {{"--monitor_interval", "0"}, "[launch] --monitor_interval must be positive, got 0"},
      {{"--rdzv_timeout", "0"}, "[launch] --rdzv_timeout must be positive, got 0"},
      {{"--grace_period", "-1"}, "[launch] --grace_period must not be negative, got -1"},
      {{"--max_restarts", "-1"}, "[launch] --max_restarts must not be negative, got -1"},
      {{"--num_cpu_threads_per_process", "0"}, "[launch] --num_cpu_threads_per_process must be at least 1, got 0"},
  };
  for (const auto& [flags, message] : cases) {
    Args argv = flags;
    argv.push_back("/bin/true");
    EXPECT_THROWS_WITH(resolve(argv), message) << flags[0] << " " << flags[1];
  }
  // The edges of each range are accepted.
  const LaunchPlan plan = resolve({"--num_processes", "1", "--main_process_port", "65535", "--grace_period", "0",
                                   "--max_restarts", "0", "--num_cpu_threads_per_process", "1", "/bin/true"});
  EXPECT_EQ(plan.main_process_port, 65535);
  EXPECT_EQ(plan.max_restarts, 0);
}

TEST_F(ResolveLaunch, CountsOutsideTheirRangeInTheConfigFileAreRefusedNamingTheFile) {
  const std::string processes = write_config("processes.yaml", "distributed_type: MULTI_CPU\nnum_processes: 0\n");
  EXPECT_THROWS_WITH(resolve({"--config_file", processes, "/bin/true"}),
                     processes + ": num_processes must be >= 1, got 0");
  const std::string machines =
      write_config("machines.yaml", "distributed_type: MULTI_CPU\nnum_processes: 2\nnum_machines: 0\n");
  EXPECT_THROWS_WITH(resolve({"--config_file", machines, "/bin/true"}),
                     machines + ": num_machines must be >= 1, got 0");
}

TEST_F(ResolveLaunch, ThreadsPerProcessComeFromOmpNumThreadsWhenNotGiven) {
  auto omp = patch_environment({{"OMP_NUM_THREADS", "3"}});
  EXPECT_EQ(resolve({"/bin/true"}).num_cpu_threads_per_process, 3);
  EXPECT_EQ(resolve({"--num_cpu_threads_per_process", "5", "/bin/true"}).num_cpu_threads_per_process, 5);
}

// ---- worker_environment ---------------------------------------------------------------------

TEST_F(WorkerEnvironment, RanksFollowTheMachineRankAndLocalIndex) {
  const LaunchPlan plan = resolve({"--num_processes", "4", "--num_machines", "2", "--machine_rank", "1",
                                   "--main_process_ip", "10.0.0.1", "--mixed_precision", "bf16", "--debug", "--cpu",
                                   "--num_cpu_threads_per_process", "3", "/bin/true"});
  const auto env = worker_environment(plan, /*local_rank=*/1, /*master_port=*/12345, /*restart_count=*/0);
  EXPECT_EQ(env.at("RANK"), "3");
  EXPECT_EQ(env.at("WORLD_SIZE"), "4");
  EXPECT_EQ(env.at("LOCAL_RANK"), "1");
  EXPECT_EQ(env.at("LOCAL_WORLD_SIZE"), "2");
  EXPECT_EQ(env.at("MASTER_ADDR"), "10.0.0.1");
  EXPECT_EQ(env.at("MASTER_PORT"), "12345");
  EXPECT_EQ(env.at("OMP_NUM_THREADS"), "3");
  EXPECT_EQ(env.at("OPENBLAS_NUM_THREADS"), "3");
  EXPECT_EQ(env.at("ACCELERATE_MIXED_PRECISION"), "bf16");
  EXPECT_EQ(env.at("ACCELERATE_DEBUG_MODE"), "true");
  EXPECT_EQ(env.at("ACCELERATE_USE_CPU"), "true");
  EXPECT_EQ(env.count("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"), 0u);
}

TEST_F(WorkerEnvironment, TheFirstMachineStartsAtRankZero) {
  const LaunchPlan plan = resolve({"--num_processes", "2", "/bin/true"});
  EXPECT_EQ(worker_environment(plan, 0, 29500, 0).at("RANK"), "0");
  EXPECT_EQ(worker_environment(plan, 1, 29500, 0).at("RANK"), "1");
  EXPECT_EQ(worker_environment(plan, 1, 29500, 0).at("ACCELERATE_DEBUG_MODE"), "false");
  EXPECT_EQ(worker_environment(plan, 1, 29500, 0).at("ACCELERATE_USE_CPU"), "false");
  EXPECT_EQ(worker_environment(plan, 1, 29500, 0).at("ACCELERATE_MIXED_PRECISION"), "no");
}

TEST_F(WorkerEnvironment, AccumulationStepsArePassedOnlyWhenSet) {
  const LaunchPlan plan = resolve({"--gradient_accumulation_steps", "4", "/bin/true"});
  EXPECT_EQ(worker_environment(plan, 0, 29500, 0).at("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"), "4");
}

TEST_F(WorkerEnvironment, TheRestartCountIsPassedOn) {
  const LaunchPlan plan = resolve({"--max_restarts", "2", "/bin/true"});
  const auto env = worker_environment(plan, 0, 29500, 1);
  EXPECT_EQ(env.at("TORCHELASTIC_RESTART_COUNT"), "1");
  EXPECT_EQ(env.at("TORCHELASTIC_MAX_RESTARTS"), "2");
}

TEST_F(WorkerEnvironment, AWorkerReadsBackTheTopologyTheLauncherMeant) {
  const LaunchPlan plan = resolve({"--num_processes", "6", "--num_machines", "3", "--machine_rank", "2",
                                   "--main_process_ip", "head", "--main_process_port", "29700", "/bin/true"});
  const detail::Topology topo = detail::detect_topology(detail::map_env(worker_environment(plan, 1, 29700, 0)));
  EXPECT_EQ(topo.family, detail::LauncherFamily::kTorchrun);
  EXPECT_EQ(topo.rank, 5);
  EXPECT_EQ(topo.world_size, 6);
  EXPECT_EQ(topo.local_rank, 1);
  EXPECT_EQ(topo.local_world_size, 2);
  EXPECT_EQ(topo.master_addr, "head");
  EXPECT_EQ(topo.master_port, 29700);
}

}  // namespace
}  // namespace accelerate::testing
