// A tensor-parallel plan resolved against a model: which module gets which style.
#pragma once

#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace accelerate::detail {

/// How a module is split over the tensor-parallel group (transformers' plan names).
enum class TpStyle {
  kColwise,     ///< "colwise": output features split; the output stays sharded on its last dimension
  kColwiseRep,  ///< "colwise_rep": the same, the output gathered whole
  kRowwise,     ///< "rowwise": input features (a Linear) or the vocabulary (an Embedding) split; outputs summed
  kReplicate,   ///< "replicate": kept whole
  kSequenceParallel,  ///< "sequence_parallel": parameters whole, the input split on dimension 1 (the
                      ///< sequence), the output gathered whole
};

/// The style named `name`; throws `c10::ValueError` naming the known ones.
TpStyle parse_tp_style(const std::string& name, const std::string& pattern);
const char* to_string(TpStyle style);

/// Whether the module name `name` matches `pattern`, where `*` stands for one dot-separated
/// component ("blocks.*.fc1" matches "blocks.3.fc1").
bool tp_pattern_matches(const std::string& pattern, const std::string& name);

struct TpAssignment {
  std::string name;  ///< the module's name in the model
  std::shared_ptr<torch::nn::Module> module;
  TpStyle style;
};

/// Whether the module named `inner` lies inside the one named `outer` (a proper descendant).
bool module_inside(const std::string& outer, const std::string& inner);

/// Every module of `model` that the first matching entry of `plan` names, with its style, in
/// the model's order. Throws `c10::ValueError` for an unknown style, a pattern that matches no
/// module, a style the module's class cannot take, or a "sequence_parallel" module that holds, or
/// sits inside, another module of the plan that is not "replicate".
std::vector<TpAssignment> resolve_tp_plan(torch::nn::Module& model,
                                          const std::vector<std::pair<std::string, std::string>>& plan);

}  // namespace accelerate::detail
