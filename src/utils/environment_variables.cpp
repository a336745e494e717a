// The environment-variable utilities of include/accelerate/utils/environment.h. They do not
// need LibTorch, so the `accelerate` executable shares them (Note [The launcher without LibTorch]).
#include "accelerate/utils/environment.h"

#include "accelerate/utils/dataclasses.h"
#include "build_config.h"
#include "detail/check.h"
#include "detail/text.h"
#include "detail/topology.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <utility>
#include <vector>

namespace accelerate {
namespace {

void set_or_unset(const std::string& key, const std::optional<std::string>& value) {
  if (value) {
    ::setenv(key.c_str(), value->c_str(), /*overwrite=*/1);
  } else {
    ::unsetenv(key.c_str());
  }
}

std::vector<long> parse_version(std::string_view text) {
  std::vector<long> parts;
  long current = -1;
  for (char c : text) {
    if (std::isdigit(static_cast<unsigned char>(c))) {
      current = (current < 0 ? 0 : current * 10) + (c - '0');
    } else if (c == '.') {
      parts.push_back(current < 0 ? 0 : current);
      current = -1;
    } else {
      break;  // local suffixes such as "+cpu" or "a0" do not take part in the comparison
    }
  }
  if (current >= 0) parts.push_back(current);
  ACCELERATE_CHECK_VALUE(!parts.empty(), "[compare_versions] expected a dotted version such as 1.13.1, got '", text,
                         "'");
  return parts;
}

}  // namespace

std::optional<std::string> get_env(const std::string& key) {
  const char* value = std::getenv(key.c_str());
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

bool parse_flag_from_env(const std::string& key, bool default_value) {
  auto value = get_env(key);
  if (!value || value->empty()) return default_value;
  try {
    return str_to_bool(*value);
  } catch (const std::exception&) {
    detail::raise_value_error(detail::concat("[parse_flag_from_env] environment variable ", key,
                                             " must be a boolean (1/0, true/false, yes/no), got '", *value, "'"));
  }
}

int get_int_from_env(const std::vector<std::string>& keys, int default_value) {
  for (const auto& key : keys) {
    auto value = get_env(key);
    if (!value || value->empty()) continue;
    size_t used = 0;
    int parsed = 0;
    try {
      parsed = std::stoi(*value, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    ACCELERATE_CHECK_VALUE(used == value->size() && used > 0, "[get_int_from_env] environment variable ", key,
                           " must be an integer, got '", *value, "'");
    if (parsed >= 0) return parsed;  // as upstream, a negative value counts as unset
  }
  return default_value;
}

EnvironmentPatch::EnvironmentPatch(const std::map<std::string, std::string>& values) {
  saved_.reserve(values.size());
  for (const auto& [raw_key, value] : values) {
    std::string key = detail::ascii_upper(raw_key);
    saved_.emplace_back(key, get_env(key));
    ::setenv(key.c_str(), value.c_str(), /*overwrite=*/1);
  }
}

EnvironmentPatch::~EnvironmentPatch() noexcept {
  for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) set_or_unset(it->first, it->second);
}

EnvironmentClear::EnvironmentClear() : saved_(detail::environment_entries()) {
  for (const auto& [key, value] : saved_) ::unsetenv(key.c_str());
}

EnvironmentClear::~EnvironmentClear() noexcept {
  for (const auto& [key, value] : detail::environment_entries()) ::unsetenv(key.c_str());
  for (const auto& [key, value] : saved_) ::setenv(key.c_str(), value.c_str(), /*overwrite=*/1);
}

std::map<std::string, std::string> accelerate_environment() {
  std::map<std::string, std::string> out;
  for (auto& [key, value] : detail::environment_entries()) {
    if (key.rfind("ACCELERATE_", 0) == 0) out.emplace(std::move(key), std::move(value));
  }
  return out;
}

void restore_accelerate_environment(const std::map<std::string, std::string>& snapshot) {
  for (const auto& [key, value] : accelerate_environment()) {
    if (snapshot.count(key) == 0) ::unsetenv(key.c_str());
  }
  for (const auto& [key, value] : snapshot) ::setenv(key.c_str(), value.c_str(), /*overwrite=*/1);
}

bool compare_versions(std::string_view lhs, std::string_view op, std::string_view rhs) {
  auto a = parse_version(lhs);
  auto b = parse_version(rhs);
  const size_t n = std::max(a.size(), b.size());
  a.resize(n, 0);
  b.resize(n, 0);
  const int cmp = a < b ? -1 : (a == b ? 0 : 1);
  if (op == "<") return cmp < 0;
  if (op == "<=") return cmp <= 0;
  if (op == "==") return cmp == 0;
  if (op == "!=") return cmp != 0;
  if (op == ">=") return cmp >= 0;
  if (op == ">") return cmp > 0;
  detail::raise_value_error(
      detail::concat("[compare_versions] expected an operation among <, <=, ==, !=, >=, >, got '", op, "'"));
}

bool is_mpi_available() { return ACCELERATE_HAVE_MPI != 0; }

}  // namespace accelerate
