// Warnings of the library itself, written through its loggers (logging.h) like every other
// message it prints: the logger's level applies, and the format, the rank prefix and the sink are
// those of `get_logger`. (LibTorch's TORCH_WARN would print through glog, in another format.)
#pragma once

#include "accelerate/logging.h"
#include "accelerate/state.h"

#include <optional>
#include <string>

namespace accelerate::detail {

struct WarnOptions {
  /// Write only the first time the logger sees this message in this process (upstream: a
  /// `warnings.warn`, which Python shows once per place and message, or `warning_once`).
  bool once = false;
  /// Write on every process, with its rank, instead of on the main process only.
  bool every_process = false;
  /// The processes the warning belongs to; without it the process-wide state, and without that
  /// the warning is written as by a lone process.
  std::optional<PartialState> state = std::nullopt;
  /// Without `state`: false writes as a lone process without asking for the process-wide state
  /// (for warnings raised while that state is being built).
  bool use_process_state = true;
};

/// Writes `message` at `level` through the logger called `logger` (e.g. "accelerate.big_modeling").
void log(LogLevel level, const std::string& logger, const std::string& message, const WarnOptions& options = {});
/// `log` at WARNING.
inline void warn(const std::string& logger, const std::string& message, const WarnOptions& options = {}) {
  log(LogLevel::kWarning, logger, message, options);
}

}  // namespace accelerate::detail
