// Experiment tracking in real processes started by `accelerate launch -n 2`: only the main process
// writes the trackers' files, and the TensorBoard file reads back with the independent reader.
#include "detail/files.h"
#include "support/process.h"
#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <sstream>
#include <string>

namespace accelerate::testing {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;
using json = nlohmann::json;

TEST(TrackingLaunch, OnlyTheMainProcessWritesTheTrackersFiles) {
  TempDir dir;
  auto r = run(
      {accelerate_bin(), "launch", "-n", "2", "--main_process_port", "0", built("tests/mp_tracking"), dir.str()}, 120);
  ASSERT_EQ(r->exit_code(), 0) << r->out << r->err;
  EXPECT_THAT(r->out, HasSubstr("process 0 tensorboard real"));
  EXPECT_THAT(r->out, HasSubstr("process 1 tensorboard blank"));

  const fs::path run_dir = dir.path() / "run";
  std::istringstream jsonl(detail::read_file((run_dir / "log.jsonl").string()));
  int lines = 0;
  for (std::string line; std::getline(jsonl, line); ++lines) {
    EXPECT_EQ(json::parse(line).at("values").at("rank"), 0) << line;
  }
  EXPECT_EQ(lines, 3);
  EXPECT_EQ(detail::read_file((run_dir / "plots" / "metrics" / "rank.tsv").string()), "step\trank\n0\t0\n1\t0\n2\t0\n");
  EXPECT_EQ(detail::read_file((run_dir / "params.yaml").string()), "learning_rate: 0.5\nprocesses: 2\n");

  auto python = run({"/usr/bin/python3", built("tests/python/tensorboard_check.py"), run_dir.string()});
  ASSERT_EQ(python->exit_code(), 0) << python->err;
  const json out = json::parse(python->out);
  const auto& events = out.at("runs").at(".").at("events");
  ASSERT_EQ(events.size(), 7u);  // the file version, then loss and rank for three steps
  for (int step = 0; step < 3; ++step) {
    const auto& loss = events.at(1 + 2 * step);
    EXPECT_EQ(loss.at("step"), step);
    EXPECT_EQ(loss.at("values").at(0).at("tag"), "loss");
    EXPECT_EQ(loss.at("values").at(0).at("simple_value"), static_cast<double>(static_cast<float>(1.0 / (step + 1))));
    EXPECT_EQ(events.at(2 + 2 * step).at("values").at(0).at("simple_value"), 0.0);
  }
}

}  // namespace
}  // namespace accelerate::testing
