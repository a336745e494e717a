// The crash-safe commit of a checkpoint folder (see commit.h): a staging folder per save, the
// processes' agreement that every write succeeded, the rename into place, and the clean-up of the
// staging folders an earlier crash left behind.
#include "checkpoint/commit.h"

#include "detail/check.h"
#include "detail/collectives.h"
#include "detail/files.h"

#include <c10/util/Exception.h>

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>
#include <regex>
#include <sstream>

namespace fs = std::filesystem;

namespace accelerate::detail::checkpoint {

namespace {

constexpr const char* kOwnerFile = ".owner";

// Hidden names of a checkpoint folder's transient states.
fs::path staging_of(const fs::path& final_dir) { return final_dir.parent_path() / ("." + final_dir.filename().string() + ".partial"); }
fs::path replaced_of(const fs::path& final_dir) { return final_dir.parent_path() / ("." + final_dir.filename().string() + ".old"); }
fs::path deleting_of(const fs::path& final_dir) { return final_dir.parent_path() / ("." + final_dir.filename().string() + ".deleting"); }

void remove_leftovers(const fs::path& final_dir, bool all) {
  const auto parent = final_dir.parent_path();
  if (!all) {
    for (const auto& p : {staging_of(final_dir), replaced_of(final_dir), deleting_of(final_dir)}) detail::remove_tree(p);
    return;
  }
  static const std::regex leftover(R"(\..+\.(partial|old|deleting))");
  for (const auto& entry : fs::directory_iterator(parent)) {
    if (std::regex_match(entry.path().filename().string(), leftover)) detail::remove_tree(entry.path());
  }
}

std::string random_token() {
  std::random_device device;
  std::ostringstream out;
  out << std::hex << device() << device() << device() << device();
  return out.str();
}

void create_staging(const fs::path& final_dir, const fs::path& staging, bool clean_all, const std::string& token) {
  fs::create_directories(final_dir.parent_path());
  remove_leftovers(final_dir, clean_all);
  fs::create_directory(staging);
  write_file((staging / kOwnerFile).string(), token, /*durable=*/false);
}

bool sees_token(const fs::path& staging, const std::string& token) {
  std::error_code error;
  if (!fs::is_regular_file(staging / kOwnerFile, error)) return false;
  try {
    return read_file((staging / kOwnerFile).string()) == token;
  } catch (const std::exception&) {
    return false;
  }
}

// Puts `staging` at `final_dir`: a plain rename when nothing is there, else an atomic exchange
// (falling back to two renames where the file system has no exchange).
void publish(const fs::path& staging, const fs::path& final_dir) {
  if (!fs::exists(final_dir)) {
    fs::rename(staging, final_dir);
    return;
  }
  if (::syscall(SYS_renameat2, AT_FDCWD, staging.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    detail::remove_tree(staging);  // now the old checkpoint
    return;
  }
  if (errno != EINVAL && errno != ENOSYS) raise_error("cannot replace " + final_dir.string() + ": " + std::strerror(errno));
  const auto replaced = replaced_of(final_dir);
  detail::remove_tree(replaced);
  fs::rename(final_dir, replaced);
  fs::rename(staging, final_dir);
  detail::remove_tree(replaced);
}

}  // namespace

// Note [Agreed errors keep their kind]
// Every process raises the same error after a collective step, so a program catches it the same
// way everywhere: as c10::ValueError when every failure was one (bad input: a wrong dtype, a
// missing file), else as c10::Error. Each process sends its message behind one byte saying which.
void run_agreed(const PartialState& state, const std::string& what, const std::function<void()>& fn) {
  std::string error;
  char kind = 'v';
  try {
    fn();
  } catch (const std::exception& e) {
    error = error_text(e);
    if (error.empty()) error = "unknown error";
    if (dynamic_cast<const c10::ValueError*>(&e) == nullptr && dynamic_cast<const std::invalid_argument*>(&e) == nullptr) {
      kind = 'e';
    }
  }
  const auto raise = [](bool value_error, const std::string& message) {
    if (value_error) C10_THROW_ERROR(ValueError, message);
    C10_THROW_ERROR(Error, message);
  };
  if (state.num_processes() == 1) {
    if (!error.empty()) raise(kind == 'v', what + " failed: " + error);
    return;
  }
  const std::string tagged = error.empty() ? std::string() : kind + error;
  const auto gathered = all_gather_bytes(state, std::vector<char>(tagged.begin(), tagged.end()), what.c_str());
  std::string message;
  bool all_value_errors = true;
  for (size_t rank = 0; rank < gathered.size(); ++rank) {
    if (gathered[rank].empty()) continue;
    all_value_errors = all_value_errors && gathered[rank][0] == 'v';
    message += (message.empty() ? "" : "; ") + std::string("process ") + std::to_string(rank) + ": " +
               std::string(gathered[rank].begin() + 1, gathered[rank].end());
  }
  if (!message.empty()) raise(all_value_errors, what + " failed on " + message);
}

CheckpointCommit::CheckpointCommit(const PartialState& state, fs::path final_dir, bool save_on_each_node,
                                   bool clean_all_leftovers)
    : state_(state), final_(fs::absolute(final_dir).lexically_normal()), staging_(staging_of(final_)) {
  if (final_.filename().empty()) final_ = final_.parent_path();
  staging_ = staging_of(final_);
  writes_shared_ = save_on_each_node ? state.is_local_main_process() : state.is_main_process();
  std::string token = state.is_main_process() ? random_token() : std::string();
  if (state.num_processes() > 1) {
    const auto bytes = broadcast_bytes(state, std::vector<char>(token.begin(), token.end()), 0, "save_state");
    token.assign(bytes.begin(), bytes.end());
  }
  run_agreed(state, "preparing the checkpoint folder " + final_.string(), [&] {
    if (state.is_main_process()) {
      create_staging(final_, staging_, clean_all_leftovers, token);
      owner_ = true;
    }
  });
  // A machine that does not see process 0's staging folder has a file system of its own.
  run_agreed(state, "preparing the checkpoint folder " + final_.string(), [&] {
    if (state.is_main_process() || !state.is_local_main_process() || sees_token(staging_, token)) return;
    ACCELERATE_CHECK_VALUE(save_on_each_node, "the staging folder ", staging_.string(),
                           " created by process 0 is not visible here; without a shared file system set "
                           "ProjectConfiguration::save_on_each_node");
    create_staging(final_, staging_, clean_all_leftovers, token);
    owner_ = true;
  });
}

fs::path CheckpointCommit::commit(const std::function<void()>& write) {
  try {
    run_agreed(state_, "saving the checkpoint " + final_.string(), write);
  } catch (...) {
    if (owner_) {
      (void)detail::try_remove_tree(staging_);
    }
    throw;
  }
  run_agreed(state_, "publishing the checkpoint " + final_.string(), [&] {
    if (!owner_) return;
    fs::remove(staging_ / kOwnerFile);
    fsync_directory(staging_.string());
    publish(staging_, final_);
    fsync_directory(final_.parent_path().string());
  });
  return final_;
}

bool is_complete_checkpoint(const fs::path& folder) {
  // Every process writes its generators' states last; a folder that `publish` put in place holds
  // at least one, whichever machine's file system it is on.
  static const std::regex name(R"(random_states_\d{1,9}\.(safetensors|pkl))");
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(folder, error)) {
    if (entry.is_regular_file(error) && std::regex_match(entry.path().filename().string(), name)) return true;
  }
  return false;
}

std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const fs::path& folder,
                                                           std::vector<std::pair<int64_t, fs::path>>* incomplete) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code error;
  if (!fs::is_directory(folder, error)) return out;
  static const std::regex name(R"(checkpoint_(\d{1,18}))");
  for (const auto& entry : fs::directory_iterator(folder)) {
    std::smatch match;
    const auto file = entry.path().filename().string();
    if (!entry.is_directory() || !std::regex_match(file, match, name)) continue;
    if (is_complete_checkpoint(entry.path())) {
      out.emplace_back(std::stoll(match[1]), entry.path());
    } else if (incomplete != nullptr) {
      incomplete->emplace_back(std::stoll(match[1]), entry.path());
    }
  }
  std::sort(out.begin(), out.end());
  if (incomplete != nullptr) std::sort(incomplete->begin(), incomplete->end());
  return out;
}

