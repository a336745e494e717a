// The `accelerate env` command (commands/env.h).
#include "accelerate/commands/env.h"

#include "accelerate/utils/environment.h"
#include "detail/blas.h"
#include "support/process.h"
#include "support/commands.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace accelerate::testing {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

CommandOutcome run_env(const std::vector<std::string>& args) { return run_command(commands::env_main, args); }

TEST(EnvCommand, PrintsTheVersionsTheBlasLineAndTheConfigContents) {
  TempDir dir;
  const std::string path = (dir.path() / "my_config.yaml").string();
  std::ofstream(path) << "distributed_type: MULTI_CPU\nnum_processes: 2\n";
  const CommandOutcome outcome = run_env({"--config_file", path});
  ASSERT_EQ(outcome.code, 0) << outcome.err;
  const std::string& text = outcome.out;
  EXPECT_THAT(text, HasSubstr("- `accelerate-cpp` version: " + accelerate_version() + "\n"));
  EXPECT_THAT(text, HasSubstr("- LibTorch version: " + torch_version() + "\n"));
#if defined(__clang__)
  EXPECT_THAT(text, HasSubstr("- Compiler: Clang "));
#elif defined(__GNUC__)
  EXPECT_THAT(text, HasSubstr("- Compiler: GCC " __VERSION__ "\n"));
#endif
  EXPECT_THAT(text, HasSubstr("- C++ standard: C++20"));
  EXPECT_THAT(text, HasSubstr("- Platform: Linux "));
  EXPECT_THAT(text, HasSubstr("- CPU: "));
  EXPECT_THAT(text, HasSubstr(" GB\n"));
  EXPECT_THAT(text, HasSubstr(std::string("- Gloo available: ") + (is_gloo_available() ? "yes" : "no")));
  EXPECT_THAT(text, HasSubstr("- BLAS: "));
  EXPECT_THAT(text, HasSubstr("- Thread settings: OMP_NUM_THREADS="));
  EXPECT_THAT(text, HasSubstr("- `Accelerate` config passed: " + path + "\n"));
  EXPECT_THAT(text, HasSubstr("\tdistributed_type: MULTI_CPU\n\tnum_processes: 2\n"));
}

TEST(EnvCommand, ThreadVariablesAreReported) {
  auto env = patch_environment({{"OMP_NUM_THREADS", "3"}, {"OPENBLAS_NUM_THREADS", "5"}});
  TempDir dir;
  auto home = patch_environment({{"HF_HOME", dir.str()}});
  const CommandOutcome outcome = run_env({});
  EXPECT_THAT(outcome.out, HasSubstr("OMP_NUM_THREADS=3, OPENBLAS_NUM_THREADS=5, MKL_NUM_THREADS="));
}

TEST(EnvCommand, WithoutAConfigFileItSaysNoneWasFound) {
  TempDir dir;
  auto r = run({accelerate_bin(), "env"}, 60, {{"HF_HOME", dir.str()}});
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  EXPECT_THAT(r->out, HasSubstr("- `Accelerate` default config: Not found (no file at " + dir.str() +
                                "/accelerate/default_config.yaml)"));
  EXPECT_THAT(r->out, HasSubstr("- BLAS: "));
}

TEST(EnvCommand, TheDefaultConfigFileIsShownWhenItExists) {
  TempDir dir;
  std::filesystem::create_directories(dir.path() / "accelerate");
  std::ofstream(dir.path() / "accelerate" / "default_config.yaml") << "distributed_type: 'NO'\n";
  auto home = patch_environment({{"HF_HOME", dir.str()}});
  const CommandOutcome outcome = run_env({});
  EXPECT_THAT(outcome.out, HasSubstr("- `Accelerate` default config: " + dir.str() +
                                     "/accelerate/default_config.yaml\n\tdistributed_type: 'NO'\n"));
}

TEST(EnvCommand, AConfigFileAccelerateCppCannotUseIsShownWithTheReason) {
  TempDir dir;
  const std::string path = (dir.path() / "c.yaml").string();
  std::ofstream(path) << "distributed_type: MULTI_CPU\nsome_new_key: 1\n";
  const CommandOutcome outcome = run_env({"--config_file", path});
  EXPECT_EQ(outcome.code, 0);
  EXPECT_THAT(outcome.out, HasSubstr("\tsome_new_key: 1\n"));
  EXPECT_THAT(outcome.out, HasSubstr("not usable by accelerate-cpp"));
  EXPECT_THAT(outcome.out, HasSubstr("unknown keys (some_new_key)"));
}

TEST(EnvCommand, AMissingConfigFileIsAnError) {
  TempDir dir;
  const std::string path = (dir.path() / "none.yaml").string();
  const CommandOutcome outcome = run_env({"--config_file", path});
  EXPECT_EQ(outcome.code, 1);
  EXPECT_THAT(outcome.err, HasSubstr("the configuration file " + path + " does not exist"));
}

TEST(EnvCommand, HelpExitsZeroAndAnUnknownFlagExitsTwo) {
  const CommandOutcome help = run_env({"--help"});
  EXPECT_EQ(help.code, 0);
  EXPECT_THAT(help.out, HasSubstr("--config_file"));
  auto r = run({accelerate_bin(), "env", "--verbose"});
  EXPECT_EQ(r->exit_code(), 2);
  EXPECT_THAT(r->err, HasSubstr("--verbose"));
}

