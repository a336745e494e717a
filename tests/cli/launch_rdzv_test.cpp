// `accelerate launch`'s rendezvous settings as the launcher binary runs them: the config file's
// rdzv_backend, and the --rdzv_conf keys that change how long a launcher waits at the launchers'
// own rendezvous and whether it hosts it (Note [The keys of --rdzv_conf] in src/launch/plan.cpp).
// Every job here is one launcher on this machine that ends within seconds.
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;

class RdzvLaunch : public ::testing::Test {
 protected:
  // A launcher of a job on 127.0.0.1 at a free port; no default configuration file leaks in.
  std::unique_ptr<Running> launch(std::vector<std::string> flags, double seconds = 60) {
    std::vector<std::string> argv = {accelerate_bin(), "launch", "--main_process_ip", "127.0.0.1",
                                     "--main_process_port", std::to_string(port_), "--backend", "gloo"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("/bin/true");
    return run(argv, seconds, {{"HF_HOME", home_.str()}, {"ACCELERATE_RDZV_SECRET", "a-secret"}});
  }

  TempDir home_;
  const int port_ = free_port();
};

TEST_F(RdzvLaunch, TheConfigFilesRdzvBackendRunsAnElasticJobAndTheFlagWinsOverIt) {
  const std::string config = (home_.path() / "c10d.yaml").string();
  std::ofstream(config) << "distributed_type: MULTI_CPU\nrdzv_backend: c10d\n";
  auto r = launch({"--config_file", config, "--nnodes", "1:2", "-n", "2", "--rdzv_conf", "last_call_timeout=0"});
  EXPECT_EQ(r->exit_code(), 0) << r->err;
  EXPECT_THAT(r->err, HasSubstr("round 0 of the rendezvous: this is machine 0 of 1"));

  auto overridden = launch({"--config_file", config, "--rdzv_backend", "static", "--nnodes", "1:2", "-n", "2"});
  EXPECT_EQ(overridden->exit_code(), 2) << overridden->err;
  EXPECT_THAT(overridden->err, HasSubstr("--nnodes 1:2 (an elastic job) needs --rdzv_backend c10d"));
}

// Without join_timeout the host would wait --rdzv_timeout (900 s) for the second machine.
TEST_F(RdzvLaunch, JoinTimeoutEndsTheHostsWaitForTheMinimumOfMachines) {
  auto r = launch({"--rdzv_backend", "c10d", "--nnodes", "2:3", "-n", "3", "--rdzv_conf", "join_timeout=1"});
  EXPECT_EQ(r->exit_code(), 2) << r->err;
  EXPECT_THAT(r->err, HasSubstr("the elastic job needs at least 2 machine(s) (--nnodes 2:3), but only 1 joined "
                                "round 0 of the rendezvous at 127.0.0.1 within rdzv_conf's join_timeout (1s)"));
  EXPECT_LT(r->elapsed, 30) << r->err;
}

// 127.0.0.1 is this machine, whose launcher would host the rendezvous; is_host=false makes it join
// another machine's, where nobody serves one.
TEST_F(RdzvLaunch, IsHostFalseMakesALauncherJoinTheRendezvousInsteadOfServingIt) {
  auto r = launch(
      {"--rdzv_backend", "c10d", "--nnodes", "1:2", "-n", "2", "--rdzv_conf", "is_host=false,join_timeout=1"});
  EXPECT_EQ(r->exit_code(), 2) << r->err;
  EXPECT_THAT(r->err, HasSubstr("could not reach the job's rendezvous at 127.0.0.1:" + std::to_string(port_) +
                                " within rdzv_conf's join_timeout (1s)"));
  EXPECT_LT(r->elapsed, 30) << r->err;
}

TEST_F(RdzvLaunch, ARefusedRdzvConfKeyIsNamedBeforeAnythingStarts) {
  auto r = launch({"--rdzv_backend", "c10d", "--nnodes", "1:2", "-n", "2", "--rdzv_conf", "keep_alive_interval=5"});
  EXPECT_EQ(r->exit_code(), 2) << r->err;
  EXPECT_THAT(r->err, HasSubstr("accelerate launch: error: [launch] --rdzv_conf: keep_alive_interval is not "
                                "supported: accelerate-cpp's rendezvous keeps no keep-alive of its members"));
}

}  // namespace
}  // namespace accelerate::testing
