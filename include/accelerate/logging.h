// Logging that knows about processes (upstream: accelerate/logging.py). `get_logger(name)` gives a
// named logger whose messages are written once, by the main process, unless a call asks for every
// process (`main_process_only = false`), optionally one process after the other (`in_order`). The
// level comes from `get_logger`'s argument, else `ACCELERATE_LOG_LEVEL`, else WARNING (Python's
// default). Lines go to standard error as `<time> <LEVEL> <name>: <message>`; a message logged by
// every process of a multi-process job carries `[rank N]` unless `accelerate launch` already
// prefixes each worker's lines. `set_log_sink` redirects every logger (e.g. into a test).
//
// Example:
//   auto logger = accelerate::get_logger("train", "INFO");
//   logger.info("training starts");  // once, on process 0
//   logger.info("my shard has 120 samples", {.main_process_only = false, .in_order = true});
#pragma once

#include "accelerate/state.h"

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace accelerate {

/// Severity of a message, with Python's numeric levels.
enum class LogLevel { kDebug = 10, kInfo = 20, kWarning = 30, kError = 40, kCritical = 50 };

/// "DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL".
std::string to_string(LogLevel level);
/// Parses a level name in any case ("info", "WARNING"; "WARN" and "FATAL" as Python accepts them)
/// or a number of a level; throws `c10::ValueError` naming the text otherwise.
LogLevel parse_log_level(std::string_view text);

/// Where a message goes and how it is synchronised (upstream: the keyword arguments of
/// `MultiProcessAdapter.log`).
struct LogOptions {
  /// Write on the main process only.
  bool main_process_only = true;
  /// With `main_process_only = false`: every process writes in turn, by process index, with a
  /// barrier after each turn (a collective: every process must make the call).
  bool in_order = false;
};

/// Receives every formatted line (without its newline) that a logger writes.
using LogSink = std::function<void(LogLevel level, const std::string& line)>;

/// Sends every logger's lines to `sink` instead of standard error; an empty sink restores standard
/// error. Returns the previous sink.
LogSink set_log_sink(LogSink sink);

namespace detail {
struct LoggerData;
}  // namespace detail

/// A named logger aware of the job's processes (upstream: `MultiProcessAdapter`). A cheap handle:
/// copies share the name and level.
class Logger {
 public:
  /// The logger's name.
  const std::string& name() const;
  /// Messages below this level are dropped.
  LogLevel level() const;
  /// Changes the level for every handle of this logger.
  void set_level(LogLevel level);
  /// Whether a message at `level` would be written.
  bool is_enabled_for(LogLevel level) const;

  /// Writes `message` at `level` as `options` say. Throws when no process-wide state exists yet and
  /// the logger is not bound to a state (upstream raises the same), since it cannot tell which
  /// process it runs on.
  void log(LogLevel level, const std::string& message, LogOptions options = {}) const;
  /// `log` at DEBUG, INFO, WARNING, ERROR and CRITICAL.
  void debug(const std::string& message, LogOptions options = {}) const { log(LogLevel::kDebug, message, options); }
  void info(const std::string& message, LogOptions options = {}) const { log(LogLevel::kInfo, message, options); }
  void warning(const std::string& message, LogOptions options = {}) const { log(LogLevel::kWarning, message, options); }
  void error(const std::string& message, LogOptions options = {}) const { log(LogLevel::kError, message, options); }
  void critical(const std::string& message, LogOptions options = {}) const {
    log(LogLevel::kCritical, message, options);
  }
  /// A warning written only the first time this logger sees `message` (upstream: `warning_once`).
  void warning_once(const std::string& message, LogOptions options = {}) const;

  /// The same logger, deciding ranks with `state` instead of the process-wide state (for ranks run
  /// as threads, or a standalone `Accelerator`).
  Logger with_state(PartialState state) const;

 private:
  friend Logger get_logger(const std::string& name, std::optional<std::string> log_level);
  explicit Logger(std::shared_ptr<detail::LoggerData> data) : data_(std::move(data)) {}
  std::shared_ptr<detail::LoggerData> data_;
  std::optional<PartialState> state_;
};

/// The logger called `name` (the same one for every call with that name). With `log_level` (or,
/// without it, `ACCELERATE_LOG_LEVEL` set), sets its level; an unknown level name throws
/// `c10::ValueError` naming it.
Logger get_logger(const std::string& name, std::optional<std::string> log_level = std::nullopt);

}  // namespace accelerate
