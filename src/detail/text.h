// Small text helpers of the library and of the torch-free launcher: ASCII case folding (for
// upstream's spellings, which are read in any case) and joining a list for a message.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace accelerate::detail {

/// `text` with its ASCII letters in lower case.
inline std::string ascii_lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c); });
  return out;
}

/// `text` with its ASCII letters in upper case.
inline std::string ascii_upper(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c); });
  return out;
}

/// The items one after the other, `separator` between two.
template <typename Items>
std::string join(const Items& items, std::string_view separator = ", ") {
  std::string out;
  bool first = true;
  for (const auto& item : items) {
    if (!first) out += separator;
    out += item;
    first = false;
  }
  return out;
}

}  // namespace accelerate::detail
