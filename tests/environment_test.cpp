// Environment flags, scoped environment changes, version comparison and availability checks
// (utils/environment.h).
#include "accelerate/utils/environment.h"

#include "detail/topology.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <dlfcn.h>
#include <sched.h>

#include <fstream>
#include <torch/version.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

// The value of an environment variable, or "<unset>".
std::string env_or_unset(const char* key) {
  const char* value = std::getenv(key);
  return value == nullptr ? "<unset>" : value;
}

std::vector<std::pair<std::string, std::string>> sorted_environment() {
  auto entries = detail::environment_entries();
  std::sort(entries.begin(), entries.end());
  return entries;
}

// ---- parse_flag_from_env --------------------------------------------------------------------

TEST(ParseFlagFromEnv, EverySpellingOfTrueReadsTrue) {
  for (const char* spelling : {"1", "true", "TRUE", "True", "yes", "YES", "on", "On", "y", "t"}) {
    auto env = patch_environment({{"ACCELERATE_TEST_FLAG", spelling}});
    EXPECT_TRUE(parse_flag_from_env("ACCELERATE_TEST_FLAG", /*default_value=*/false)) << spelling;
  }
}

TEST(ParseFlagFromEnv, EverySpellingOfFalseReadsFalse) {
  for (const char* spelling : {"0", "false", "FALSE", "False", "no", "NO", "off", "OFF", "n", "f"}) {
    auto env = patch_environment({{"ACCELERATE_TEST_FLAG", spelling}});
    EXPECT_FALSE(parse_flag_from_env("ACCELERATE_TEST_FLAG", /*default_value=*/true)) << spelling;
  }
}

TEST(ParseFlagFromEnv, AnUnsetVariableGivesTheDefault) {
  ASSERT_EQ(env_or_unset("ACCELERATE_TEST_NEVER_SET"), "<unset>");
  EXPECT_TRUE(parse_flag_from_env("ACCELERATE_TEST_NEVER_SET", /*default_value=*/true));
  EXPECT_FALSE(parse_flag_from_env("ACCELERATE_TEST_NEVER_SET", /*default_value=*/false));
  EXPECT_FALSE(parse_flag_from_env("ACCELERATE_TEST_NEVER_SET"));
}

TEST(ParseFlagFromEnv, AValueThatIsNotABooleanThrowsNamingTheVariable) {
  auto env = patch_environment({{"ACCELERATE_TEST_FLAG", "maybe"}});
  EXPECT_THROWS_WITH(parse_flag_from_env("ACCELERATE_TEST_FLAG"), "ACCELERATE_TEST_FLAG");
  EXPECT_THROWS_WITH(parse_flag_from_env("ACCELERATE_TEST_FLAG"), "got 'maybe'");
}

TEST(ParseFlagFromEnv, ANumberOtherThanZeroOrOneIsNotABoolean) {
  auto env = patch_environment({{"ACCELERATE_TEST_FLAG", "2"}});
  EXPECT_THROWS_WITH(parse_flag_from_env("ACCELERATE_TEST_FLAG"), "ACCELERATE_TEST_FLAG must be a boolean");
}

// ---- get_int_from_env -----------------------------------------------------------------------

TEST(GetIntFromEnv, TheFirstKeyThatIsSetWins) {
  auto env = patch_environment({{"ACCELERATE_TEST_INT_B", "3"}, {"ACCELERATE_TEST_INT_C", "4"}});
  EXPECT_EQ(get_int_from_env({"ACCELERATE_TEST_INT_A", "ACCELERATE_TEST_INT_B", "ACCELERATE_TEST_INT_C"}, 9), 3);
  EXPECT_EQ(get_int_from_env({"ACCELERATE_TEST_INT_C", "ACCELERATE_TEST_INT_B"}, 9), 4);
}

TEST(GetIntFromEnv, NoKeySetGivesTheDefault) {
  EXPECT_EQ(get_int_from_env({"ACCELERATE_TEST_INT_A", "ACCELERATE_TEST_INT_Z"}, 17), 17);
  EXPECT_EQ(get_int_from_env({}, -2), -2);
}

TEST(GetIntFromEnv, NegativeValuesCountAsUnsetAsUpstream) {
  auto env = patch_environment({{"ACCELERATE_TEST_INT_A", "-5"}, {"ACCELERATE_TEST_INT_B", "6"}});
  EXPECT_EQ(get_int_from_env({"ACCELERATE_TEST_INT_A"}, 0), 0);
  EXPECT_EQ(get_int_from_env({"ACCELERATE_TEST_INT_A", "ACCELERATE_TEST_INT_B"}, 0), 6);
}

