// The numbers of `accelerate launch`'s command line, its configuration and its environment, read
// whole and within `int` (arguments.cpp): a number the launcher cannot hold is refused by name,
// never cut to one it can.
#pragma once

#include <climits>
#include <optional>
#include <string>

namespace accelerate::detail::launch {

/// `text` as an int when all of it is a decimal integer from `min` to `max`, else nullopt.
std::optional<int> parse_int(const std::string& text, int min = INT_MIN, int max = INT_MAX);

/// `text`, the value of `name` (a flag such as "--num_processes", or an environment variable),
/// as an int; throws `c10::ValueError` naming both when it is not an integer within int's range.
int int_value(const std::string& name, const std::string& text);

}  // namespace accelerate::detail::launch
