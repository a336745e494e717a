// Progress bars on one process; see include/accelerate/utils/tqdm.h.
#include "accelerate/utils/tqdm.h"

#include <c10/util/Exception.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>

namespace accelerate {
namespace {

// "mm:ss", or "h:mm:ss" from an hour on (tqdm's format).
std::string format_interval(double seconds) {
  const auto total = static_cast<int64_t>(std::max(0.0, seconds));
  const int64_t h = total / 3600, m = (total / 60) % 60, s = total % 60;
  char text[32];
  if (h > 0) {
    std::snprintf(text, sizeof text, "%lld:%02lld:%02lld", static_cast<long long>(h), static_cast<long long>(m),
                  static_cast<long long>(s));
  } else {
    std::snprintf(text, sizeof text, "%02lld:%02lld", static_cast<long long>(m), static_cast<long long>(s));
  }
  return text;
}

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

ProgressBar::ProgressBar(ProgressBarOptions options) : options_(std::move(options)) {
  TORCH_CHECK_VALUE(!options_.total || *options_.total >= 0, "[ProgressBar] total must be >= 0, got ", *options_.total);
  TORCH_CHECK_VALUE(options_.initial >= 0, "[ProgressBar] initial must be >= 0, got ", options_.initial);
  TORCH_CHECK_VALUE(options_.min_interval >= 0 && options_.log_interval >= 0,
                    "[ProgressBar] min_interval and log_interval must be >= 0 seconds");
  disabled_ = options_.disable;
  if (!disabled_ && options_.main_process_only) {
    if (options_.state) {
      disabled_ = options_.state->local_process_index() != 0;
    } else if (PartialState::initialized()) {
      disabled_ = PartialState().local_process_index() != 0;
    }
  }
  if (options_.stream == nullptr) options_.stream = &std::cerr;
  interactive_ = options_.interactive.value_or(options_.stream == &std::cerr && ::isatty(STDERR_FILENO) == 1);
  n_ = options_.initial;
  start_ = now();
  last_draw_ = start_;
  if (!disabled_ && interactive_) draw(/*final=*/false);
}

ProgressBar::~ProgressBar() {
  try {
    close();
  } catch (...) {  // a failing stream must not throw from a destructor
  }
}

double ProgressBar::now() const { return options_.clock ? options_.clock() : steady_seconds(); }

void ProgressBar::update(int64_t n) {
  if (closed_) return;
  n_ += n;
  if (disabled_) return;
  const double t = now();
  if (t - last_draw_ >= (interactive_ ? options_.min_interval : options_.log_interval)) draw(/*final=*/false);
}

void ProgressBar::set_description(std::string desc) { options_.desc = std::move(desc); }

void ProgressBar::set_postfix(std::string postfix) { postfix_ = std::move(postfix); }

void ProgressBar::close() {
  if (closed_) return;
  closed_ = true;
  if (!disabled_) draw(/*final=*/true);
}

std::string ProgressBar::format() const {
  const double elapsed = now() - start_;
  const int64_t done_here = n_ - options_.initial;
  const double rate = elapsed > 0 ? static_cast<double>(done_here) / elapsed : 0.0;
  std::string line = options_.desc.empty() ? "" : options_.desc + ": ";
  if (options_.total) {
    const int64_t total = *options_.total;
    const double fraction = total > 0 ? std::min(1.0, static_cast<double>(n_) / static_cast<double>(total)) : 1.0;
    char percent[8];
    std::snprintf(percent, sizeof percent, "%3d%%", static_cast<int>(fraction * 100));
    line += percent;
    if (interactive_) {
      constexpr int kWidth = 20;
      const int filled = static_cast<int>(fraction * kWidth);
      line += "|" + std::string(filled, '#') + std::string(kWidth - filled, ' ') + "|";
    }
    line += " " + std::to_string(n_) + "/" + std::to_string(total);
    const double remaining = rate > 0 ? static_cast<double>(std::max<int64_t>(0, total - n_)) / rate : 0.0;
    line += " [" + format_interval(elapsed) + "<" + (rate > 0 ? format_interval(remaining) : "?") + ", ";
  } else {
    line += std::to_string(n_) + " [" + format_interval(elapsed) + ", ";
  }
  char speed[48];
  if (rate >= 1.0 || rate == 0.0) {
    std::snprintf(speed, sizeof speed, "%.2f%s/s", rate, options_.unit.c_str());
  } else {
    std::snprintf(speed, sizeof speed, "%.2fs/%s", 1.0 / rate, options_.unit.c_str());
  }
  line += speed;
  if (!postfix_.empty()) line += ", " + postfix_;
  return line + "]";
}

void ProgressBar::draw(bool final) {
  last_draw_ = now();
  std::string line = format();
  std::ostream& out = *options_.stream;
  if (interactive_) {
    // Pad over the remains of a longer previous line, then stay on it until the bar closes.
    const size_t width = line.size();
    if (width < last_width_) line += std::string(last_width_ - width, ' ');
    last_width_ = width;
    out << '\r' << line;
    if (final) out << '\n';
  } else {
    out << line << '\n';
  }
  out.flush();
}

}  // namespace accelerate
