// Reading the job's topology from torchrun, Slurm, Open MPI and MPICH variables (detail/topology.h),
// over fixed environments so that the real one never takes part.
#include "detail/topology.h"

#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accelerate::testing {
namespace {

using detail::detect_topology;
using detail::first_slurm_host;
using detail::LauncherFamily;
using detail::map_env;
using detail::parse_slurm_tasks_per_node;
using detail::Topology;

Topology detect(std::map<std::string, std::string> env) { return detect_topology(map_env(std::move(env))); }

// ---- no launcher ----------------------------------------------------------------------------

TEST(DetectTopology, AnEmptyEnvironmentIsOneProcessOnLocalhost) {
  const Topology topo = detect({});
  EXPECT_EQ(topo.family, LauncherFamily::kNone);
  EXPECT_EQ(topo.rank, 0);
  EXPECT_EQ(topo.world_size, 1);
  EXPECT_EQ(topo.local_rank, 0);
  EXPECT_EQ(topo.local_world_size, 1);
  EXPECT_EQ(topo.master_addr, "127.0.0.1");
  EXPECT_EQ(topo.master_port, 29500);
}

TEST(DetectTopology, MasterAddressAndPortAreReadWithoutALauncher) {
  const Topology topo = detect({{"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(topo.family, LauncherFamily::kNone);
  EXPECT_EQ(topo.world_size, 1);
  EXPECT_EQ(topo.master_addr, "10.1.2.3");
  EXPECT_EQ(topo.master_port, 1234);
}

TEST(DetectTopology, ALauncherFamilyHasItsUpstreamName) {
  EXPECT_EQ(to_string(LauncherFamily::kNone), "none");
  EXPECT_EQ(to_string(LauncherFamily::kTorchrun), "torchrun");
  EXPECT_EQ(to_string(LauncherFamily::kSlurm), "slurm");
  EXPECT_EQ(to_string(LauncherFamily::kMpi), "mpi");
}

// ---- torchrun -------------------------------------------------------------------------------

TEST(DetectTopology, TorchrunVariablesDescribeTheJob) {
  const Topology topo = detect({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                                {"MASTER_ADDR", "node01"}, {"MASTER_PORT", "29600"}});
  EXPECT_EQ(topo.family, LauncherFamily::kTorchrun);
  EXPECT_EQ(topo.rank, 5);
  EXPECT_EQ(topo.world_size, 8);
  EXPECT_EQ(topo.local_rank, 1);
  EXPECT_EQ(topo.local_world_size, 4);
  EXPECT_EQ(topo.master_addr, "node01");
  EXPECT_EQ(topo.master_port, 29600);
}

TEST(DetectTopology, TorchrunLocalValuesDefaultToTheGlobalOnes) {
  const Topology topo = detect({{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  EXPECT_EQ(topo.family, LauncherFamily::kTorchrun);
  EXPECT_EQ(topo.local_rank, 2);
  EXPECT_EQ(topo.local_world_size, 3);
  EXPECT_EQ(topo.master_addr, "127.0.0.1");
  EXPECT_EQ(topo.master_port, 29500);
}

TEST(DetectTopology, TorchrunVariablesWinOverSlurmAndOpenMpi) {
  const Topology topo = detect({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"},
                                {"OMPI_COMM_WORLD_SIZE", "6"}, {"OMPI_COMM_WORLD_RANK", "5"}});
  EXPECT_EQ(topo.family, LauncherFamily::kTorchrun);
  EXPECT_EQ(topo.rank, 1);
  EXPECT_EQ(topo.world_size, 2);
}

TEST(DetectTopology, ARankNotBelowTheWorldSizeNamesBothVariables) {
  EXPECT_THROWS_WITH(detect({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), "RANK=2 is outside [0, WORLD_SIZE=2)");
}

TEST(DetectTopology, ARankWithoutAWorldSizeIsOutsideAJobOfOne) {
  EXPECT_THROWS_WITH(detect({{"RANK", "1"}}), "RANK=1 is outside [0, WORLD_SIZE=1)");
}

TEST(DetectTopology, ANonIntegerWorldSizeNamesTheVariable) {
  EXPECT_THROWS_WITH(detect({{"RANK", "0"}, {"WORLD_SIZE", "two"}}),
                     "environment variable WORLD_SIZE must be an integer, got 'two'");
  EXPECT_THROWS_WITH(detect({{"RANK", "0"}, {"WORLD_SIZE", "2.0"}}), "WORLD_SIZE must be an integer");
  EXPECT_THROWS_WITH(detect({{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}}), "WORLD_SIZE must be an integer");
}

TEST(DetectTopology, AZeroWorldSizeIsRefused) {
  EXPECT_THROWS_WITH(detect({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), "WORLD_SIZE must be at least 1, got 0");
}

TEST(DetectTopology, ANegativeLocalRankNamesTheVariable) {
  EXPECT_THROWS_WITH(detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "-1"}}),
                     "LOCAL_RANK=-1 is outside [0, LOCAL_WORLD_SIZE=2)");
}

TEST(DetectTopology, ALocalWorldSizeLargerThanTheWorldNamesBothVariables) {
  EXPECT_THROWS_WITH(detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}}),
                     "LOCAL_WORLD_SIZE=3 must be between 1 and WORLD_SIZE=2");
}

TEST(DetectTopology, ANonIntegerOrOutOfRangeMasterPortIsRefused) {
  EXPECT_THROWS_WITH(detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}}),
                     "MASTER_PORT must be an integer, got 'http'");
  EXPECT_THROWS_WITH(detect({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}),
                     "MASTER_PORT must be a TCP port (0-65535), got 70000");
}

