// Loading optimizer state straight from a checkpoint file: every check runs on views of the
// mapped file, then the values are read in bulk into the optimizer's own state tensors where
// they match (new ones otherwise), so that loading allocates and copies nothing it need not.
#pragma once

#include "accelerate/checkpointing.h"
#include "accelerate/utils/safetensors.h"

namespace accelerate::detail {

/// What `load_state_dict_file` reads from `file`, with the tensors as views of the mapped file
/// (nothing is copied). Raises what `load_state_dict_file` raises.
StateDict state_dict_views(const SafetensorsFile& file);

/// `load_optimizer_state_dict(optimizer, views)` for `views = state_dict_views(file)`, reading the
/// values from `file` only after every check passed; errors name the file.
void load_optimizer_state_from_file(torch::optim::Optimizer& optimizer, const StateDict& views,
                                    const SafetensorsFile& file, const LoadOptimizerStateOptions& options = {});

}  // namespace accelerate::detail
