// Tests of include/accelerate/logging.h: levels, main-process-only and ordered messages, the rank
// prefix, and the errors of a logger used too early or given an unknown level.
#include "accelerate/logging.h"
#include "detail/warn.h"

#include "support/test_support.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace accelerate {
namespace {

using ::testing::HasSubstr;
using testing::run_ranks;

using testing::CapturedLines;

// Sets an environment variable for one test.
class ScopedEnv {
 public:
  ScopedEnv(const char* key, const char* value) : key_(key) {
    if (const char* old = std::getenv(key)) old_ = old;
    if (value) {
      ::setenv(key, value, 1);
    } else {
      ::unsetenv(key);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(key_, old_->c_str(), 1);
    } else {
      ::unsetenv(key_);
    }
  }

 private:
  const char* key_;
  std::optional<std::string> old_;
};

TEST(ParseLogLevel, AcceptsPythonsNamesInAnyCaseAndTheirNumbers) {
  EXPECT_EQ(parse_log_level("debug"), LogLevel::kDebug);
  EXPECT_EQ(parse_log_level("Info"), LogLevel::kInfo);
  EXPECT_EQ(parse_log_level("WARN"), LogLevel::kWarning);
  EXPECT_EQ(parse_log_level("fatal"), LogLevel::kCritical);
  EXPECT_EQ(parse_log_level("40"), LogLevel::kError);
  EXPECT_THROWS_WITH(parse_log_level("LOUD"), "unknown log level 'LOUD'");
  EXPECT_THROWS_WITH(parse_log_level("35"), "unknown log level '35'");
}

TEST(GetLogger, TheSameNameGivesTheSameLogger) {
  ScopedEnv env("ACCELERATE_LOG_LEVEL", nullptr);
  auto a = get_logger("logging_test.same");
  auto b = get_logger("logging_test.same");
  a.set_level(LogLevel::kError);
  EXPECT_EQ(b.level(), LogLevel::kError);
  EXPECT_EQ(b.name(), "logging_test.same");
}

TEST(GetLogger, DefaultsToWarningLikePython) {
  ScopedEnv env("ACCELERATE_LOG_LEVEL", nullptr);
  auto logger = get_logger("logging_test.default");
  EXPECT_EQ(logger.level(), LogLevel::kWarning);
  EXPECT_FALSE(logger.is_enabled_for(LogLevel::kInfo));
  EXPECT_TRUE(logger.is_enabled_for(LogLevel::kError));
}

TEST(GetLogger, TheLevelComesFromTheEnvironmentWhenNotGiven) {
  ScopedEnv env("ACCELERATE_LOG_LEVEL", "debug");
  EXPECT_EQ(get_logger("logging_test.env").level(), LogLevel::kDebug);
  // An explicit level wins over the environment.
  EXPECT_EQ(get_logger("logging_test.env_explicit", "ERROR").level(), LogLevel::kError);
}

TEST(GetLogger, AnUnknownLevelInTheEnvironmentIsNamed) {
  ScopedEnv env("ACCELERATE_LOG_LEVEL", "chatty");
  EXPECT_THROWS_WITH(get_logger("logging_test.bad_env"), "unknown log level 'chatty'");
}

TEST(Logger, LoggingBeforeAnyStateExistsIsRefused) {
  PartialState::reset();
  auto logger = get_logger("logging_test.early", "INFO");
  EXPECT_THROWS_WITH(logger.info("hello"), "you must initialise the process state");
}

TEST(Logger, ASingleProcessWritesLevelNameAndMessage) {
  ScopedEnv prefixed("ACCELERATE_LAUNCH_PREFIXES_OUTPUT", nullptr);
  CapturedLines captured;
  auto logger = get_logger("logging_test.single", "INFO")
                    .with_state(PartialState::standalone({.process_index = 0, .num_processes = 1}));
  logger.debug("dropped below the level");
  logger.info("kept");
  logger.warning("also kept", {.main_process_only = false});
  const auto lines = captured.lines();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_THAT(lines[0], HasSubstr(" INFO logging_test.single: kept"));
  // One process: no rank prefix even for a message of every process.
  EXPECT_THAT(lines[1], HasSubstr(" WARNING logging_test.single: also kept"));
  EXPECT_THAT(lines[1], ::testing::Not(HasSubstr("[rank")));
}

TEST(Logger, OnlyTheMainProcessWritesByDefault) {
  ScopedEnv prefixed("ACCELERATE_LAUNCH_PREFIXES_OUTPUT", nullptr);
  CapturedLines captured;
  run_ranks(3, [](const PartialState& state) {
    get_logger("logging_test.main_only", "INFO")
        .with_state(state)
        .info("from " + std::to_string(state.process_index()));
  });
  const auto lines = captured.lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], HasSubstr("logging_test.main_only: from 0"));
}

