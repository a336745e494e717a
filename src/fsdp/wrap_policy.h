// Which submodules become units of their own, by the plugin's auto-wrap policy (upstream's
// `transformer_auto_wrap_policy`, `size_based_auto_wrap_policy`, or the user's callable).
#pragma once

#include "fsdp/settings.h"

#include <torch/nn/module.h>

#include <set>
#include <string>
#include <utility>
#include <vector>

namespace accelerate::detail::fsdp {

/// Whether `pattern` names the class of `m`: its full name, or without namespaces and with or
/// without the "Impl" of a TORCH_MODULE class ("Block" for `ns::BlockImpl`).
bool name_matches(const std::string& pattern, const torch::nn::Module& m);

/// The submodules of `root` (by dotted name) that the policy of `settings` wraps, children before
/// their parents as PyTorch's recursive wrapping visits them; nothing inside `ignored`.
std::vector<std::pair<std::string, torch::nn::Module*>> choose_units(const FsdpSettings& settings,
                                                                     torch::nn::Module& root,
                                                                     const std::set<std::string>& ignored);

}  // namespace accelerate::detail::fsdp
