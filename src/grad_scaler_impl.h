// What the library's other files need of grad_scaler.cpp beyond the public header.
#pragma once

#include "accelerate/grad_scaler.h"
#include "accelerate/state.h"

namespace accelerate::detail {

/// Makes `scaler`'s overflow checks agree over the processes of `state` (the sharded scaler of
/// upstream's FSDP): with sharded gradients each process sees only its rows' infinities, and a
/// step skipped on one process must be skipped on all.
void share_inf_checks(const GradScaler& scaler, const PartialState& state);

}  // namespace accelerate::detail
