// Enum spellings and small parsers for the option structs of utils/dataclasses.h.
#include "accelerate/utils/dataclasses.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>

namespace accelerate {
namespace {

std::string lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

}  // namespace

std::string to_string(DistributedType type) {
  switch (type) {
    case DistributedType::kNo: return "NO";
    case DistributedType::kMultiCpu: return "MULTI_CPU";
    case DistributedType::kMultiGpu: return "MULTI_GPU";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown DistributedType");
}

DistributedType parse_distributed_type(std::string_view text) {
  if (text == "NO") return DistributedType::kNo;
  if (text == "MULTI_CPU") return DistributedType::kMultiCpu;
  if (text == "MULTI_GPU") return DistributedType::kMultiGpu;
  C10_THROW_ERROR(ValueError, c10::str("[parse_distributed_type] expected one of NO, MULTI_CPU, MULTI_GPU, got '", text,
                    "' (DeepSpeed, FSDP, Megatron-LM, XLA and the other Python-only back-ends are not supported)"));
}

std::string to_string(PrecisionType precision) {
  switch (precision) {
    case PrecisionType::kNo: return "no";
    case PrecisionType::kFp16: return "fp16";
    case PrecisionType::kBf16: return "bf16";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown PrecisionType");
}

PrecisionType parse_precision_type(std::string_view text) {
  const std::string value = lower(text);
  if (value == "no" || value.empty()) return PrecisionType::kNo;
  if (value == "fp16") return PrecisionType::kFp16;
  if (value == "bf16") return PrecisionType::kBf16;
  TORCH_CHECK_VALUE(value != "fp8", "[parse_precision_type] fp8 mixed precision is not supported by accelerate-cpp; "
                                    "use 'no', 'fp16' or 'bf16'");
  C10_THROW_ERROR(ValueError, c10::str("[parse_precision_type] expected one of 'no', 'fp16', 'bf16', got '", text, "'"));
}

std::string to_string(DDPCommunicationHookType hook) {
  switch (hook) {
    case DDPCommunicationHookType::kNo: return "no";
    case DDPCommunicationHookType::kFp16: return "fp16";
    case DDPCommunicationHookType::kBf16: return "bf16";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown DDPCommunicationHookType");
}

DDPCommunicationHookType parse_comm_hook_type(std::string_view text) {
  const std::string value = lower(text);
  if (value == "no" || value.empty()) return DDPCommunicationHookType::kNo;
  if (value == "fp16") return DDPCommunicationHookType::kFp16;
  if (value == "bf16") return DDPCommunicationHookType::kBf16;
  TORCH_CHECK_VALUE(value != "power_sgd" && value != "batched_power_sgd", "[parse_comm_hook_type] '", text,
                    "' (PowerSGD) is not supported by accelerate-cpp; use 'no', 'fp16' or 'bf16'");
  C10_THROW_ERROR(ValueError, c10::str("[parse_comm_hook_type] expected one of 'no', 'fp16', 'bf16', got '", text, "'"));
}

bool str_to_bool(std::string_view text) {
  const std::string value = lower(text);
  if (value == "1" || value == "true" || value == "yes" || value == "y" || value == "on" || value == "t") return true;
  if (value == "0" || value == "false" || value == "no" || value == "n" || value == "off" || value == "f") return false;
  C10_THROW_ERROR(ValueError, c10::str("[str_to_bool] expected a boolean such as 1/0, true/false, yes/no, on/off, got '", text, "'"));
}

}  // namespace accelerate