TEST(DetectBlas, NamesTheLibraryTheSystemSelectedForLibTorch) {
  // Debian's LibTorch calls the system's libblas.so.3, which the alternatives system points at
  // one implementation; the answer must be that one.
  const std::filesystem::path system_blas = "/usr/lib/x86_64-linux-gnu/libblas.so.3";
  if (!std::filesystem::exists(system_blas)) GTEST_SKIP() << system_blas << " does not exist here";
  const std::string selected = std::filesystem::canonical(system_blas).string();
  const commands::BlasInfo blas = commands::detect_blas();
  EXPECT_EQ(blas.library, selected);
  EXPECT_THAT(blas.loaded, Contains(selected));
  if (selected.find("openblas") != std::string::npos) {
    EXPECT_EQ(blas.name, "OpenBLAS");
    EXPECT_THAT(blas.config, HasSubstr("OpenBLAS"));
  } else if (selected.find("/blas/") != std::string::npos) {
    EXPECT_EQ(blas.name, "reference BLAS (Netlib)");
  } else {
    EXPECT_NE(blas.name, "not found");
  }
}

TEST(BlasFamily, NamesTheFamilyFromALibraryPathAndNothingForOtherLibraries) {
  EXPECT_EQ(detail::blas_family("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3.11.0"), "reference BLAS (Netlib)");
  EXPECT_EQ(detail::blas_family("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"), "OpenBLAS");
  EXPECT_EQ(detail::blas_family("/usr/lib/x86_64-linux-gnu/libopenblasp-r0.3.21.so"), "OpenBLAS");
  EXPECT_EQ(detail::blas_family("/opt/intel/oneapi/mkl/lib/libMKL_rt.so.2"), "Intel MKL");
  EXPECT_EQ(detail::blas_family("/usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4"), "BLIS");
  EXPECT_EQ(detail::blas_family("/usr/lib/x86_64-linux-gnu/libflexiblas.so.3"), "FlexiBLAS");
  EXPECT_EQ(detail::blas_family("/usr/lib/x86_64-linux-gnu/libtorch_cpu.so.1.13"), "");
  EXPECT_TRUE(detail::is_reference_blas(detail::blas_family("libblas.so.3")));
  EXPECT_FALSE(detail::is_reference_blas(detail::blas_family("libopenblas.so.0")));
}

TEST(ReferenceBlasWarning, NamesTheLibraryOnlyForTheReferenceBlas) {
  detail::BlasInfo reference;
  reference.name = "reference BLAS (Netlib)";
  reference.library = "/x/blas/libblas.so.3.11.0";
  EXPECT_THAT(detail::reference_blas_warning(reference), HasSubstr("reference BLAS (/x/blas/libblas.so.3.11.0)"));
  EXPECT_THAT(detail::reference_blas_warning(reference), HasSubstr("OpenBLAS"));
  detail::BlasInfo openblas;
  openblas.name = "OpenBLAS";
  openblas.library = "/x/libopenblasp-r0.3.21.so";
  EXPECT_EQ(detail::reference_blas_warning(openblas), "");
  detail::BlasInfo none;
  none.name = "not found";
  EXPECT_EQ(detail::reference_blas_warning(none), "");
}

// How often the start-up warning appears in a program's stderr.
size_t reference_blas_warnings(const std::string& err) {
  size_t count = 0;
  for (size_t at = err.find("unoptimised reference BLAS"); at != std::string::npos;
       at = err.find("unoptimised reference BLAS", at + 1)) {
    ++count;
  }
  return count;
}

TEST(ReferenceBlasWarning, AProgramOnTheReferenceBlasIsWarnedExactlyOnceHoweverManyStatesItBuilds) {
  // Debian installs Netlib's libblas.so.3 here (package libblas3); putting its folder first on the
  // library path makes LibTorch bind to it whatever the system selected.
  const std::string reference_dir = "/usr/lib/x86_64-linux-gnu/blas";
  if (!std::filesystem::exists(reference_dir + "/libblas.so.3")) GTEST_SKIP() << "no reference BLAS in " << reference_dir;
  auto r = run({worker_bin(), "states"}, 120, {{"LD_LIBRARY_PATH", reference_dir}});
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  EXPECT_THAT(r->out, HasSubstr("built 3 states"));
  EXPECT_EQ(reference_blas_warnings(r->err), 1u) << r->err;
  EXPECT_THAT(r->err, HasSubstr("reference BLAS (" + std::filesystem::canonical(reference_dir + "/libblas.so.3").string()));
  // A library warning reads like the library's other messages: its logger's line, not glog's.
  EXPECT_THAT(r->err, HasSubstr(" WARNING accelerate.blas: "));
  EXPECT_THAT(r->err, ::testing::Not(HasSubstr("InitGoogleLogging")));
}

TEST(ReferenceBlasWarning, AProgramOnOpenBlasIsNotWarned) {
  const std::string openblas_dir = "/usr/lib/x86_64-linux-gnu/openblas-pthread";
  if (!std::filesystem::exists(openblas_dir + "/libblas.so.3")) GTEST_SKIP() << "no OpenBLAS in " << openblas_dir;
  auto r = run({worker_bin(), "states"}, 120, {{"LD_LIBRARY_PATH", openblas_dir}});
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  EXPECT_THAT(r->out, HasSubstr("built 3 states"));
  EXPECT_EQ(reference_blas_warnings(r->err), 0u) << r->err;
}

}  // namespace
}  // namespace accelerate::testing
