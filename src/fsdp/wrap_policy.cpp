// The auto-wrap policies; see wrap_policy.h.
#include "fsdp/wrap_policy.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace accelerate::detail::fsdp {

bool name_matches(const std::string& pattern, const torch::nn::Module& m) {
  const auto class_name = [&] {
    // Without namespaces, and without the "Impl" of a TORCH_MODULE class ("Block" for `ns::BlockImpl`).
    std::string name = m.name();
    const auto colon = name.rfind("::");
    if (colon != std::string::npos) name = name.substr(colon + 2);
    if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
    return name;
  }();
  return pattern == m.name() || pattern == class_name || pattern == class_name + "Impl";
}

namespace {

int64_t count_params(const FsdpSettings& s, const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters(/*recurse=*/false)) n += s.param_numel ? s.param_numel(p) : p.numel();
  return n;
}

// Which submodules (by dotted name) are units, by the policy; post-order like PyTorch's
// recursive wrapping, so that size-based wrapping sees only what the children left.
int64_t visit(const FsdpSettings& s, const std::string& name, torch::nn::Module& m, bool is_root,
                     const std::set<std::string>& ignored, std::vector<std::pair<std::string, torch::nn::Module*>>& out) {
  int64_t unwrapped = count_params(s, m);
  for (const auto& child : m.named_children()) {
    const std::string child_name = name.empty() ? child.key() : name + "." + child.key();
    if (ignored.count(child_name)) continue;
    unwrapped += visit(s, child_name, *child.value(), false, ignored, out);
  }
  if (is_root) return unwrapped;
  bool wrap = false;
  if (s.auto_wrap_callable) {
    wrap = s.auto_wrap_callable(name, m, unwrapped);
  } else if (s.auto_wrap_policy == FsdpAutoWrapPolicy::kTransformerBasedWrap) {
    for (const auto& pattern : s.transformer_cls_names_to_wrap) wrap = wrap || name_matches(pattern, m);
  } else if (s.auto_wrap_policy == FsdpAutoWrapPolicy::kSizeBasedWrap) {
    wrap = unwrapped >= s.min_num_params;
  }
  if (!wrap) return unwrapped;
  out.emplace_back(name, &m);
  return 0;
}


}  // namespace

std::vector<std::pair<std::string, torch::nn::Module*>> choose_units(const FsdpSettings& settings,
                                                                     torch::nn::Module& root,
                                                                     const std::set<std::string>& ignored) {
  std::vector<std::pair<std::string, torch::nn::Module*>> chosen;
  visit(settings, "", root, /*is_root=*/true, ignored, chosen);
  return chosen;
}

}  // namespace accelerate::detail::fsdp

namespace accelerate {

void FullyShardedDataParallelPlugin::set_auto_wrap_policy(const torch::nn::Module& model) {
  if (auto_wrap_callable) return;
  const auto policy = detail::fsdp::auto_wrap_policy_of(*this);
  if (!policy || *policy == FsdpAutoWrapPolicy::kNoWrap) return;
  if (*policy == FsdpAutoWrapPolicy::kTransformerBasedWrap) {
    transformer_cls_names_to_wrap = detail::fsdp::transformer_cls_names_of(*this);
    TORCH_CHECK_VALUE(!transformer_cls_names_to_wrap.empty(), "[FullyShardedDataParallelPlugin::set_auto_wrap_policy] ",
                      "TRANSFORMER_BASED_WRAP needs transformer_cls_names_to_wrap (or FSDP_TRANSFORMER_CLS_TO_WRAP): ",
                      "a C++ module has no _no_split_modules to take them from");
    const auto modules = model.modules(/*include_self=*/true);
    for (const auto& pattern : transformer_cls_names_to_wrap) {
      const bool found = std::any_of(modules.begin(), modules.end(),
                                     [&](const auto& m) { return detail::fsdp::name_matches(pattern, *m); });
      TORCH_CHECK_VALUE(found, "[FullyShardedDataParallelPlugin::set_auto_wrap_policy] could not find the transformer ",
                        "layer class ", pattern, " in the model");
    }
    auto_wrap_callable = [names = transformer_cls_names_to_wrap](const std::string&, const torch::nn::Module& m,
                                                                 int64_t) {
      return std::any_of(names.begin(), names.end(),
                         [&](const std::string& pattern) { return detail::fsdp::name_matches(pattern, m); });
    };
  } else {
    const int64_t threshold = detail::fsdp::min_num_params_of(*this);
    if (threshold <= 0) {  // upstream silently drops the policy: the model is one unit
      auto_wrap_policy = FsdpAutoWrapPolicy::kNoWrap;
      min_num_params.reset();
      return;
    }
    auto_wrap_callable = [threshold](const std::string&, const torch::nn::Module&, int64_t unwrapped) {
      return unwrapped >= threshold;
    };
  }
  auto_wrap_policy.reset();
}

}  // namespace accelerate
