// Prepared data loaders in real processes started by `accelerate launch -n 2`: the batches that
// the processes gather concatenate to the whole dataset, in order (or, shuffled, as a permutation).
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <sstream>

namespace accelerate::testing {
namespace {

// What rank 0 printed for each mode: the gathered samples, in gathering order.
std::map<std::string, std::vector<int64_t>> gathered_by_mode(const std::string& out) {
  std::map<std::string, std::vector<int64_t>> result;
  std::istringstream lines(out);
  std::string line;
  const std::string prefix = "[rank0]: ";
  while (std::getline(lines, line)) {
    if (line.rfind(prefix, 0) != 0) continue;
    std::istringstream fields(line.substr(prefix.size()));
    std::string mode;
    fields >> mode;
    if (mode.empty() || mode.back() != ':') continue;
    mode.pop_back();
    auto& values = result[mode];
    int64_t v = 0;
    while (fields >> v) values.push_back(v);
  }
  return result;
}

std::vector<int64_t> arange(int64_t n) {
  std::vector<int64_t> out(static_cast<size_t>(n));
  std::iota(out.begin(), out.end(), 0);
  return out;
}

TEST(DataLoaderLaunch, TwoProcessesGatherExactlyTheDatasetInEveryMode) {
  const std::vector<std::string> ordered = {"shard", "split", "dispatch", "dispatch_split", "iterable", "workers"};
  const std::vector<std::string> shuffled = {"shuffle", "shuffle_split", "dispatch_shuffle"};
  std::vector<std::string> argv = {
      accelerate_bin(), "launch", "-n", "2", "--main_process_port", "0", built("tests/mp_data_loader")};
  argv.insert(argv.end(), ordered.begin(), ordered.end());
  argv.insert(argv.end(), shuffled.begin(), shuffled.end());
  argv.push_back("metrics");
  auto r = run(argv, 120);
  ASSERT_EQ(r->exit_code(), 0) << r->err;
  const auto gathered = gathered_by_mode(r->out);
  const auto expected = arange(32 * 2);
  for (const auto& mode : ordered) {
    ASSERT_EQ(gathered.count(mode), 1u) << mode << " missing in:\n" << r->out;
    EXPECT_EQ(gathered.at(mode), expected) << mode;
  }
  for (const auto& mode : shuffled) {
    ASSERT_EQ(gathered.count(mode), 1u) << mode << " missing in:\n" << r->out;
    auto sorted = gathered.at(mode);
    EXPECT_NE(sorted, expected) << mode << " is not shuffled";
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, expected) << mode;
  }
  // 67 samples: the repeated samples of the last round are dropped by gather_for_metrics.
  ASSERT_EQ(gathered.count("metrics"), 1u) << r->out;
  EXPECT_EQ(gathered.at("metrics"), arange(32 * 2 + 3));
}

}  // namespace
}  // namespace accelerate::testing
