// The crash-safe protocol of `Accelerator::save_state`: every process writes into a staging
// folder next to the checkpoint, the processes agree that every write succeeded, and only then is
// the staging folder renamed to the checkpoint's name (atomically replacing an older folder of the
// same name). A crash at any instant leaves either the old checkpoint or the new one, never a mix;
// the staging folders a crash leaves behind are hidden (their names start with ".") and removed by
// the next save.
#pragma once

#include "accelerate/state.h"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace accelerate::detail::checkpoint {

/// Runs `fn` on every process of `state` and agrees on the outcome: when it throws on any process,
/// it throws on every process an error that starts with `what` and lists each failed process with
/// its message (c10::ValueError when every failure was a value error, else c10::Error). A
/// collective.
void run_agreed(const PartialState& state, const std::string& what, const std::function<void()>& fn);

/// One checkpoint being written. A collective: every process constructs it and calls `commit`.
class CheckpointCommit {
 public:
  /// Prepares the staging folder of `final_dir`: process 0 (and, with `save_on_each_node`, each
  /// machine's local main process that does not share process 0's file system) removes leftovers
  /// of crashed saves — every hidden staging folder inside `final_dir`'s parent when
  /// `clean_all_leftovers`, else those of `final_dir` only — and creates the staging folder.
  CheckpointCommit(const PartialState& state, std::filesystem::path final_dir, bool save_on_each_node,
                   bool clean_all_leftovers);

  /// The folder to write into.
  const std::filesystem::path& staging() const { return staging_; }
  /// Whether this process writes the files every checkpoint has once (weights, optimizer, …): the
  /// main process, or each machine's local main process with `save_on_each_node`.
  bool writes_shared_files() const { return writes_shared_; }

  /// Runs `write` on every process, agrees that every write succeeded, then flushes the staging
  /// folder and renames it into place. When a write fails anywhere, the staging folder is removed
  /// and every process throws. Returns the checkpoint folder.
  std::filesystem::path commit(const std::function<void()>& write);

 private:
  const PartialState& state_;
  std::filesystem::path final_;
  std::filesystem::path staging_;
  bool writes_shared_ = false;
  bool owner_ = false;  // creates and publishes the staging folder on this machine's file system
};

/// Whether `folder` is a complete checkpoint: one that a save published (it holds the random
/// states that every process writes), not an empty or hand-made folder of that name.
bool is_complete_checkpoint(const std::filesystem::path& folder);

/// The complete checkpoints `checkpoint_<n>` in `folder`, sorted by `n`; the folders of that name
/// that are not complete go to `incomplete` when given.
std::vector<std::pair<int64_t, std::filesystem::path>> list_checkpoints(
    const std::filesystem::path& folder, std::vector<std::pair<int64_t, std::filesystem::path>>* incomplete = nullptr);

/// Removes complete checkpoints of `folder` until at most `total_limit` remain: the oldest of
/// other runs first, then the oldest of `written_here`, never `just_written`. Each is first
/// renamed to a hidden name, so a crash never leaves a half-removed checkpoint visible.
void prune_checkpoints(const std::filesystem::path& folder, int total_limit,
                       const std::set<int64_t>& written_here = {}, std::optional<int64_t> just_written = {});

/// The test hook of the crash tests: when the environment variable
/// ACCELERATE_TEST_PAUSE_SAVE_AFTER_FIRST_FILE holds a path, the first call of a process creates
/// "<path>.<process index>" and then stops the process forever (for a test to kill it). With
/// ACCELERATE_TEST_PAUSE_SAVE_PROCESS set to a process index, only that process stops.
void checkpoint_file_written(const PartialState& state);

}  // namespace accelerate::detail::checkpoint