TEST(GetIntFromEnv, ANonIntegerThrowsNamingTheVariable) {
  auto env = patch_environment({{"ACCELERATE_TEST_INT_B", "three"}});
  EXPECT_THROWS_WITH(get_int_from_env({"ACCELERATE_TEST_INT_A", "ACCELERATE_TEST_INT_B"}, 0),
                     "ACCELERATE_TEST_INT_B must be an integer, got 'three'");
}

TEST(GetIntFromEnv, TrailingCharactersAfterTheNumberAreRefused) {
  auto env = patch_environment({{"ACCELERATE_TEST_INT_A", "4x"}});
  EXPECT_THROWS_WITH(get_int_from_env({"ACCELERATE_TEST_INT_A"}, 0), "got '4x'");
}

TEST(GetIntFromEnv, AValueBeyondTheRangeOfIntIsRefused) {
  auto env = patch_environment({{"ACCELERATE_TEST_INT_A", "99999999999"}});
  EXPECT_THROWS_WITH(get_int_from_env({"ACCELERATE_TEST_INT_A"}, 0), "ACCELERATE_TEST_INT_A must be an integer");
}

// ---- patch_environment ----------------------------------------------------------------------

TEST(PatchEnvironment, KeysAreUpperCased) {
  {
    auto env = patch_environment({{"accelerate_test_lower", "bar"}});
    EXPECT_EQ(env_or_unset("ACCELERATE_TEST_LOWER"), "bar");
    EXPECT_EQ(env_or_unset("accelerate_test_lower"), "<unset>");
  }
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_LOWER"), "<unset>");
}

TEST(PatchEnvironment, APreviousValueIsRestoredOnScopeExit) {
  ::setenv("ACCELERATE_TEST_PATCHED", "before", 1);
  {
    auto env = patch_environment({{"ACCELERATE_TEST_PATCHED", "during"}});
    EXPECT_EQ(env_or_unset("ACCELERATE_TEST_PATCHED"), "during");
  }
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_PATCHED"), "before");
  ::unsetenv("ACCELERATE_TEST_PATCHED");
}

TEST(PatchEnvironment, AnAbsentVariableIsAbsentAgainOnScopeExit) {
  ASSERT_EQ(env_or_unset("ACCELERATE_TEST_PATCHED"), "<unset>");
  {
    auto env = patch_environment({{"ACCELERATE_TEST_PATCHED", "during"}, {"ACCELERATE_TEST_OTHER", ""}});
    EXPECT_EQ(env_or_unset("ACCELERATE_TEST_PATCHED"), "during");
    EXPECT_EQ(env_or_unset("ACCELERATE_TEST_OTHER"), "");
  }
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_PATCHED"), "<unset>");
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_OTHER"), "<unset>");
}

TEST(PatchEnvironment, AnEmptyPreviousValueIsRestoredAsEmptyNotRemoved) {
  ::setenv("ACCELERATE_TEST_PATCHED", "", 1);
  { auto env = patch_environment({{"ACCELERATE_TEST_PATCHED", "during"}}); }
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_PATCHED"), "");
  ::unsetenv("ACCELERATE_TEST_PATCHED");
}

TEST(PatchEnvironment, TheEnvironmentIsRestoredWhenAnExceptionUnwinds) {
  ::setenv("ACCELERATE_TEST_PATCHED", "before", 1);
  EXPECT_THROW(
      {
        auto env = patch_environment({{"ACCELERATE_TEST_PATCHED", "during"}, {"ACCELERATE_TEST_NEW", "x"}});
        EXPECT_EQ(env_or_unset("ACCELERATE_TEST_PATCHED"), "during");
        throw std::runtime_error("boom");
      },
      std::runtime_error);
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_PATCHED"), "before");
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_NEW"), "<unset>");
  ::unsetenv("ACCELERATE_TEST_PATCHED");
}

TEST(PatchEnvironment, NestedPatchesRestoreInTurn) {
  {
    auto outer = patch_environment({{"ACCELERATE_TEST_PATCHED", "outer"}});
    {
      auto inner = patch_environment({{"ACCELERATE_TEST_PATCHED", "inner"}});
      EXPECT_EQ(env_or_unset("ACCELERATE_TEST_PATCHED"), "inner");
    }
    EXPECT_EQ(env_or_unset("ACCELERATE_TEST_PATCHED"), "outer");
  }
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_PATCHED"), "<unset>");
}

