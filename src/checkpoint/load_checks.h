// The checks of a load without the load: what `Accelerator::load_state` runs on every model and
// optimizer before it changes any of them (Note [Loading changes nothing or all] in
// src/checkpoint/load_state.cpp), so that one that fails cannot leave another loaded.
#pragma once

#include "accelerate/checkpointing.h"
#include "accelerate/utils/modeling.h"
#include "accelerate/utils/safetensors.h"

#include <string>

namespace accelerate::detail {

/// Raises what `load_checkpoint_in_model(module, checkpoint, options)` would raise before its
/// first copy (files, names, shapes, dtypes), changing nothing.
void check_checkpoint_in_model(torch::nn::Module& module, const std::string& checkpoint,
                               const LoadCheckpointOptions& options);

/// Raises what loading `state` into `optimizer` would raise before changing it (with `file`, as
/// `load_optimizer_state_from_file` reads it), changing nothing.
void check_optimizer_state(torch::optim::Optimizer& optimizer, const StateDict& state,
                           const SafetensorsFile* file, const LoadOptimizerStateOptions& options);

}  // namespace accelerate::detail