// ---- Slurm ----------------------------------------------------------------------------------

TEST(DetectTopology, SlurmVariablesOnOneNodeKeepTheStoreLocal) {
  const Topology topo = detect({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"},
                                {"SLURM_NTASKS_PER_NODE", "2"}, {"SLURM_NNODES", "1"},
                                {"SLURM_STEP_NODELIST", "node07"}});
  EXPECT_EQ(topo.family, LauncherFamily::kSlurm);
  EXPECT_EQ(topo.rank, 1);
  EXPECT_EQ(topo.world_size, 2);
  EXPECT_EQ(topo.local_rank, 1);
  EXPECT_EQ(topo.local_world_size, 2);
  EXPECT_EQ(topo.master_addr, "127.0.0.1");
}

TEST(DetectTopology, SlurmTasksPerNodeInRepeatedFormGivesTheLocalWorldSize) {
  const Topology topo = detect({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "0"},
                                {"SLURM_NTASKS_PER_NODE", "2(x3)"}, {"SLURM_NNODES", "3"},
                                {"SLURM_STEP_NODELIST", "node[07-09],gpu3"}});
  EXPECT_EQ(topo.family, LauncherFamily::kSlurm);
  EXPECT_EQ(topo.rank, 4);
  EXPECT_EQ(topo.world_size, 6);
  EXPECT_EQ(topo.local_rank, 0);
  EXPECT_EQ(topo.local_world_size, 2);
  EXPECT_EQ(topo.master_addr, "node07");
}

TEST(DetectTopology, SlurmFallsBackToTheJobNodeListWithoutAStepNodeList) {
  const Topology topo = detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_NTASKS_PER_NODE", "2"},
                                {"SLURM_NNODES", "2"}, {"SLURM_JOB_NODELIST", "gpu[12-13]"}});
  EXPECT_EQ(topo.master_addr, "gpu12");
}

TEST(DetectTopology, SlurmStepTasksPerNodeIsReadWhenTheTaskCountIsNotGiven) {
  const Topology topo = detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "8"}, {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"},
                                {"SLURM_TASKS_PER_NODE", "1"}});
  EXPECT_EQ(topo.local_world_size, 4);
}

TEST(DetectTopology, SlurmMasterAddrInTheEnvironmentOverridesTheNodeList) {
  const Topology topo = detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_NTASKS_PER_NODE", "2"},
                                {"SLURM_NNODES", "2"}, {"SLURM_STEP_NODELIST", "node[07-08]"},
                                {"MASTER_ADDR", "10.0.0.9"}, {"MASTER_PORT", "29700"}});
  EXPECT_EQ(topo.master_addr, "10.0.0.9");
  EXPECT_EQ(topo.master_port, 29700);
}

TEST(DetectTopology, SlurmWithoutLocalIdOrTasksPerNodeIsOneNode) {
  const Topology topo = detect({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "3"}});
  EXPECT_EQ(topo.family, LauncherFamily::kSlurm);
  EXPECT_EQ(topo.local_rank, 0);
  EXPECT_EQ(topo.local_world_size, 3);
  EXPECT_EQ(topo.master_addr, "127.0.0.1");
}

TEST(DetectTopology, SlurmNeedsBothProcIdAndTaskCount) {
  EXPECT_EQ(detect({{"SLURM_PROCID", "1"}}).family, LauncherFamily::kNone);
  EXPECT_EQ(detect({{"SLURM_NTASKS", "4"}}).family, LauncherFamily::kNone);
}