TEST(PatchEnvironment, TwoSpellingsOfOneKeyStillRestoreTheOriginal) {
  ::setenv("ACCELERATE_TEST_PATCHED", "before", 1);
  { auto env = patch_environment({{"accelerate_test_patched", "a"}, {"ACCELERATE_TEST_PATCHED", "b"}}); }
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_PATCHED"), "before");
  ::unsetenv("ACCELERATE_TEST_PATCHED");
}

// ---- clear_environment ----------------------------------------------------------------------

TEST(ClearEnvironment, TheEnvironmentIsEmptyInsideTheScope) {
  auto env = patch_environment({{"ACCELERATE_TEST_CLEARED", "value"}});
  ASSERT_FALSE(detail::environment_entries().empty());
  {
    auto cleared = clear_environment();
    EXPECT_TRUE(detail::environment_entries().empty());
    EXPECT_EQ(env_or_unset("ACCELERATE_TEST_CLEARED"), "<unset>");
  }
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_CLEARED"), "value");
}

TEST(ClearEnvironment, TheEnvironmentIsRestoredExactlyAndKeysAddedInsideAreDropped) {
  auto env = patch_environment({{"ACCELERATE_TEST_CLEARED", "value"}});
  const auto before = sorted_environment();
  {
    auto cleared = clear_environment();
    ::setenv("ACCELERATE_TEST_ADDED_INSIDE", "1", 1);
    ::setenv("ACCELERATE_TEST_CLEARED", "changed inside", 1);
  }
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_ADDED_INSIDE"), "<unset>");
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_CLEARED"), "value");
  EXPECT_EQ(sorted_environment(), before);
}

TEST(ClearEnvironment, TheEnvironmentIsRestoredWhenAnExceptionUnwinds) {
  const auto before = sorted_environment();
  EXPECT_THROW(
      {
        auto cleared = clear_environment();
        ::setenv("ACCELERATE_TEST_ADDED_INSIDE", "1", 1);
        throw std::runtime_error("boom");
      },
      std::runtime_error);
  EXPECT_EQ(sorted_environment(), before);
}

// ---- purge_accelerate_environment -----------------------------------------------------------

TEST(PurgeAccelerateEnvironment, VariablesAddedByTheFunctionAreRemovedAfterIt) {
  auto purged = purge_accelerate_environment([] {
    ::setenv("ACCELERATE_TEST_ADDED_INSIDE", "1", 1);
    return env_or_unset("ACCELERATE_TEST_ADDED_INSIDE");
  });
  EXPECT_EQ(purged(), "1");
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_ADDED_INSIDE"), "<unset>");
}

TEST(PurgeAccelerateEnvironment, ChangedAndRemovedVariablesGetTheirValuesBack) {
  auto env = patch_environment({{"ACCELERATE_TEST_EXISTING", "old"}, {"ACCELERATE_TEST_DOOMED", "kept"}});
  auto purged = purge_accelerate_environment([] {
    ::setenv("ACCELERATE_TEST_EXISTING", "new", 1);
    ::unsetenv("ACCELERATE_TEST_DOOMED");
  });
  purged();
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_EXISTING"), "old");
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_DOOMED"), "kept");
}

TEST(PurgeAccelerateEnvironment, OtherVariablesAreLeftAsTheFunctionSetThem) {
  auto purged = purge_accelerate_environment([] { ::setenv("NOT_ACCELERATE_TEST_VAR", "kept", 1); });
  purged();
  EXPECT_EQ(env_or_unset("NOT_ACCELERATE_TEST_VAR"), "kept");
  ::unsetenv("NOT_ACCELERATE_TEST_VAR");
}

TEST(PurgeAccelerateEnvironment, ArgumentsAndTheReturnValuePassThrough) {
  auto purged = purge_accelerate_environment([](int a, const std::string& b) { return b + std::to_string(a * 2); });
  EXPECT_EQ(purged(21, "answer "), "answer 42");
}

TEST(PurgeAccelerateEnvironment, VariablesAreRestoredWhenTheFunctionThrows) {
  auto env = patch_environment({{"ACCELERATE_TEST_EXISTING", "old"}});
  auto purged = purge_accelerate_environment([] {
    ::setenv("ACCELERATE_TEST_EXISTING", "new", 1);
    ::setenv("ACCELERATE_TEST_ADDED_INSIDE", "1", 1);
    throw std::runtime_error("boom");
  });
  EXPECT_THROW(purged(), std::runtime_error);
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_EXISTING"), "old");
  EXPECT_EQ(env_or_unset("ACCELERATE_TEST_ADDED_INSIDE"), "<unset>");
}

