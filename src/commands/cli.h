// What the `accelerate` sub-commands share on their command line: flag spellings, parsing with
// `--help` and usage errors (exit code 2), and turning an exception into a one-line error
// (exit code 1). Header-only over CLI11, which stays out of the public headers.
#pragma once

#include "detail/check.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <exception>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace accelerate::detail {

/// "--name" together with its hyphenated spelling "--na-me", as upstream's parsers accept both.
inline std::string cli_spellings(const std::string& name) {
  std::string hyphenated = name;
  std::replace(hyphenated.begin(), hyphenated.end(), '_', '-');
  return hyphenated == name ? "--" + name : "--" + name + ",--" + hyphenated;
}

/// Parses `args` into `app`. Returns an exit code when the command must stop there: 0 after
/// printing the help of the (sub)command to `out`, 2 after printing a usage error to `err`;
/// `std::nullopt` when the command should run.
inline std::optional<int> parse_cli(CLI::App& app, const std::vector<std::string>& args, const std::string& command,
                                    std::ostream& out, std::ostream& err) {
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes them last-first
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    out << app.help();
    return 0;
  } catch (const CLI::ParseError& e) {
    err << "accelerate " << command << ": error: " << e.what() << " (see `accelerate " << command << " --help`)\n";
    return 2;
  }
  return std::nullopt;
}

/// Runs `body` and returns its exit code; an exception is printed to `err` as
/// "accelerate <command>: error: <message>" and gives exit code 1.
inline int run_cli_command(const std::string& command, std::ostream& err, const std::function<int()>& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    err << "accelerate " << command << ": error: " << error_text(e) << "\n";
    return 1;
  }
}

}  // namespace accelerate::detail
