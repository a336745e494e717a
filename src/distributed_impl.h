// What the library's other files need of distributed.cpp beyond the public header: the fully
// sharded engine behind a prepared model, and the FSDP constructor that takes settings the
// `Accelerator` resolved once.
#pragma once

#include "accelerate/distributed.h"
#include "fsdp/settings.h"

#include <memory>

namespace accelerate::detail {

namespace fsdp {
class FsdpEngine;
struct FsdpSettings;
}  // namespace fsdp
namespace tensor_parallel {
class TensorParallelEngine;
}  // namespace tensor_parallel

/// The fully sharded engine of a prepared model, or null.
fsdp::FsdpEngine* fsdp_engine(const DistributedDataParallel& model);

/// The tensor-parallel engine of a prepared model, or null.
tensor_parallel::TensorParallelEngine* tensor_parallel_engine(const DistributedDataParallel& model);
/// Gives a prepared model the engine of its split layers (the prepared model's call then checks
/// each pass, Note [Split layers called without their hook]).
void attach_tensor_parallel(DistributedDataParallel& model, std::shared_ptr<tensor_parallel::TensorParallelEngine> engine);

/// `DistributedDataParallel::fully_sharded` with the plugin already resolved into `settings`.
DistributedDataParallel fully_sharded(std::shared_ptr<torch::nn::Module> module, const PartialState& state,
                                      fsdp::FsdpSettings settings, const ForwardOptions& forward, int dp_shard_size);

}  // namespace accelerate::detail
