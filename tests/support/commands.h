// Running an `accelerate` command in process (commands/*.h entry points take their streams as
// arguments), and small file helpers the command tests share.
#pragma once

#include "support/test_support.h"

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace accelerate::testing {

/// What a command returned and printed.
struct CommandOutcome {
  int code = -1;
  std::string out;
  std::string err;
};

/// The signature every `accelerate::commands::*_main` shares.
using CommandMain = int (*)(const std::vector<std::string>& args, std::istream& in, std::ostream& out,
                            std::ostream& err);

/// Runs `command(args)` with `input` as its standard input.
inline CommandOutcome run_command(CommandMain command, const std::vector<std::string>& args,
                                  const std::string& input = "") {
  std::istringstream in(input);
  std::ostringstream out;
  std::ostringstream err;
  CommandOutcome outcome;
  outcome.code = command(args, in, out, err);
  outcome.out = out.str();
  outcome.err = err.str();
  return outcome;
}

/// Writes `text` to `name` inside `dir` and returns the path.
inline std::string write_file(const TempDir& dir, const std::string& name, const std::string& text) {
  const std::string path = (dir.path() / name).string();
  std::ofstream(path) << text;
  return path;
}

/// The whole content of a file (empty when it cannot be read).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace accelerate::testing
