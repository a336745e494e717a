// The `accelerate` executable: `launch` runs in a process without LibTorch, every other command
// in `accelerate-commands` (Note [The launcher without LibTorch] in src/launch/CMakeLists.txt).
#include "accelerate/utils/environment.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

namespace fs = std::filesystem;

TEST(AccelerateExecutable, TheLauncherProcessLoadsNoLibTorch) {
  // The worker prints the libraries mapped into its parent, the launcher.
  auto r = run({accelerate_bin(), "launch", "--num_processes", "1", "/bin/sh", "-c", "cat /proc/$PPID/maps"}, 60);
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  EXPECT_THAT(r->out, HasSubstr("libstdc++"));  // the maps were read
  EXPECT_THAT(r->out, HasSubstr("libyaml-cpp"));
  EXPECT_THAT(r->out, Not(HasSubstr("libtorch")));
  EXPECT_THAT(r->out, Not(HasSubstr("libc10")));
}

TEST(AccelerateExecutable, OtherCommandsRunInAccelerateCommands) {
  auto r = run({accelerate_bin(), "version"}, 60);
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  EXPECT_EQ(r->out, "accelerate-cpp " + accelerate_version() + " (LibTorch " + torch_version() + ")\n");
  auto unknown = run({accelerate_bin(), "lanch"}, 60);
  EXPECT_EQ(unknown->exit_code(), 2);
  EXPECT_THAT(unknown->err, HasSubstr("accelerate: unknown command 'lanch'"));
}

TEST(AccelerateExecutable, WithoutAccelerateCommandsOnlyLaunchWorksAndTheOthersSayWhy) {
  TempDir dir;
  const fs::path alone = dir.path() / "accelerate";
  fs::copy_file(accelerate_bin(), alone);
  auto launched = run({alone.string(), "launch", "--num_processes", "2", "--backend", "gloo", "/bin/true"}, 60);
  EXPECT_EQ(launched->exit_code(), 0) << launched->err;
  auto r = run({alone.string(), "env"}, 60);
  EXPECT_EQ(r->exit_code(), 127);
  EXPECT_THAT(r->err, HasSubstr("accelerate: cannot find accelerate-commands, which carries out every command but "
                                "`launch` (looked for " +
                                (dir.path() / "accelerate-commands").string()));
  EXPECT_THAT(r->err, HasSubstr("libexec/accelerate-cpp/accelerate-commands); reinstall accelerate-cpp"));
}

}  // namespace
}  // namespace accelerate::testing
