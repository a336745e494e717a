// What `accelerate launch` writes and reads of its workers' output: the launcher's own lines,
// each worker's stdout and stderr relayed line by line with its rank as prefix and copied to its
// log file, the tail of its stderr kept, and what that tail and the worker's error file say about
// a failure (Note [A machine that ssh cannot reach] in worker_output.cpp). Which streams are
// read, and when, is the attempt's (attempt.cpp).
#pragma once

#include <deque>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace accelerate::detail::launch {

/// Writes all of `data` to `fd`, waiting while it is full; gives up quietly when it is gone.
void write_all(int fd, const std::string& data);

/// Writes one line of the launcher's own to stderr: "accelerate launch: <line>".
void say(const std::string& line);

/// Opens (creating its folder) the log file at `path`, emptied.
int open_log(const std::filesystem::path& path);

/// One output stream of one worker: line assembly, prefixing, log file, tail for diagnostics.
struct Stream {
  int fd = -1;
  int console_fd = STDOUT_FILENO;
  bool to_console = true;
  int log_fd = -1;
  std::string prefix;
  std::string partial;
  std::deque<std::string> tail;  ///< kept for stderr only
  bool keep_tail = false;

  /// Writes one whole line to the console and the log, and keeps it in the tail.
  void emit(const std::string& line);
  /// Reads what is available; returns false at end of stream.
  bool pump();
  /// Emits the unfinished last line, if any.
  void flush();
  void close();
};

/// The root cause that ssh's own lines in mpirun's stderr `tail` name, else "" (Note [A machine
/// that ssh cannot reach]).
std::string ssh_failure(const std::deque<std::string>& tail);

/// A worker's own account of its failure: its `error_file` (may be empty), else the most telling
/// line of its stderr `tail`.
std::string last_error(const std::string& error_file, const std::deque<std::string>& tail);

}  // namespace accelerate::detail::launch
