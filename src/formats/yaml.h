// A YAML writer for the JSON values trackers record (TensorBoard's hparams text, DVCLive's
// params.yaml): block style, strings quoted only where YAML would read them otherwise.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace accelerate::detail::yaml {

/// `value` as a YAML document.
std::string to_yaml(const nlohmann::json& value);

}  // namespace accelerate::detail::yaml
