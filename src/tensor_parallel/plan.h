// A tensor-parallel plan resolved against a model: which module gets which style (the styles
// are tensor_parallel/style.h).
#pragma once

#include "tensor_parallel/style.h"

#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accelerate::detail::tensor_parallel {

/// Whether the module name `name` matches `pattern`, where `*` stands for one dot-separated
/// component ("blocks.*.fc1" matches "blocks.3.fc1").
bool tp_pattern_matches(const std::string& pattern, const std::string& name);

struct TpAssignment {
  std::string name;  ///< the module's name in the model
  std::shared_ptr<torch::nn::Module> module;
  std::shared_ptr<ParallelStyle> style;  ///< this module's instance of its style
};

/// Whether the module named `inner` lies inside the one named `outer` (a proper descendant).
bool module_inside(const std::string& outer, const std::string& inner);

/// Every module of `model` that the first matching entry of `plan` names, with its style, in
/// the model's order. Throws `c10::ValueError` for an unknown style, a pattern that matches no
/// module, a style the module's class cannot take, or a "sequence_parallel" module that holds, or
/// sits inside, another module of the plan that is not "replicate".
std::vector<TpAssignment> resolve_tp_plan(torch::nn::Module& model,
                                          const std::vector<std::pair<std::string, std::string>>& plan);

}  // namespace accelerate::detail::tensor_parallel
