// Loading optimizer state straight from a checkpoint file, and checking a load without it: every
// check runs on views of the mapped file (checkpointing.h's `state_dict_views`), then the values
// are read in bulk into the optimizer's own state tensors where they match (new ones otherwise),
// so that loading allocates and copies nothing it need not. Defined in optimizer_state.cpp.
#pragma once

#include "accelerate/checkpointing.h"
#include "accelerate/utils/safetensors.h"

namespace accelerate::detail::checkpoint {

/// `load_optimizer_state_dict(optimizer, views)` for `views = state_dict_views(file)`, reading the
/// values from `file` only after every check passed; errors name the file.
void load_optimizer_state_from_file(torch::optim::Optimizer& optimizer, const StateDict& views,
                                    const SafetensorsFile& file, const LoadOptimizerStateOptions& options = {});

/// Raises what loading `state` into `optimizer` would raise before changing it (with `file`, as
/// `load_optimizer_state_from_file` reads it), changing nothing. What `Accelerator::load_state`
/// runs on every optimizer before it changes any (Note [Loading changes nothing or all]).
void check_optimizer_state(torch::optim::Optimizer& optimizer, const StateDict& state,
                           const SafetensorsFile* file, const LoadOptimizerStateOptions& options);

}  // namespace accelerate::detail::checkpoint