TEST(Logger, EveryProcessWritesInOrderWithItsRank) {
  ScopedEnv prefixed("ACCELERATE_LAUNCH_PREFIXES_OUTPUT", nullptr);
  CapturedLines captured;
  run_ranks(3, [](const PartialState& state) {
    // The last rank reaches the call first; in_order must still write rank 0 first.
    if (state.process_index() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    get_logger("logging_test.in_order", "INFO")
        .with_state(state)
        .info("shard " + std::to_string(state.process_index()), {.main_process_only = false, .in_order = true});
  });
  const auto lines = captured.lines();
  ASSERT_EQ(lines.size(), 3u);
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_THAT(lines[rank], HasSubstr("[rank " + std::to_string(rank) + "] shard " + std::to_string(rank)));
  }
}

TEST(Logger, OrderedMessagesBelowTheLevelStillKeepTheProcessesTogether) {
  CapturedLines captured;
  // Every rank must pass the barriers even though nothing is written; a rank skipping them would
  // leave the others waiting until the timeout.
  run_ranks(2, [](const PartialState& state) {
    auto logger = get_logger("logging_test.quiet_order", "ERROR").with_state(state);
    logger.info("dropped", {.main_process_only = false, .in_order = true});
    state.wait_for_everyone();
  });
  EXPECT_TRUE(captured.lines().empty());
}

TEST(Logger, NoRankIsAddedWhenTheLauncherPrefixesLines) {
  ScopedEnv prefixed("ACCELERATE_LAUNCH_PREFIXES_OUTPUT", "1");
  CapturedLines captured;
  run_ranks(2, [](const PartialState& state) {
    get_logger("logging_test.launcher", "INFO").with_state(state).info("hi", {.main_process_only = false});
  });
  const auto lines = captured.lines();
  ASSERT_EQ(lines.size(), 2u);
  for (const auto& line : lines) EXPECT_THAT(line, ::testing::Not(HasSubstr("[rank")));
}

TEST(Logger, WarningOnceWritesAMessageOnlyTheFirstTime) {
  CapturedLines captured;
  auto logger = get_logger("logging_test.once", "INFO")
                    .with_state(PartialState::standalone({.process_index = 0, .num_processes = 1}));
  logger.warning_once("deprecated");
  logger.warning_once("deprecated");
  logger.warning_once("another");
  const auto lines = captured.lines();
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_THAT(lines[0], HasSubstr("deprecated"));
  EXPECT_THAT(lines[1], HasSubstr("another"));
}

// ---- the library's own warnings ----------------------------------------------------------------

TEST(LibraryWarnings, GoThroughTheLoggerOfTheirModuleEvenWithoutAProcessState) {
  ScopedEnv level("ACCELERATE_LOG_LEVEL", nullptr);
  CapturedLines captured;
  // No process state is needed: the warning still takes the logger's format.
  detail::warn("logging_test.library", "a library warning");
  const auto lines = captured.lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_THAT(lines[0], ::testing::MatchesRegex("[0-9-]+ [0-9:]+ WARNING logging_test.library: a library warning"));
}

TEST(LibraryWarnings, FollowTheLoggersLevel) {
  ScopedEnv level("ACCELERATE_LOG_LEVEL", nullptr);
  CapturedLines captured;
  get_logger("logging_test.silenced", "ERROR");
  detail::warn("logging_test.silenced", "dropped");
  EXPECT_TRUE(captured.lines().empty());
}

TEST(LibraryWarnings, OnceOnlyWhenAsked) {
  ScopedEnv level("ACCELERATE_LOG_LEVEL", nullptr);
  CapturedLines captured;
  for (int i = 0; i < 3; ++i) detail::warn("logging_test.once_library", "once", {.once = true});
  for (int i = 0; i < 2; ++i) detail::warn("logging_test.once_library", "every time");
  EXPECT_EQ(captured.lines().size(), 3u);
}

TEST(LibraryWarnings, OnTheMainProcessOrOnEveryProcessWithItsRank) {
  ScopedEnv level("ACCELERATE_LOG_LEVEL", nullptr);
  ScopedEnv prefixed("ACCELERATE_LAUNCH_PREFIXES_OUTPUT", nullptr);
  CapturedLines captured;
  run_ranks(2, [](const PartialState& state) {
    detail::warn("logging_test.ranks", "main only", {.state = state});
    state.wait_for_everyone();
    detail::warn("logging_test.ranks", "mine", {.every_process = true, .state = state});
  });
  const auto lines = captured.lines();
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_THAT(lines[0], HasSubstr("logging_test.ranks: main only"));
  EXPECT_TRUE(std::any_of(lines.begin(), lines.end(), [](const std::string& l) { return l.find("[rank 1] mine") != std::string::npos; }));
}

}  // namespace
}  // namespace accelerate
