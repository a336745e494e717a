// The auto-wrap policies; see wrap_policy.h.
#include "fsdp/wrap_policy.h"

namespace accelerate::detail::fsdp {
namespace {

int64_t count_params(const FsdpSettings& s, const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters(/*recurse=*/false)) n += s.param_numel ? s.param_numel(p) : p.numel();
  return n;
}

// A module's class as a user names it: without namespaces, and without the "Impl" of a
// TORCH_MODULE class ("Block" for `ns::BlockImpl`).
std::string class_name(const torch::nn::Module& m) {
  std::string name = m.name();
  const auto colon = name.rfind("::");
  if (colon != std::string::npos) name = name.substr(colon + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) name.resize(name.size() - 4);
  return name;
}

bool name_matches(const std::string& pattern, const torch::nn::Module& m) {
  return pattern == m.name() || pattern == class_name(m) || pattern == class_name(m) + "Impl";
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
