// A link with a rate between two test hosts (tests/support/hosts.h's `shape`, a token bucket on
// each end), and what the library says it sends across it: the shaped rate is what a plain TCP
// transfer measures, and the bytes `accelerate::communication_counters` counts for DDP (plain and
// fp16-compressed) and FULL_SHARD are what the link's interface carries, less the framing. DDP's
// buckets start while the backward pass is still running. One process per host, W13's program
// (bench/multihost.cpp) at a small size; the whole W13 table is bench/run_multihost's.
#include "support/hosts.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <regex>
#include <sstream>

namespace accelerate::testing {
namespace link_test {  // not anonymous: its names must not meet another file's in a unity batch

constexpr int64_t kMbit = 200;

// The JSON record a program printed (a line that is one object, "[rank0]: " before it through the launcher).
nlohmann::json record_in(const std::string& out) {
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    line = std::regex_replace(line, std::regex(R"(^\[rank\d+\]: )"), "");
    if (line.rfind("{", 0) != 0) continue;
    auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_object()) return record;
  }
  return nullptr;
}

// W13's program on one process per host, machine 0's record.
nlohmann::json train_across(const HostPair& hosts, const std::vector<std::string>& args, const char* port) {
  std::vector<std::unique_ptr<Running>> running;
  for (int host = 0; host < 2; ++host) {
    std::vector<std::string> argv = {accelerate_bin(), "launch", "--num_processes", "2", "--num_machines", "2",
                                     "--machine_rank", std::to_string(host), "--main_process_ip",
                                     HostPair::address(0), "--main_process_port", port, "--rdzv_timeout", "60",
                                     "--num_cpu_threads_per_process", "1", built("bench/bench_multihost")};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), {"--link", hosts.link(host)});
    running.push_back(std::make_unique<Running>(hosts.in(host, argv),
                                                std::map<std::string, std::string>{{"ACCELERATE_RDZV_SECRET", "link"}}));
  }
  for (auto& r : running) r->wait(240);
  for (int host = 0; host < 2; ++host) {
    EXPECT_EQ(running[host]->exit_code(), 0) << "host " << host << ":\n" << running[host]->out << running[host]->err;
  }
  auto record = record_in(running[0]->out);
  EXPECT_TRUE(record.is_object()) << "no record from machine 0:\n" << running[0]->out << running[0]->err;
  return record;
}

TEST(ShapedLink, CarriesItsRateAndTheLibrarysCountIsWhatCrossesIt) {
  HostPair hosts;
  ACCELERATE_REQUIRE_HOSTS(hosts);
  ASSERT_TRUE(hosts.shape(kMbit)) << hosts.unavailable();

  // The rate a plain socket transfer measures: the shaped one, not the veth's gigabytes.
  const std::string rate_py = built("bench/link_rate.py");
  Running sink(hosts.in(1, {"/usr/bin/python3", rate_py, "serve", "29611"}));
  auto sent = run(hosts.in(0, {"/usr/bin/python3", rate_py, "send", HostPair::address(1), "29611", "10"}), 60);
  ASSERT_EQ(sent->exit_code(), 0) << sent->out << sent->err;
  const double mbit = nlohmann::json::parse(sent->out)["mbit_per_s"].get<double>();
  EXPECT_GE(mbit, 0.5 * kMbit) << "the shaped link carries far less than its rate";
  EXPECT_LE(mbit, 1.05 * kMbit) << "the link is not shaped";

  // DDP: each process sends its whole gradient once per step (2 processes: 2 (p - 1) / p = 1).
  const std::vector<std::string> size = {"--width", "256", "--blocks", "4", "--rows", "16", "--steps", "3",
                                         "--warmup", "1", "--bucket_cap_mb", "1"};
  auto with = [&](std::vector<std::string> args) {
    args.insert(args.end(), size.begin(), size.end());
    return args;
  };
  const auto ddp = train_across(hosts, with({"ddp"}), "29612");
  ASSERT_TRUE(ddp.is_object());
  const double gradient_bytes = ddp["params"].get<double>() * 4;
  EXPECT_EQ(ddp["counted_sent_per_step"].get<double>(), gradient_bytes);
  const double ddp_link = ddp["link_tx_per_step"].get<double>();
  EXPECT_GT(ddp_link, gradient_bytes) << "the interface carried less than the library counted";
  EXPECT_LT(ddp_link, 1.2 * gradient_bytes) << "the interface carried far more than the library counted";
  EXPECT_GE(ddp["collectives_per_step"].get<double>(), 4) << "1 MB buckets of an 8 MB gradient";
  EXPECT_GE(ddp["started_before_backward_end"].get<double>(), 1)
      << "no bucket went on the wire before the backward pass reached the first block";

  // The fp16 hook halves the bytes, on the count and on the wire.
  const auto fp16 = train_across(hosts, with({"ddp", "--comm_hook", "fp16"}), "29613");
  ASSERT_TRUE(fp16.is_object());
  EXPECT_EQ(fp16["counted_sent_per_step"].get<double>(), gradient_bytes / 2);
  const double ratio = fp16["link_tx_per_step"].get<double>() / ddp_link;
  EXPECT_GT(ratio, 0.45) << "fp16 buckets carried " << ratio << " of fp32's bytes";
  EXPECT_LT(ratio, 0.55) << "fp16 buckets carried " << ratio << " of fp32's bytes";

  // FULL_SHARD: its gathers and reduce-scatters as counted are what crosses.
  const auto sharded = train_across(hosts, with({"full_shard"}), "29614");
  ASSERT_TRUE(sharded.is_object());
  const double counted = sharded["counted_sent_per_step"].get<double>();
  EXPECT_GT(counted, gradient_bytes) << "FULL_SHARD gathers the parameters twice and reduces the gradients";
  const double link = sharded["link_tx_per_step"].get<double>();
  EXPECT_GT(link, counted);
  EXPECT_LT(link, 1.2 * counted);
}

}  // namespace link_test
}  // namespace accelerate::testing
