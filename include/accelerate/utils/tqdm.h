// A progress bar for long loops that shows on one process only (upstream: accelerate/utils/tqdm.py,
// a wrapper of `tqdm` that disables the bar on every process but the local main one). On a terminal
// the bar redraws one line in place (steps, percentage, elapsed time, ETA, rate, a postfix such as
// the loss); written to a pipe or file — a launcher's output, a CI log — it stays quiet and writes
// a full line every `log_interval` seconds and once when it closes, so logs stay readable.
//
// Example:
//   accelerate::ProgressBar bar({.total = max_steps, .desc = "train"});
//   for (int64_t step = 0; step < max_steps; ++step) {
//     const double loss = train_step(step);
//     bar.update();
//     bar.set_postfix("loss=" + std::to_string(loss));
//   }
//   bar.close();
#pragma once

#include "accelerate/state.h"

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <optional>
#include <string>

namespace accelerate {

/// Settings of a `ProgressBar` (upstream: `tqdm`'s keyword arguments plus `main_process_only`).
struct ProgressBarOptions {
  /// Steps of the whole loop; without it the bar shows no percentage or ETA.
  std::optional<int64_t> total{};
  /// Text before the bar.
  std::string desc{};
  /// Name of one step in the rate ("it/s").
  std::string unit = "it";
  /// Steps already done when the bar starts (e.g. a resumed run); not counted in the rate.
  int64_t initial = 0;
  /// Show on the local main process only (the one with local index 0).
  bool main_process_only = true;
  /// Show nothing at all.
  bool disable = false;
  /// Redraw one line in place; default: whether `stream` is standard error on a terminal.
  std::optional<bool> interactive{};
  /// Least seconds between two redraws on a terminal.
  double min_interval = 0.1;
  /// Seconds between two lines when not interactive.
  double log_interval = 30.0;
  /// Where the bar is written; default standard error.
  std::ostream* stream = nullptr;
  /// The processes to decide `main_process_only` with; default the process-wide state (a single
  /// process when none exists).
  std::optional<PartialState> state{};
  /// Seconds from a fixed origin; default a steady clock (tests pass their own).
  std::function<double()> clock{};
};

/// A progress bar over a loop's steps (upstream: `accelerate.utils.tqdm`). Closing (explicitly or
/// on destruction) writes the final state once.
class ProgressBar {
 public:
  explicit ProgressBar(ProgressBarOptions options = {});
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  ProgressBar(ProgressBar&&) = delete;
  ProgressBar& operator=(ProgressBar&&) = delete;

  /// Counts `n` more steps and redraws when it is time to.
  void update(int64_t n = 1);
  /// Replaces the text before the bar.
  void set_description(std::string desc);
  /// Replaces the text after the rate, e.g. "loss=1.234".
  void set_postfix(std::string postfix);
  /// Writes the final line; later updates are ignored. Idempotent.
  void close();

  /// Steps counted so far (with `initial`).
  int64_t n() const { return n_; }
  /// Whether this process shows nothing.
  bool disabled() const { return disabled_; }
  /// The bar as it would be drawn now (without the bar graphic when not interactive).
  std::string format() const;

 private:
  void draw(bool final);
  double now() const;

  ProgressBarOptions options_;
  std::string postfix_;
  bool disabled_ = false;
  bool interactive_ = false;
  bool closed_ = false;
  int64_t n_ = 0;
  double start_ = 0;
  double last_draw_ = 0;
  size_t last_width_ = 0;
};

}  // namespace accelerate
