// What the job's store says about whom it refused (src/detail/store_refusals.h): the first refusal
// at once, the others counted into one line a second, by kind and address.
#include "detail/store_refusals.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

namespace {

using accelerate::detail::Refusal;
using accelerate::detail::RefusalReport;

TEST(RefusalReport, TheFirstRefusalIsNamedAtOnceAndTheNextAreCountedIntoOneLine) {
  std::vector<std::string> lines;
  RefusalReport report([&](const std::string& line) { lines.push_back(line); });
  report.refused("10.0.0.1", "10.0.0.1:4000", Refusal::kWrongSecret, "it does not know the job's secret",
                 "refused a rendezvous connection from ");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0], "refused a rendezvous connection from 10.0.0.1:4000: it does not know the job's secret");
  EXPECT_FALSE(report.counting());

  report.refused("10.0.0.2", "10.0.0.2:4001", Refusal::kWrongSecret, "why", "refused a rendezvous connection from ");
  report.refused("10.0.0.2", "10.0.0.2:4002", Refusal::kStalled, "why", "dropped the rendezvous connection from ");
  EXPECT_EQ(lines.size(), 1u);
  EXPECT_TRUE(report.counting());
  report.report_counted(report.due() - std::chrono::milliseconds(1));  // not yet
  EXPECT_EQ(lines.size(), 1u);

  report.report_counted(report.due());
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1],
            "refused or dropped 2 more rendezvous connections or requests since the last report, from 10.0.0.2: 1 "
            "without the job's secret (ACCELERATE_RDZV_SECRET), 1 dropped for stalling mid-request or mid-reply");
  EXPECT_FALSE(report.counting());
}

TEST(RefusalReport, WithoutACallbackNothingIsCounted) {
  RefusalReport report({});
  report.refused("10.0.0.1", "10.0.0.1:4000", Refusal::kSilent, "why", "refused a rendezvous connection from ");
  report.refused("10.0.0.1", "10.0.0.1:4000", Refusal::kSilent, "why", "refused a rendezvous connection from ");
  EXPECT_FALSE(report.counting());
}

}  // namespace
