// Tests of include/accelerate/utils/tqdm.h: what the bar writes on a terminal and to a log, when it
// writes, and that only the local main process shows it. Time comes from a test clock.
#include "accelerate/utils/tqdm.h"

#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sstream>
#include <string>

namespace accelerate {
namespace {

using ::testing::HasSubstr;

struct FakeClock {
  double seconds = 0;
  std::function<double()> fn() {
    return [this] { return seconds; };
  }
};

int count_of(const std::string& text, char c) { return static_cast<int>(std::count(text.begin(), text.end(), c)); }

TEST(ProgressBar, ALogGetsALineEveryIntervalAndOneAtTheEnd) {
  FakeClock clock;
  std::ostringstream out;
  {
    ProgressBar bar({.total = 100,
                     .desc = "train",
                     .interactive = false,
                     .log_interval = 10,
                     .stream = &out,
                     .state = PartialState::standalone({.process_index = 0, .num_processes = 1}),
                     .clock = clock.fn()});
    for (int i = 0; i < 100; ++i) {
      clock.seconds += 0.5;  // 50 s in all: lines at 10, 20, 30, 40, 50 s, then
                             // the closing one
      bar.update();
    }
    bar.set_postfix("loss=1.5");
  }
  const std::string text = out.str();
  EXPECT_EQ(count_of(text, '\n'), 6) << text;
  EXPECT_EQ(count_of(text, '\r'), 0) << text;
  EXPECT_THAT(text, HasSubstr("train:  20% 20/100 [00:10<00:40, 2.00it/s]\n"));
  // The closing line shows the whole run and the postfix.
  EXPECT_THAT(text, ::testing::EndsWith("train: 100% 100/100 [00:50<00:00, 2.00it/s, loss=1.5]\n"));
}

TEST(ProgressBar, ATerminalRedrawsOneLineAtMostEveryMinInterval) {
  FakeClock clock;
  std::ostringstream out;
  ProgressBar bar({.total = 4,
                   .interactive = true,
                   .min_interval = 1.0,
                   .stream = &out,
                   .state = PartialState::standalone({.process_index = 0, .num_processes = 1}),
                   .clock = clock.fn()});
  bar.update();  // too soon after the first draw
  clock.seconds = 2;
  bar.update();
  bar.close();
  const std::string text = out.str();
  EXPECT_EQ(count_of(text, '\r'), 3) << text;  // start, the update at 2 s, the close
  EXPECT_EQ(count_of(text, '\n'), 1) << text;
  EXPECT_THAT(text, HasSubstr(" 50%|##########          | 2/4 [00:02<00:02, 1.00it/s]"));
}

TEST(ProgressBar, AResumedRunCountsOnlyItsOwnStepsInTheRate) {
  FakeClock clock;
  std::ostringstream out;
  ProgressBar bar({.total = 200,
                   .initial = 100,
                   .interactive = false,
                   .stream = &out,
                   .state = PartialState::standalone({.process_index = 0, .num_processes = 1}),
                   .clock = clock.fn()});
  clock.seconds = 10;
  bar.update(50);
  EXPECT_EQ(bar.n(), 150);
  EXPECT_EQ(bar.format(), " 75% 150/200 [00:10<00:10, 5.00it/s]");
}

TEST(ProgressBar, WithoutATotalItShowsCountAndRate) {
  FakeClock clock;
  std::ostringstream out;
  ProgressBar bar({.unit = "batch",
                   .interactive = false,
                   .stream = &out,
                   .state = PartialState::standalone({.process_index = 0, .num_processes = 1}),
                   .clock = clock.fn()});
  clock.seconds = 4;
  bar.update(2);
  EXPECT_EQ(bar.format(), "2 [00:04, 2.00s/batch]");
}

TEST(ProgressBar, OnlyTheLocalMainProcessShowsIt) {
  std::ostringstream hidden_out, shown_out, main_out;
  testing::run_ranks(2, [&](const PartialState& state) {
    if (state.local_process_index() == 0) {
      ProgressBar bar({.total = 3, .interactive = false, .stream = &main_out, .state = state});
      bar.update(3);
      return;
    }
    {
      ProgressBar hidden({.total = 3, .interactive = false, .stream = &hidden_out, .state = state});
      hidden.update(3);
      EXPECT_TRUE(hidden.disabled());
    }
    // main_process_only = false shows it on every process.
    ProgressBar shown(
        {.total = 3, .main_process_only = false, .interactive = false, .stream = &shown_out, .state = state});
    shown.update(3);
  });
  EXPECT_EQ(hidden_out.str(), "");
  EXPECT_THAT(shown_out.str(), HasSubstr("3/3"));
  EXPECT_THAT(main_out.str(), HasSubstr("3/3"));
}

TEST(ProgressBar, CloseWritesOnceAndLaterUpdatesAreIgnored) {
  std::ostringstream out;
  ProgressBar bar({.total = 2,
                   .interactive = false,
                   .stream = &out,
                   .state = PartialState::standalone({.process_index = 0, .num_processes = 1})});
  bar.update(2);
  bar.close();
  bar.update();
  bar.close();
  EXPECT_EQ(bar.n(), 2);
  EXPECT_EQ(count_of(out.str(), '\n'), 1);
}

TEST(ProgressBar, ANegativeTotalIsRefused) {
  EXPECT_THROWS_WITH(ProgressBar({.total = -1, .disable = true}), "total must be >= 0, got -1");
}

}  // namespace
}  // namespace accelerate