TEST(DetectTopology, ASlurmProcIdNotBelowTheTaskCountNamesBothVariables) {
  EXPECT_THROWS_WITH(detect({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}}),
                     "SLURM_PROCID=4 is outside [0, SLURM_NTASKS=4)");
}

TEST(DetectTopology, ANonIntegerSlurmValueNamesTheVariable) {
  EXPECT_THROWS_WITH(detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "first"}}),
                     "SLURM_LOCALID must be an integer, got 'first'");
}

TEST(DetectTopology, AnEmptySlurmProcIdIsAnErrorNamingIt) {
  EXPECT_THROWS_WITH(detect({{"SLURM_PROCID", ""}, {"SLURM_NTASKS", "4"}}), "SLURM_PROCID");
  EXPECT_THROWS_WITH(detect({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", ""}}), "SLURM_NTASKS");
}

// ---- Open MPI and MPICH ---------------------------------------------------------------------

TEST(DetectTopology, OpenMpiVariablesDescribeTheJob) {
  const Topology topo = detect({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(topo.family, LauncherFamily::kMpi);
  EXPECT_EQ(topo.rank, 3);
  EXPECT_EQ(topo.world_size, 4);
  EXPECT_EQ(topo.local_rank, 3);
  EXPECT_EQ(topo.local_world_size, 4);
  EXPECT_EQ(topo.master_addr, "127.0.0.1");
}

TEST(DetectTopology, OpenMpiWinsOverMpichVariables) {
  const Topology topo = detect({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"PMI_RANK", "5"},
                                {"PMI_SIZE", "8"}});
  EXPECT_EQ(topo.rank, 1);
  EXPECT_EQ(topo.world_size, 2);
}

TEST(DetectTopology, AnOpenMpiJobOnSeveralMachinesReadsMasterAddr) {
  const Topology topo = detect({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                {"MASTER_ADDR", "head"}});
  EXPECT_EQ(topo.local_rank, 0);
  EXPECT_EQ(topo.local_world_size, 2);
  EXPECT_EQ(topo.master_addr, "head");
}

TEST(DetectTopology, AnOpenMpiJobOnSeveralMachinesWithoutMasterAddrIsRefusedNamingIt) {
  EXPECT_THROWS_WITH(detect({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                             {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
                     "needs MASTER_ADDR set");
}

TEST(DetectTopology, AnOpenMpiRankOutsideTheWorldNamesTheVariables) {
  EXPECT_THROWS_WITH(detect({{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}}),
                     "OMPI_COMM_WORLD_RANK=4 is outside [0, OMPI_COMM_WORLD_SIZE=4)");
}

TEST(DetectTopology, AnEmptyOpenMpiWorldSizeIsAnErrorNamingIt) {
  EXPECT_THROWS_WITH(detect({{"OMPI_COMM_WORLD_SIZE", ""}, {"OMPI_COMM_WORLD_RANK", "0"}}), "OMPI_COMM_WORLD_SIZE");
}

TEST(DetectTopology, MpichPmiVariablesDescribeTheJob) {
  const Topology topo = detect({{"PMI_RANK", "1"}, {"PMI_SIZE", "3"}});
  EXPECT_EQ(topo.family, LauncherFamily::kMpi);
  EXPECT_EQ(topo.rank, 1);
  EXPECT_EQ(topo.world_size, 3);
  EXPECT_EQ(topo.local_rank, 1);
  EXPECT_EQ(topo.local_world_size, 3);
}

TEST(DetectTopology, MpichLocalRanksAreRead) {
  const Topology topo = detect({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"},
                                {"MPI_LOCALNRANKS", "2"}, {"MASTER_ADDR", "head"}});
  EXPECT_EQ(topo.local_rank, 1);
  EXPECT_EQ(topo.local_world_size, 2);
  EXPECT_EQ(topo.master_addr, "head");
}

TEST(DetectTopology, AnMpichRankOutsideTheWorldNamesTheVariables) {
  EXPECT_THROWS_WITH(detect({{"PMI_RANK", "3"}, {"PMI_SIZE", "3"}}), "PMI_RANK=3 is outside [0, PMI_SIZE=3)");
  EXPECT_THROWS_WITH(detect({{"PMI_RANK", "x"}, {"PMI_SIZE", "3"}}), "PMI_RANK must be an integer, got 'x'");
}

// ---- Slurm helpers --------------------------------------------------------------------------

TEST(FirstSlurmHost, APlainHostIsItself) { EXPECT_EQ(first_slurm_host("node07"), "node07"); }

TEST(FirstSlurmHost, TheFirstOfACommaSeparatedListIsTaken) {
  EXPECT_EQ(first_slurm_host("gpu3,node[1-2]"), "gpu3");
  EXPECT_EQ(first_slurm_host("a.example.org,b.example.org"), "a.example.org");
}

TEST(FirstSlurmHost, ABracketGivesItsFirstSuffixWithLeadingZeros) {
  EXPECT_EQ(first_slurm_host("node[07-09],gpu3"), "node07");
  EXPECT_EQ(first_slurm_host("node[07-09,12],gpu3"), "node07");
  EXPECT_EQ(first_slurm_host("node[12,07-09]"), "node12");
  EXPECT_EQ(first_slurm_host("node[3]"), "node3");
}

TEST(FirstSlurmHost, TextAfterABracketBelongsToTheHost) {
  EXPECT_EQ(first_slurm_host("node[07-09]-ib,gpu3"), "node07-ib");
  EXPECT_EQ(first_slurm_host("rack[1-2]-node[01-04]"), "rack1-node01");
}

TEST(FirstSlurmHost, AListWithoutAHostIsRefused) {
  for (const char* list : {"", ",node1", "node[", "node[]", "node[,1]", "node[07"}) {
    EXPECT_THROWS_WITH(first_slurm_host(list), "cannot read a host from the Slurm node list") << list;
  }
}

TEST(ParseSlurmTasksPerNode, APlainCountIsItself) { EXPECT_EQ(parse_slurm_tasks_per_node("8"), 8); }

TEST(ParseSlurmTasksPerNode, TheFirstNodesCountIsTaken) {
  EXPECT_EQ(parse_slurm_tasks_per_node("2(x3)"), 2);
  EXPECT_EQ(parse_slurm_tasks_per_node("4(x2),3"), 4);
  EXPECT_EQ(parse_slurm_tasks_per_node("12,4(x2)"), 12);
}

TEST(ParseSlurmTasksPerNode, TextWithoutALeadingCountIsRefused) {
  for (const char* text : {"", "(x2)", "x", "-1", " 4"}) {
    EXPECT_THROWS_WITH(parse_slurm_tasks_per_node(text), "cannot read a task count from SLURM_NTASKS_PER_NODE=") << text;
  }
}

TEST(ParseSlurmTasksPerNode, ACountBeyondTheRangeOfIntIsRefused) {
  EXPECT_THROWS_WITH(parse_slurm_tasks_per_node("99999999999"), "must be an integer");
}

// ---- parse_env_int --------------------------------------------------------------------------

TEST(ParseEnvInt, ReadsIntegersAndNamesTheVariableOtherwise) {
  EXPECT_EQ(detail::parse_env_int("X", "42"), 42);
  EXPECT_EQ(detail::parse_env_int("X", "-3"), -3);
  EXPECT_THROWS_WITH(detail::parse_env_int("MY_VAR", ""), "MY_VAR must be an integer, got ''");
  EXPECT_THROWS_WITH(detail::parse_env_int("MY_VAR", "4 "), "MY_VAR must be an integer, got '4 '");
}

}  // namespace
}  // namespace accelerate::testing

namespace accelerate::testing {
namespace {

TEST(DetectTopologyErrors, AnOutOfRangeMasterPortIsRefusedEvenWithoutALauncher) {
  EXPECT_THROWS_WITH(detail::detect_topology(detail::map_env({{"MASTER_PORT", "70000"}})),
                     "MASTER_PORT must be a TCP port (0-65535), got 70000");
}

TEST(DetectTopologyErrors, AnEmptyMasterAddrDoesNotSatisfyAMultiMachineOpenMpiJob) {
  EXPECT_THROWS_WITH(detail::detect_topology(detail::map_env({{"OMPI_COMM_WORLD_SIZE", "4"},
                                                              {"OMPI_COMM_WORLD_RANK", "0"},
                                                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                                              {"MASTER_ADDR", ""}})),
                     "needs MASTER_ADDR");
}

TEST(DetectTopologyErrors, ABadSlurmTaskCountNamesTheVariableItCameFrom) {
  EXPECT_THROWS_WITH(detail::detect_topology(detail::map_env(
                         {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_TASKS_PER_NODE", "(x2)"}})),
                     "SLURM_TASKS_PER_NODE");
}

}  // namespace
}  // namespace accelerate::testing