// ---- compare_versions / is_torch_version ----------------------------------------------------

TEST(CompareVersions, EveryOperationComparesALongerVersionWithAShorterOne) {
  EXPECT_TRUE(compare_versions("1.13.1", ">", "1.13"));
  EXPECT_TRUE(compare_versions("1.13.1", ">=", "1.13"));
  EXPECT_TRUE(compare_versions("1.13.1", "!=", "1.13"));
  EXPECT_FALSE(compare_versions("1.13.1", "==", "1.13"));
  EXPECT_FALSE(compare_versions("1.13.1", "<", "1.13"));
  EXPECT_FALSE(compare_versions("1.13.1", "<=", "1.13"));
}

TEST(CompareVersions, MissingTrailingComponentsCountAsZero) {
  EXPECT_TRUE(compare_versions("1.13", "==", "1.13.0"));
  EXPECT_TRUE(compare_versions("1.13.0", "<=", "1.13"));
  EXPECT_TRUE(compare_versions("1.13.0", ">=", "1.13"));
  EXPECT_FALSE(compare_versions("1.13", "!=", "1.13.0"));
  EXPECT_FALSE(compare_versions("1.13", "<", "1.13.0"));
  EXPECT_FALSE(compare_versions("1.13", ">", "1.13.0"));
}

TEST(CompareVersions, ComponentsCompareAsNumbersNotText) {
  EXPECT_TRUE(compare_versions("1.10", ">", "1.9"));
  EXPECT_TRUE(compare_versions("2.0", ">", "1.13.1"));
  EXPECT_TRUE(compare_versions("0.9.9", "<", "0.10"));
}

TEST(CompareVersions, LocalSuffixesAreIgnored) {
  EXPECT_TRUE(compare_versions("2.1.0+cpu", "==", "2.1"));
  EXPECT_TRUE(compare_versions("2.1.0a0", "==", "2.1.0"));
}

TEST(CompareVersions, AnUnknownOperationIsRefusedByName) {
  EXPECT_THROWS_WITH(compare_versions("1.13", "=>", "1.13"), "expected an operation among");
  EXPECT_THROWS_WITH(compare_versions("1.13", "=>", "1.13"), "got '=>'");
  EXPECT_THROWS_WITH(compare_versions("1.13", "", "1.13"), "got ''");
}

TEST(CompareVersions, TextThatIsNotAVersionIsRefused) {
  EXPECT_THROWS_WITH(compare_versions("latest", ">", "1.0"), "got 'latest'");
  EXPECT_THROWS_WITH(compare_versions("1.0", ">", ""), "expected a dotted version");
}

TEST(IsTorchVersion, ComparesTheLibTorchThisProgramIsBuiltWith) {
  EXPECT_EQ(torch_version(), std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
                                 std::to_string(TORCH_VERSION_PATCH));
  EXPECT_TRUE(is_torch_version("==", torch_version()));
  EXPECT_TRUE(is_torch_version(">=", "1.0"));
  EXPECT_TRUE(is_torch_version("<", "100.0"));
  EXPECT_FALSE(is_torch_version(">", torch_version()));
  const std::string next_minor = std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR + 1);
  EXPECT_TRUE(is_torch_version("<", next_minor));
}

TEST(IsTorchVersion, AnUnknownOperationIsRefused) {
  EXPECT_THROWS_WITH(is_torch_version("~=", "1.13"), "got '~='");
}

// ---- availability ---------------------------------------------------------------------------

TEST(Availability, GlooIsBuiltIntoThisLibTorch) { EXPECT_TRUE(is_gloo_available()); }

TEST(Availability, NcclExactlyWhenLibTorchLinksItAndPythonOnlyBackEndsNever) {
  // LibTorch's CUDA build links libnccl into the process; the CPU build does not.
  const bool nccl_linked = ::dlsym(RTLD_DEFAULT, "ncclGetVersion") != nullptr;
  EXPECT_EQ(is_nccl_available(), nccl_linked);
  EXPECT_FALSE(is_mps_available());
  EXPECT_FALSE(is_xpu_available());
  EXPECT_FALSE(is_torch_xla_available());
  EXPECT_FALSE(is_deepspeed_available());
}

