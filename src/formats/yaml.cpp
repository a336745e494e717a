// The YAML writer; see yaml.h.
#include "formats/yaml.h"

#include <algorithm>
#include <cctype>
#include <sstream>
#include <string>
#include <vector>

namespace accelerate::detail::yaml {
namespace {

bool plain_yaml(const std::string& s) {
  if (s.empty()) return false;
  static const std::vector<std::string> reserved = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"};
  std::string lower = s;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (std::find(reserved.begin(), reserved.end(), lower) != reserved.end()) return false;
  if (!(std::isalpha(static_cast<unsigned char>(s[0])) || s[0] == '_')) return false;
  return std::all_of(s.begin(), s.end(),
                     [](unsigned char c) {
                       return std::isalnum(c) || c == '_' || c == '-' || c == '.' || c == '/' || c == ' ';
                     }) &&
         s.back() != ' ';
}

// A JSON string is also a valid YAML double-quoted scalar.
std::string yaml_string(const std::string& s) { return plain_yaml(s) ? s : nlohmann::json(s).dump(); }

void emit_yaml(std::ostringstream& out, const nlohmann::json& value, int indent) {
  const std::string pad(static_cast<size_t>(indent), ' ');
  if (value.is_object()) {
    for (const auto& [key, v] : value.items()) {
      out << pad << yaml_string(key) << ":";
      if ((v.is_object() || v.is_array()) && !v.empty()) {
        out << "\n";
        emit_yaml(out, v, indent + 2);
      } else {
        out << " ";
        emit_yaml(out, v, 0);
      }
    }
  } else if (value.is_array()) {
    for (const auto& v : value) {
      if ((v.is_object() || v.is_array()) && !v.empty()) {
        out << pad << "-\n";
        emit_yaml(out, v, indent + 2);
      } else {
        out << pad << "- ";
        emit_yaml(out, v, 0);
      }
    }
  } else if (value.is_string()) {
    out << yaml_string(value.get<std::string>()) << "\n";
  } else {
    out << (value.is_object() ? "{}" : value.is_array() ? "[]" : value.dump()) << "\n";
  }
}

}  // namespace

std::string to_yaml(const nlohmann::json& value) {
  if (value.empty()) return "{}\n";
  std::ostringstream out;
  emit_yaml(out, value, 0);
  return out.str();
}

}  // namespace accelerate::detail::yaml
