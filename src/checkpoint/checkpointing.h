// The private side of checkpointing.cpp: a state-dict file read as views of its mapped bytes, for
// the loads that check every tensor before they copy any (optimizer_state.h, load_state.cpp).
#pragma once

#include "accelerate/checkpointing.h"
#include "accelerate/utils/safetensors.h"

namespace accelerate::detail::checkpoint {

/// What `load_state_dict_file` reads from `file`, with the tensors as views of the mapped file
/// (nothing is copied). Raises what `load_state_dict_file` raises.
StateDict state_dict_views(const SafetensorsFile& file);

}  // namespace accelerate::detail::checkpoint