// Intel's extension for PyTorch and Ascend's torch_npu are Python packages (docs/porting.md):
// accelerate-cpp has no way to use them, so both answer false whatever the environment says,
// including the variables upstream's launcher sets for them.
TEST(Availability, IpexAndNpuArePythonOnlyAndNeverAvailable) {
  EXPECT_FALSE(is_ipex_available());
  EXPECT_FALSE(is_npu_available());
  auto env = patch_environment({{"ACCELERATE_USE_IPEX", "true"}, {"ASCEND_RT_VISIBLE_DEVICES", "0"}});
  EXPECT_FALSE(is_ipex_available());
  EXPECT_FALSE(is_npu_available());
}

TEST(Availability, MpiIsAvailableExactlyWhenTheBuildLinkedIt) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  bool linked = false;
  while (std::getline(maps, line)) linked = linked || line.find("/libmpi.so") != std::string::npos;
  EXPECT_EQ(is_mpi_available(), linked);
}

TEST(Availability, Bf16IsAvailableOnTheCpu) {
  ASSERT_FALSE(is_cuda_available()) << "this check is about a CPU-only machine";
  EXPECT_TRUE(is_bf16_available());
  EXPECT_FALSE(is_fp16_available());
}

// ---- set_numa_affinity ----------------------------------------------------------------------

int numa_nodes_on_this_machine() {
  int nodes = 0;
  std::error_code ignored;
  for (const auto& entry : std::filesystem::directory_iterator("/sys/devices/system/node", ignored)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("node", 0) == 0 && name.size() > 4 &&
        std::all_of(name.begin() + 4, name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      ++nodes;
    }
  }
  return nodes;
}

TEST(SetNumaAffinity, TheFirstLocalProcessGoesToNodeZero) {
  if (!is_numa_available()) GTEST_SKIP() << "built without libnuma, or the kernel has no NUMA support";
  EXPECT_EQ(set_numa_affinity(0), 0);
}

TEST(SetNumaAffinity, LocalProcessesWrapAroundTheNodes) {
  if (!is_numa_available()) GTEST_SKIP() << "built without libnuma, or the kernel has no NUMA support";
  const int nodes = numa_nodes_on_this_machine();
  ASSERT_GE(nodes, 1);
  EXPECT_EQ(set_numa_affinity(nodes), 0);
  EXPECT_EQ(set_numa_affinity(nodes + nodes - 1), nodes - 1);
  EXPECT_EQ(set_numa_affinity(0), 0);
}

TEST(SetNumaAffinity, OverrideBindsEveryTimeAndLogsTheCoresWhenVerbose) {
  if (!is_numa_available()) GTEST_SKIP() << "built without libnuma, or the kernel has no NUMA support";
  CapturedLines captured;
  get_logger("accelerate.utils.environment", "INFO");
  EXPECT_EQ(override_numa_affinity(0, /*verbose=*/true), 0);
  ASSERT_EQ(captured.lines().size(), 1u);
  cpu_set_t cpus;
  ASSERT_EQ(sched_getaffinity(0, sizeof cpus, &cpus), 0);
  EXPECT_THAT(captured.lines()[0], ::testing::HasSubstr("INFO accelerate.utils.environment: Assigning " +
                                                          std::to_string(CPU_COUNT(&cpus)) + " cpu cores to process 0: {"));
  EXPECT_EQ(override_numa_affinity(0, /*verbose=*/false), 0);
  EXPECT_EQ(captured.lines().size(), 1u);
  // The verbose default comes from ACCELERATE_DEBUG_MODE.
  auto env = patch_environment({{"ACCELERATE_DEBUG_MODE", "1"}});
  EXPECT_EQ(override_numa_affinity(0), 0);
  EXPECT_EQ(captured.lines().size(), 2u);
  // set_numa_affinity does the work once per arguments: the same call again logs nothing.
  EXPECT_EQ(set_numa_affinity(0, true), 0);
  EXPECT_EQ(set_numa_affinity(0, true), 0);
  EXPECT_EQ(captured.lines().size(), 3u);
}

TEST(SetNumaAffinity, ANegativeLocalIndexIsRefused) {
  EXPECT_THROWS_WITH(set_numa_affinity(-1), "expected a local process index >= 0, got -1");
  EXPECT_THROWS_WITH(override_numa_affinity(-1), "expected a local process index >= 0, got -1");
}

}  // namespace
}  // namespace accelerate::testing
