// `accelerate test` end to end: the built-in checks pass on one and two processes, and a check made
// to fail is reported by name with a failing exit code.
#include "accelerate/commands/test.h"

#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A configuration file of `num_processes` CPU processes on a free port.
std::string write_config(const TempDir& dir, int num_processes) {
  const std::string path = dir.str() + "/config.yaml";
  std::ofstream(path) << "compute_environment: LOCAL_MACHINE\n"
                      << "distributed_type: " << (num_processes > 1 ? "MULTI_CPU" : "'NO'") << "\n"
                      << "mixed_precision: 'no'\nnum_processes: " << num_processes << "\n"
                      << "machine_rank: 0\nnum_machines: 1\nmain_process_port: "
                         "0\nuse_cpu: true\n";
  return path;
}

TEST(TestCommand, EveryCheckPassesOnTwoProcesses) {
  TempDir dir;
  auto r = run({accelerate_bin(), "test", "--config_file", write_config(dir, 2)}, 120);
  EXPECT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("running 5 checks on 2 process(es), MULTI_CPU"));
  for (const auto& check : commands::test_checks()) {
    EXPECT_THAT(r->out, HasSubstr("check " + check + ": ok")) << check;
  }
  EXPECT_THAT(r->out, HasSubstr("Test is a success!"));
}

TEST(TestCommand, EveryCheckPassesOnOneProcess) {
  TempDir dir;
  auto r = run({accelerate_bin(), "test", "--config_file", write_config(dir, 1)}, 120);
  EXPECT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("running 5 checks on 1 process(es), NO"));
  EXPECT_THAT(r->out, HasSubstr("Test is a success!"));
}

TEST(TestCommand, AFailingCheckIsNamedAndFailsTheCommand) {
  TempDir dir;
  for (const std::string check : {"collectives", "checkpoint"}) {
    auto r = run({accelerate_bin(), "test", "--config_file", write_config(dir, 2)}, 120,
                 {{"ACCELERATE_TEST_FAIL_CHECK", check}});
    EXPECT_NE(r->exit_code(), 0) << r->out << r->err;
    EXPECT_THAT(r->err, HasSubstr("check '" + check + "' failed on process"));
    EXPECT_THAT(r->out, HasSubstr("Test failed"));
    EXPECT_THAT(r->out, Not(HasSubstr("Test is a success!")));
    // The checks before it passed.
    EXPECT_THAT(r->out, HasSubstr("check training: ok"));
  }
}

TEST(TestCommand, AnUnknownCheckToFailIsRefusedByName) {
  TempDir dir;
  auto r = run({accelerate_bin(), "test", "--config_file", write_config(dir, 1)}, 60,
               {{"ACCELERATE_TEST_FAIL_CHECK", "nonsense"}});
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_THAT(r->err, HasSubstr("ACCELERATE_TEST_FAIL_CHECK names no check: 'nonsense'"));
}

TEST(TestCommand, HelpAndUnknownFlags) {
  auto help = run({accelerate_bin(), "test", "--help"});
  EXPECT_EQ(help->exit_code(), 0);
  EXPECT_THAT(help->out, HasSubstr("--config_file"));
  auto bad = run({accelerate_bin(), "test", "--frobnicate"});
  EXPECT_EQ(bad->exit_code(), 2);
  EXPECT_THAT(bad->err, HasSubstr("--frobnicate"));
}

TEST(TestCommand, AMissingConfigurationFileIsNamed) {
  auto r = run({accelerate_bin(), "test", "--config_file", "/nonexistent/config.yaml"});
  EXPECT_NE(r->exit_code(), 0);
  EXPECT_THAT(r->err, HasSubstr("/nonexistent/config.yaml"));
  EXPECT_THAT(r->out, HasSubstr("Test failed"));
}

}  // namespace
}  // namespace accelerate::testing
