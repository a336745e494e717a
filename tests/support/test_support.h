// Helpers shared by the tests: temporary folders, running N ranks as threads over one in-memory
// store, and asserting an exception's message by substring.
#pragma once

#include "accelerate/logging.h"
#include "accelerate/state.h"
#include "detail/check.h"
#include "detail/files.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <algorithm>
#include <exception>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace accelerate::testing {

/// A fresh folder removed with everything in it when the object goes away.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "accelerate-test-XXXXXX").string();
    path_ = ::mkdtemp(tmpl.data());
  }
  ~TempDir() { (void)detail::try_remove_tree(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

/// Runs `fn(rank)` on `count` threads and rethrows the first exception of any of them.
inline void run_threads(int count, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(count);
  for (int rank = 0; rank < count; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        fn(rank);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

/// Options for rank `rank` of `world_size` ranks joined through `store`, with short timeouts.
inline PartialStateOptions rank_options(PartialStateOptions options, int rank, int world_size, const Store& store) {
  options.process_index = rank;
  options.num_processes = world_size;
  options.store = store;
  if (!options.rdzv_timeout) options.rdzv_timeout = std::chrono::seconds(30);
  if (!options.init_kwargs.timeout) options.init_kwargs.timeout = std::chrono::seconds(30);
  return options;
}

/// Runs `fn(state)` on `world_size` ranks, each a thread with its own standalone `PartialState`
/// connected through one in-memory store. Rethrows the first exception of any rank.
inline void run_ranks(int world_size, const std::function<void(const PartialState&)>& fn,
                      PartialStateOptions base = {}) {
  Store store = Store::in_memory();
  run_threads(world_size, [&](int rank) { fn(PartialState::standalone(rank_options(base, rank, world_size, store))); });
}

/// The message of the exception thrown by `fn`, or a failure when nothing is thrown.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return detail::error_text(e);
  }
  ADD_FAILURE() << "expected an exception, none was thrown";
  return {};
}

// Collects the lines of every logger (the library's warnings included) while it lives.
class CapturedLines {
 public:
  CapturedLines() {
    previous_ = set_log_sink([this](LogLevel, const std::string& line) {
      std::lock_guard<std::mutex> lock(mutex_);
      lines_.push_back(line);
    });
  }
  ~CapturedLines() { set_log_sink(previous_); }
  CapturedLines(const CapturedLines&) = delete;
  CapturedLines& operator=(const CapturedLines&) = delete;
  std::vector<std::string> lines() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return lines_;
  }
  /// Whether some line contains `text`.
  bool saw(const std::string& text) const {
    const auto all = lines();
    return std::any_of(all.begin(), all.end(), [&](const std::string& l) { return l.find(text) != std::string::npos; });
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::string> lines_;
  LogSink previous_;
};

}  // namespace accelerate::testing

/// Asserts that `stmt` throws an exception whose message contains `substring`.
#define EXPECT_THROWS_WITH(stmt, substring) \
  EXPECT_THAT(::accelerate::testing::error_of([&] { stmt; }), ::testing::HasSubstr(substring))
