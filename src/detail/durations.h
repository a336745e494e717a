// Durations: the clock every deadline of the library and the launcher is measured on, and
// durations as the project's messages write them: "0.5s", "30s", "1800s".
#pragma once

#include <chrono>
#include <sstream>
#include <string>

namespace accelerate::detail {

/// The clock of every deadline and wait (never the wall clock, which may jump).
using Clock = std::chrono::steady_clock;

inline std::string seconds_text(double seconds) {
  std::ostringstream out;
  out << seconds << "s";
  return out.str();
}

inline std::string seconds_text(std::chrono::milliseconds ms) {
  return seconds_text(static_cast<double>(ms.count()) / 1000.0);
}

}  // namespace accelerate::detail
