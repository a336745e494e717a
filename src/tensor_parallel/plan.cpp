// Tensor-parallel plans; see plan.h.
#include "tensor_parallel/plan.h"

#include <c10/util/Exception.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <set>

namespace accelerate::detail {

namespace {

std::vector<std::string> components(const std::string& name) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t dot = name.find('.', start);
    out.push_back(name.substr(start, dot == std::string::npos ? std::string::npos : dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return out;
}

}  // namespace

TpStyle parse_tp_style(const std::string& name, const std::string& pattern) {
  if (name == "colwise") return TpStyle::kColwise;
  if (name == "colwise_rep") return TpStyle::kColwiseRep;
  if (name == "rowwise") return TpStyle::kRowwise;
  if (name == "replicate") return TpStyle::kReplicate;
  if (name == "sequence_parallel") return TpStyle::kSequenceParallel;
  const bool later = name == "local_colwise" || name == "local_rowwise" ||
                     name == "gather" || name == "local" || name == "rowwise_rep" || name == "local_packed_rowwise";
  C10_THROW_ERROR(ValueError, c10::str("[TorchTensorParallelConfig] tp_plan entry \"", pattern, "\": style \"", name,
                                       "\" is ", later ? "not supported yet" : "unknown",
                                       "; the styles are colwise, colwise_rep, rowwise, sequence_parallel and replicate"));
}

const char* to_string(TpStyle style) {
  switch (style) {
    case TpStyle::kColwise: return "colwise";
    case TpStyle::kColwiseRep: return "colwise_rep";
    case TpStyle::kRowwise: return "rowwise";
    case TpStyle::kReplicate: return "replicate";
    case TpStyle::kSequenceParallel: return "sequence_parallel";
  }
  return "?";
}

bool tp_pattern_matches(const std::string& pattern, const std::string& name) {
  const auto want = components(pattern);
  const auto have = components(name);
  if (want.size() != have.size()) return false;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] != "*" && want[i] != have[i]) return false;
  }
  return true;
}

bool module_inside(const std::string& outer, const std::string& inner) {
  return inner.size() > outer.size() && inner.compare(0, outer.size(), outer) == 0 && inner[outer.size()] == '.';
}

std::vector<TpAssignment> resolve_tp_plan(torch::nn::Module& model,
                                          const std::vector<std::pair<std::string, std::string>>& plan) {
  std::vector<TpStyle> styles;
  for (const auto& [pattern, style] : plan) {
    TORCH_CHECK_VALUE(!pattern.empty(), "[TorchTensorParallelConfig] a tp_plan entry names no module (the model "
                                        "itself cannot be split)");
    styles.push_back(parse_tp_style(style, pattern));
  }
  std::vector<TpAssignment> out;
  std::set<size_t> used;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    for (size_t i = 0; i < plan.size(); ++i) {
      if (!tp_pattern_matches(plan[i].first, item.key())) continue;
      used.insert(i);
      const auto& module = item.value();
      const bool linear = dynamic_cast<torch::nn::LinearImpl*>(module.get()) != nullptr;
      const bool embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(module.get()) != nullptr;
      const bool any_class = styles[i] == TpStyle::kReplicate || styles[i] == TpStyle::kSequenceParallel;
      TORCH_CHECK_VALUE(any_class || linear || embedding, "[TorchTensorParallelConfig] module \"",
                        item.key(), "\" (", module->name(), ") cannot be split \"", to_string(styles[i]),
                        "\": the split styles apply to torch::nn::Linear and torch::nn::Embedding");
      out.push_back({item.key(), module, styles[i]});
      break;
    }
  }
  for (size_t i = 0; i < plan.size(); ++i) {
    TORCH_CHECK_VALUE(used.count(i), "[TorchTensorParallelConfig] tp_plan entry \"", plan[i].first,
                      "\" matches no module of the model that an earlier entry did not take");
  }
  // A sequence_parallel module computes on a slice of its input with all of its parameters: a
  // split module inside it would see a slice it does not expect, and one around it would slice
  // twice.
  for (const auto& sp : out) {
    if (sp.style != TpStyle::kSequenceParallel) continue;
    for (const auto& other : out) {
      const bool holds = module_inside(sp.name, other.name);
      if (other.style == TpStyle::kReplicate || (!holds && !module_inside(other.name, sp.name))) continue;
      TORCH_CHECK_VALUE(false, "[TorchTensorParallelConfig] module \"", sp.name, "\" (sequence_parallel) ",
                        holds ? "holds" : "sits inside", " module \"", other.name, "\" (",
                        to_string(other.style), "): a sequence_parallel module runs whole on a slice of the sequence, "
                        "so no other module of the plan may sit inside it or around it");
    }
  }
  return out;
}

}  // namespace accelerate::detail
