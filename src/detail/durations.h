// Durations as the project's messages write them: "0.5s", "30s", "1800s".
#pragma once

#include <chrono>
#include <sstream>
#include <string>

namespace accelerate::detail {

inline std::string seconds_text(double seconds) {
  std::ostringstream out;
  out << seconds << "s";
  return out.str();
}

inline std::string seconds_text(std::chrono::milliseconds ms) {
  return seconds_text(static_cast<double>(ms.count()) / 1000.0);
}

}  // namespace accelerate::detail
