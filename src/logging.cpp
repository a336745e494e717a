// Process-aware loggers; see include/accelerate/logging.h.
#include "accelerate/logging.h"

#include "accelerate/utils/environment.h"
#include "detail/text.h"
#include "detail/warn.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <ctime>
#include <iostream>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

namespace accelerate {

namespace detail {
struct LoggerData {
  explicit LoggerData(std::string n) : name(std::move(n)) {}
  const std::string name;
  std::atomic<int> level{static_cast<int>(LogLevel::kWarning)};
  std::mutex once_mutex;
  std::set<std::string> warned_once;
};
}  // namespace detail

namespace {

std::mutex& sink_mutex() {
  static std::mutex m;
  return m;
}

LogSink& current_sink() {
  static LogSink sink;
  return sink;
}

void emit(LogLevel level, const std::string& line) {
  std::lock_guard<std::mutex> lock(sink_mutex());
  if (current_sink()) {
    current_sink()(level, line);
    return;
  }
  std::cerr << line << std::endl;
}

std::string timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%d %H:%M:%S", &local);
  return text;
}

// `accelerate launch` puts "[rankN]: " before every line of its workers itself.
bool launcher_prefixes_lines() { return parse_flag_from_env("ACCELERATE_LAUNCH_PREFIXES_OUTPUT"); }

// `<time> <LEVEL> <name>: [rank N] <message>`, the rank only for a message of every process.
std::string format_line(LogLevel level, const std::string& name, const std::string& message, std::optional<int> rank) {
  std::string line = timestamp() + " " + to_string(level) + " " + name + ": ";
  if (rank && !launcher_prefixes_lines()) line += "[rank " + std::to_string(*rank) + "] ";
  return line + message;
}

}  // namespace

std::string to_string(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "DEBUG";
    case LogLevel::kInfo: return "INFO";
    case LogLevel::kWarning: return "WARNING";
    case LogLevel::kError: return "ERROR";
    case LogLevel::kCritical: return "CRITICAL";
  }
  return "LEVEL " + std::to_string(static_cast<int>(level));
}

LogLevel parse_log_level(std::string_view text) {
  const std::string upper = detail::ascii_upper(text);
  static const std::map<std::string, LogLevel> names = {
      {"DEBUG", LogLevel::kDebug},   {"INFO", LogLevel::kInfo},   {"WARNING", LogLevel::kWarning},
      {"WARN", LogLevel::kWarning},  {"ERROR", LogLevel::kError}, {"CRITICAL", LogLevel::kCritical},
      {"FATAL", LogLevel::kCritical}};
  if (auto it = names.find(upper); it != names.end()) return it->second;
  int number = 0;
  const auto [end, ec] = std::from_chars(upper.data(), upper.data() + upper.size(), number);
  if (ec == std::errc() && end == upper.data() + upper.size()) {
    for (LogLevel level :
         {LogLevel::kDebug, LogLevel::kInfo, LogLevel::kWarning, LogLevel::kError, LogLevel::kCritical}) {
      if (static_cast<int>(level) == number) return level;
    }
  }
  C10_THROW_ERROR(ValueError, c10::str("[get_logger] unknown log level '", text,
                                       "'; expected DEBUG, INFO, WARNING, ERROR or CRITICAL"));
}

LogSink set_log_sink(LogSink sink) {
  std::lock_guard<std::mutex> lock(sink_mutex());
  LogSink previous = std::move(current_sink());
  current_sink() = std::move(sink);
  return previous;
}

const std::string& Logger::name() const { return data_->name; }
LogLevel Logger::level() const { return static_cast<LogLevel>(data_->level.load()); }
void Logger::set_level(LogLevel level) { data_->level.store(static_cast<int>(level)); }
bool Logger::is_enabled_for(LogLevel level) const { return static_cast<int>(level) >= data_->level.load(); }

Logger Logger::with_state(PartialState state) const {
  Logger bound(data_);
  bound.state_ = std::move(state);
  return bound;
}

void Logger::log(LogLevel level, const std::string& message, LogOptions options) const {
  TORCH_CHECK(state_.has_value() || PartialState::initialized(), "[", data_->name,
              "] you must initialise the process state (construct a "
              "PartialState or an Accelerator) before "
              "logging, so the logger knows which process it runs on");
  const PartialState state = state_.has_value() ? *state_ : PartialState();
  // Every process must reach the barriers of an ordered message, even when the level drops it.
  const bool enabled = is_enabled_for(level);
  auto write = [&] {
    if (!enabled) return;
    const bool ranked = !options.main_process_only && state.num_processes() > 1;
    emit(level, format_line(level, data_->name, message, ranked ? std::optional<int>(state.process_index()) : std::nullopt));
  };
  if (options.main_process_only) {
    if (state.is_main_process()) write();
    return;
  }
  if (!options.in_order) {
    write();
    return;
  }
  for (int turn = 0; turn < state.num_processes(); ++turn) {
    if (turn == state.process_index()) write();
    state.wait_for_everyone();
  }
}

void Logger::warning_once(const std::string& message, LogOptions options) const {
  {
    std::lock_guard<std::mutex> lock(data_->once_mutex);
    if (!data_->warned_once.insert(message).second) return;
  }
  log(LogLevel::kWarning, message, options);
}

Logger get_logger(const std::string& name, std::optional<std::string> log_level) {
  static std::mutex registry_mutex;
  static std::map<std::string, std::shared_ptr<detail::LoggerData>> registry;
  if (!log_level) log_level = get_env("ACCELERATE_LOG_LEVEL");
  // Parse before touching the registry, so a bad level leaves every logger as it was.
  std::optional<LogLevel> level;
  if (log_level && !log_level->empty()) level = parse_log_level(*log_level);
  std::shared_ptr<detail::LoggerData> data;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto& slot = registry[name];
    if (!slot) slot = std::make_shared<detail::LoggerData>(name);
    data = slot;
  }
  if (level) data->level.store(static_cast<int>(*level));
  return Logger(std::move(data));
}

namespace detail {

void log(LogLevel level, const std::string& name, const std::string& message, const WarnOptions& options) {
  Logger logger = get_logger(name);
  if (!logger.is_enabled_for(level)) return;
  // Per writing rank (with ranks as threads, one process holds several).
  const auto first_time = [&](int rank) {
    static std::mutex mutex;
    static std::set<std::tuple<std::string, std::string, int>> written;
    std::lock_guard<std::mutex> lock(mutex);
    return written.emplace(name, message, rank).second;
  };
  if (options.state.has_value() || (options.use_process_state && PartialState::initialized())) {
    const PartialState state = options.state.has_value() ? *options.state : PartialState();
    // Only a process that writes the message counts it as written: with ranks as threads of one
    // process, another rank seeing it first must not silence the main process.
    if (!options.every_process && !state.is_main_process()) return;
    if (options.once && !first_time(options.every_process ? state.process_index() : -1)) return;
    logger.with_state(state).log(level, message, {.main_process_only = !options.every_process});
    return;
  }
  if (options.once && !first_time(-1)) return;
  emit(level, format_line(level, name, message, std::nullopt));
}

}  // namespace detail

}  // namespace accelerate
