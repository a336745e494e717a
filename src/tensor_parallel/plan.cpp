// Tensor-parallel plans; see plan.h.
#include "tensor_parallel/plan.h"

#include <c10/util/Exception.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <set>

namespace accelerate::detail::tensor_parallel {

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
  std::vector<const StyleEntry*> styles;
  for (const auto& [pattern, style] : plan) {
    TORCH_CHECK_VALUE(!pattern.empty(), "[TorchTensorParallelConfig] a tp_plan entry names no module (the model "
                                        "itself cannot be split)");
    styles.push_back(&find_style(style, pattern));
  }
  std::vector<TpAssignment> out;
  std::set<size_t> used;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    for (size_t i = 0; i < plan.size(); ++i) {
      if (!tp_pattern_matches(plan[i].first, item.key())) continue;
      used.insert(i);
      const auto& module = item.value();
      auto style = styles[i]->instance();
      const bool linear = dynamic_cast<torch::nn::LinearImpl*>(module.get()) != nullptr;
      const bool embedding = dynamic_cast<torch::nn::EmbeddingImpl*>(module.get()) != nullptr;
      TORCH_CHECK_VALUE(style->any_module() || linear || embedding, "[TorchTensorParallelConfig] module \"",
                        item.key(), "\" (", module->name(), ") cannot be split \"", style->name(),
                        "\": the split styles apply to torch::nn::Linear and torch::nn::Embedding");
      out.push_back({item.key(), module, std::move(style)});
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
    if (!sp.style->runs_on_sequence_piece()) continue;
    for (const auto& other : out) {
      const bool holds = module_inside(sp.name, other.name);
      if (other.style->inert() || (!holds && !module_inside(other.name, sp.name))) continue;
      TORCH_CHECK_VALUE(false, "[TorchTensorParallelConfig] module \"", sp.name, "\" (", sp.style->name(), ") ",
                        holds ? "holds" : "sits inside", " module \"", other.name, "\" (",
                        other.style->name(), "): a sequence_parallel module runs whole on a slice of the sequence, "
                        "so no other module of the plan may sit inside it or around it");
    }
  }
  return out;
}

}  // namespace accelerate::detail::tensor_parallel