void prune_checkpoints(const fs::path& folder, int total_limit, const std::set<int64_t>& written_here,
                       std::optional<int64_t> just_written) {
  if (total_limit <= 0) return;
  auto checkpoints = list_checkpoints(folder);
  if (checkpoints.size() <= static_cast<size_t>(total_limit)) return;
  const size_t excess = checkpoints.size() - static_cast<size_t>(total_limit);
  // Note [Pruning keeps the running job's checkpoints]
  // The oldest go first, by number; but a checkpoint this job wrote goes only after every other
  // (the folder may hold an earlier run's checkpoints, with any numbers), and the one the save
  // just made never goes.
  std::stable_partition(checkpoints.begin(), checkpoints.end(),
                        [&](const auto& c) { return written_here.count(c.first) == 0; });
  std::vector<fs::path> doomed;
  for (const auto& [number, path] : checkpoints) {
    if (doomed.size() == excess) break;
    if (number != just_written) doomed.push_back(path);
  }
  for (const auto& path : doomed) {
    const auto deleting = deleting_of(path);
    detail::remove_tree(deleting);
    fs::rename(path, deleting);
  }
  fsync_directory(folder.string());
  for (const auto& path : doomed) detail::remove_tree(deleting_of(path));
}

void checkpoint_file_written(const PartialState& state) {
  static std::atomic<bool> done{false};
  const char* path = std::getenv("ACCELERATE_TEST_PAUSE_SAVE_AFTER_FIRST_FILE");
  if (path == nullptr || *path == '\0') return;
  const char* only = std::getenv("ACCELERATE_TEST_PAUSE_SAVE_PROCESS");
  if (only != nullptr && *only != '\0' && std::to_string(state.process_index()) != only) return;
  if (done.exchange(true)) return;
  write_file(std::string(path) + "." + std::to_string(state.process_index()), std::to_string(::getpid()));
  while (true) ::pause();
}

}  // namespace accelerate::detail::checkpoint
