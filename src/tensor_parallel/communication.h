// The communication of tensor parallelism: autograd functions over the tensor-parallel group's
// collectives, each with its backward pass (Megatron-LM's "mappings": copy to the group, sum over
// it, gather and slice along the last dimension or along the sequence). The styles
// (tensor_parallel/style.h) call them around their modules; what to split and when to communicate
// is theirs, not this file's. The functions take the group by the number `register_group` gives,
// since an autograd node's saved data holds numbers, not process groups.
#pragma once

#include "accelerate/state.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace accelerate::detail::tensor_parallel {

/// The API name in tensor parallelism's errors and collective records.
inline constexpr const char* kTpApi = "TensorParallel";

/// The number by which the communication functions find `group`; the same group always gets the
/// same number. The group is kept for the rest of the process (autograd nodes may outlive the
/// engine that made them).
int64_t register_group(const PartialState& group);

/// Forward: `x`; backward: the gradients summed over the group (the input of a column-parallel
/// layer, whose every piece of output depends on all of it).
at::Tensor copy_to_group(const at::Tensor& x, int64_t group);
/// Forward: `x` summed over the group; backward: the gradient itself.
at::Tensor sum_over_group(const at::Tensor& x, int64_t group);
/// Forward: every process's piece joined on the last dimension; backward: this process's slice.
at::Tensor gather_last_dim(const at::Tensor& x, int64_t group);
/// Forward: this process's equal slice of the last dimension; backward: the slices' gradients
/// joined.
at::Tensor slice_last_dim(const at::Tensor& x, int64_t group);
/// Forward: this process's piece of dimension 1, the sequence (`sequence_piece`); backward: the
/// pieces' gradients joined.
at::Tensor slice_sequence(const at::Tensor& x, int64_t group);
/// Forward: every process's piece of dimension 1 joined into the whole sequence of `len`;
/// backward: this process's piece of the gradient.
at::Tensor gather_sequence(const at::Tensor& x, int64_t group, int64_t len);

/// One process's piece of a sequence: torch.chunk's pieces of `len` over `n` processes, ceil(len
/// / n) long each, the last ones shorter or empty.
struct SequencePiece {
  int64_t start = 0, length = 0;
};
/// The piece of process `rank` of `n` of a sequence of `len`.
SequencePiece sequence_piece(int64_t len, int n, int rank);

}  // namespace accelerate::detail::tensor_parallel
