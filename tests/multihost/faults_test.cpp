// Faults across hosts (tests/support/hosts.h): a host that dies, or whose link is cut, in the
// middle of a job. The surviving launcher must end within the process group's timeout with the
// lost host in its root cause, and leave nothing of the job running on its host.
#include "support/hosts.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace accelerate::testing {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

const std::map<std::string, std::string> kSecret = {{"ACCELERATE_RDZV_SECRET", "a-secret-both-hosts-know"}};

// `accelerate launch` of machine `host` of a 2-host job of 4 processes meeting in barriers.
std::vector<std::string> barriers_on(const HostPair& hosts, int host, const std::string& dir,
                                     const std::string& timeout) {
  return hosts.in(host, {accelerate_bin(), "launch", "--num_processes", "4", "--num_machines", "2", "--machine_rank",
                         std::to_string(host), "--main_process_ip", HostPair::address(0), "--main_process_port",
                         "29500", "--rdzv_timeout", "60", "--num_cpu_threads_per_process", "1", "--grace_period", "2",
                         worker_bin(), "barriers", dir, timeout});
}

// Waits until every rank of the job wrote its pid, that is, is past the rendezvous.
bool all_ranks_running(const std::string& dir) {
  for (int rank = 0; rank < 4; ++rank) {
    if (wait_for_int_file(dir + "/pid_" + std::to_string(rank), 60) <= 0) return false;
  }
  return true;
}

TEST(MultiHostFaults, AHostThatDiesEndsTheOtherHostsLauncherNamingTheLostHost) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  Running survivor(barriers_on(hosts, 0, dir.str(), "60"), kSecret);
  Running lost(barriers_on(hosts, 1, dir.str(), "60"), kSecret);
  ASSERT_TRUE(all_ranks_running(dir.str()));
  hosts.kill_host(1);  // every process of host 1, its launcher included
  lost.wait(30);
  survivor.wait(30);  // far below the 60 s timeout: the peers' connections were reset
  EXPECT_NE(survivor.exit_code(), 0);
  EXPECT_THAT(survivor.err, HasSubstr("accelerate launch: worker rank "));
  EXPECT_THAT(survivor.err, HasSubstr("error: [wait_for_everyone] process "));
  EXPECT_THAT(survivor.err, HasSubstr("[" + HostPair::address(1) + "]"));
  // The processes that ran there (Note [Naming the lost machine]).
  EXPECT_THAT(survivor.err, HasSubstr("; " + HostPair::address(1) + " is the machine of processes 2 and 3"));
  EXPECT_TRUE(hosts.pids(0).empty()) << "processes of the job still run on the surviving host";
}

TEST(MultiHostFaults, ACutLinkEndsBothLaunchersWithinTheCollectiveTimeout) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  TempDir dir;
  Running first(barriers_on(hosts, 0, dir.str(), "5"), kSecret);
  Running second(barriers_on(hosts, 1, dir.str(), "5"), kSecret);
  ASSERT_TRUE(all_ranks_running(dir.str()));
  ASSERT_TRUE(hosts.cut_link(1)) << hosts.unavailable();
  first.wait(90);
  second.wait(90);
  for (Running* side : {&first, &second}) {
    EXPECT_NE(side->exit_code(), 0);
    EXPECT_THAT(side->err, HasSubstr("accelerate launch: worker rank "));
    EXPECT_THAT(side->err, AnyOf(HasSubstr("within 5s"), HasSubstr("Timed out"), HasSubstr("timed out")));
  }
  EXPECT_TRUE(hosts.pids(0).empty()) << "processes of the job still run on host 0";
  EXPECT_TRUE(hosts.pids(1).empty()) << "processes of the job still run on host 1";
}

}  // namespace
}  // namespace accelerate::testing
