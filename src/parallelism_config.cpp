// The parallel dimensions, resolved once; see include/accelerate/parallelism_config.h.
#include "accelerate/parallelism_config.h"

#include "accelerate/utils/environment.h"
#include "detail/topology.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>

namespace accelerate {
namespace {

constexpr const char* kApi = "ParallelismConfig";

int size_or_one(const std::optional<int>& size) { return size.value_or(1); }

std::optional<int> from_env(const std::optional<int>& given, const char* name) {
  if (given) return given;
  if (auto v = get_env(name)) return detail::parse_env_int(name, *v);
  return std::nullopt;
}

}  // namespace

ParallelismConfig ParallelismConfig::resolved(int num_processes) const {
  ParallelismConfig out = *this;
  out.device_mesh.reset();
  out.tp_size = from_env(tp_size, "PARALLELISM_CONFIG_TP_SIZE").value_or(1);
  out.cp_size = from_env(cp_size, "PARALLELISM_CONFIG_CP_SIZE").value_or(1);
  out.dp_replicate_size = from_env(dp_replicate_size, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE").value_or(1);
  for (const auto& [name, size] : {std::pair{"dp_replicate_size", *out.dp_replicate_size},
                                   std::pair{"cp_size", *out.cp_size}, std::pair{"tp_size", *out.tp_size}}) {
    TORCH_CHECK_VALUE(size >= 1, "[", kApi, "] ", name, " must be at least 1, got ", size);
  }
  const int rest = *out.dp_replicate_size * *out.cp_size * *out.tp_size;
  out.dp_shard_size = from_env(dp_shard_size, "PARALLELISM_CONFIG_DP_SHARD_SIZE").value_or(std::max(1, num_processes / rest));
  TORCH_CHECK_VALUE(*out.dp_shard_size >= 1, "[", kApi, "] dp_shard_size must be at least 1, got ", *out.dp_shard_size);
  TORCH_CHECK_VALUE(out.total_size() == num_processes, "[", kApi, "] dp_replicate_size (", *out.dp_replicate_size,
                    ") x dp_shard_size (", *out.dp_shard_size, ") x tp_size (", *out.tp_size, ") x cp_size (",
                    *out.cp_size, ") must equal the number of processes, ", num_processes);
  if (out.cp_backend.empty()) out.cp_backend = get_env("PARALLELISM_CONFIG_CP_BACKEND").value_or("torch");
  TORCH_CHECK_VALUE(out.cp_backend == "torch", "[", kApi, "] cp_backend must be \"torch\" (the one backend upstream "
                    "and this library have), got \"", out.cp_backend, "\"");
  auto& strategy = out.cp_handler.cp_comm_strategy;
  if (strategy.empty()) strategy = get_env("PARALLELISM_CONFIG_CP_COMM_STRATEGY").value_or("allgather");
  TORCH_CHECK_VALUE(strategy == "allgather" || strategy == "alltoall", "[", kApi, "] cp_handler.cp_comm_strategy must "
                    "be \"allgather\" or \"alltoall\", got \"", strategy, "\"");
  return out;
}

int ParallelismConfig::total_size() const { return data_parallel_size() * non_data_parallel_size(); }
int ParallelismConfig::data_parallel_size() const {
  return size_or_one(dp_replicate_size) * size_or_one(dp_shard_size);
}
int ParallelismConfig::non_data_parallel_size() const { return size_or_one(cp_size) * size_or_one(tp_size); }
bool ParallelismConfig::dp_replicate_enabled() const { return size_or_one(dp_replicate_size) > 1; }
bool ParallelismConfig::dp_shard_enabled() const { return size_or_one(dp_shard_size) > 1; }
bool ParallelismConfig::tp_enabled() const { return size_or_one(tp_size) > 1; }
bool ParallelismConfig::cp_enabled() const { return size_or_one(cp_size) > 1; }

std::vector<std::string> ParallelismConfig::dp_dim_names() const {
  std::vector<std::string> out;
  if (dp_replicate_enabled()) out.emplace_back("dp_replicate");
  if (dp_shard_enabled()) out.emplace_back("dp_shard");
  return out;
}

std::vector<std::string> ParallelismConfig::non_dp_dim_names() const {
  std::vector<std::string> out;
  if (tp_enabled()) out.emplace_back("tp");
  if (cp_enabled()) out.emplace_back("cp");
  return out;
}

std::vector<std::string> ParallelismConfig::dp_shard_cp_dim_names() const {
  std::vector<std::string> out;
  if (dp_shard_enabled()) out.emplace_back("dp_shard");
  if (cp_enabled()) out.emplace_back("cp");
  return out;
}

std::vector<std::string> ParallelismConfig::dp_cp_dim_names() const {
  std::vector<std::string> out = dp_dim_names();
  if (cp_enabled()) out.emplace_back("cp");
  return out;
}

std::vector<std::string> ParallelismConfig::fsdp_dim_names() const {
  std::vector<std::string> out;
  if (dp_replicate_enabled()) out.emplace_back("dp_replicate");
  out.emplace_back("dp_shard_cp");
  return out;
}

std::vector<std::string> ParallelismConfig::active_mesh_dims() const {
  std::vector<std::string> out = dp_dim_names();
  for (auto& name : non_dp_dim_names()) out.push_back(std::move(name));
  return out;
}

DeviceMesh ParallelismConfig::build_device_mesh(const PartialState& state) {
  TORCH_CHECK_VALUE(total_size() == state.num_processes(), "[", kApi, "] build_device_mesh: the sizes' product, ",
                    total_size(), ", is not the number of processes, ", state.num_processes(),
                    " (resolve the config first: resolved(num_processes))");
  device_mesh = std::make_shared<DeviceMesh>(state, size_or_one(dp_replicate_size), size_or_one(dp_shard_size),
                                             size_or_one(cp_size), size_or_one(tp_size));
  return *device_mesh;
}

DeviceMesh ParallelismConfig::get_device_mesh(const std::optional<PartialState>& state) {
  if (device_mesh) return *device_mesh;
  TORCH_CHECK_VALUE(state.has_value(), "[", kApi, "] get_device_mesh: no mesh has been built yet; pass the state of "
                    "the processes to lay out");
  return build_device_mesh(*state);
}

std::string ParallelismConfig::to_json() const {
  nlohmann::json j;
  const auto put = [&](const char* key, const std::optional<int>& size) {
    j[key] = size ? nlohmann::json(*size) : nlohmann::json(nullptr);
  };
  put("dp_replicate_size", dp_replicate_size);
  put("dp_shard_size", dp_shard_size);
  put("tp_size", tp_size);
  put("cp_size", cp_size);
  j["cp_backend"] = cp_backend.empty() ? nlohmann::json(nullptr) : nlohmann::json(cp_backend);
  j["cp_handler"] = {{"cp_comm_strategy", cp_handler.cp_comm_strategy.empty()
                                              ? nlohmann::json(nullptr)
                                              : nlohmann::json(cp_handler.cp_comm_strategy)}};
  return j.dump();
}

ParallelismConfig ParallelismConfig::from_json(const std::string& text) {
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK_VALUE(j.is_object(), "[", kApi, "] from_json: expected a JSON object, got: ", text.substr(0, 200));
  ParallelismConfig out;
  for (const auto& [key, value] : j.items()) {
    const auto size = [&]() -> std::optional<int> {
      if (value.is_null()) return std::nullopt;
      TORCH_CHECK_VALUE(value.is_number_integer(), "[", kApi, "] from_json: ", key, " must be an integer or null, got ",
                        value.dump());
      return value.get<int>();
    };
    const auto text_of = [&](const nlohmann::json& v, const std::string& name) -> std::string {
      if (v.is_null()) return {};
      TORCH_CHECK_VALUE(v.is_string(), "[", kApi, "] from_json: ", name, " must be a string or null, got ", v.dump());
      return v.get<std::string>();
    };
    if (key == "dp_replicate_size") {
      out.dp_replicate_size = size();
    } else if (key == "dp_shard_size") {
      out.dp_shard_size = size();
    } else if (key == "tp_size") {
      out.tp_size = size();
    } else if (key == "cp_size") {
      out.cp_size = size();
    } else if (key == "cp_backend") {
      out.cp_backend = text_of(value, key);
    } else if (key == "cp_handler") {
      if (value.is_null()) continue;
      TORCH_CHECK_VALUE(value.is_object(), "[", kApi, "] from_json: cp_handler must be an object, got ", value.dump());
      for (const auto& [inner, v] : value.items()) {
        TORCH_CHECK_VALUE(inner == "cp_comm_strategy", "[", kApi, "] from_json: unknown cp_handler field \"", inner,
                          "\"");
        out.cp_handler.cp_comm_strategy = text_of(v, "cp_handler.cp_comm_strategy");
      }
    } else if (key == "sp_size") {
      TORCH_CHECK_VALUE(size().value_or(1) == 1, "[", kApi, "] from_json: sp_size ", value.dump(), ": sequence "
                        "parallelism is DeepSpeed's (Ulysses), which has no C++ library; use cp_size");
    } else if (key == "tp_handler" || key == "sp_backend" || key == "sp_handler") {
      continue;  // the plan is AcceleratorOptions::tp_handler; the others belong to sp_size
    } else {
      C10_THROW_ERROR(ValueError, c10::str("[", kApi, "] from_json: unknown field \"", key, "\""));
    }
  }
  return out;
}

}  // namespace accelerate
