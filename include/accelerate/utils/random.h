// Seeding and synchronising random generators (upstream: accelerate/utils/random.py).
// `set_seed` seeds LibTorch's default generators (CPU and, when present, every CUDA device) and
// the C library's `std::rand`; `synchronize_rng_states` copies the generator states of process 0
// to every process. Upstream's Python-only generators (`random`, NumPy) have no C++ counterpart
// here, and neither do its XLA, NPU, MLU, SDAA, MUSA, XPU, HPU and Neuron generators.
//
// Note that LibTorch's default generators belong to the process: ranks running as threads share
// them, so per-rank streams in such tests come from `at::Generator` objects of their own.
//
// Example:
//   accelerate::set_seed(42);                                   // every process draws alike
//   accelerate::set_seed(42, /*device_specific=*/true);         // process i uses seed 42 + i
//   accelerate::synchronize_rng_states({"torch", "generator"}, sampler_generator);
#pragma once

#include "accelerate/state.h"
#include "accelerate/utils/dataclasses.h"

#include <ATen/core/Generator.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace accelerate {

/// Seeds LibTorch's default CPU generator, every CUDA device's default generator (when CUDA is
/// available) and `std::srand` (with the seed's low 32 bits) for reproducible runs. With
/// `device_specific` the seed is offset by the process index of the process-wide `PartialState`,
/// which is initialised from the environment if it was not yet (as upstream's is). With
/// `deterministic` LibTorch raises on operators without a deterministic implementation
/// (`at::globalContext().setDeterministicAlgorithms`); it is never turned off here.
void set_seed(uint64_t seed, bool device_specific = false, bool deterministic = false);
/// `set_seed` with the process index of `state` when `device_specific` (e.g. ranks as threads).
void set_seed(const PartialState& state, uint64_t seed, bool device_specific = false, bool deterministic = false);

/// Replaces, on every process, the state of the generator `rng_type` stands for with that of
/// process 0 (upstream: `synchronize_rng_state`): kTorch (LibTorch's default CPU generator),
/// kCuda (the default generator of this process's CUDA device; needs CUDA) or kGenerator
/// (`generator`, which must then be given). The other `RNGType`s name Python-only devices and
/// are refused, as is a missing generator or CUDA, before anything is exchanged. A collective:
/// every process must call it with the same type.
void synchronize_rng_state(const PartialState& state, RNGType rng_type,
                           std::optional<at::Generator> generator = std::nullopt);
/// `synchronize_rng_state` on the process-wide state.
void synchronize_rng_state(RNGType rng_type, std::optional<at::Generator> generator = std::nullopt);

/// Replaces, on every process, the state of each generator named in `rng_types` with that of
/// process 0 (upstream: `synchronize_rng_states`). Names: "torch" (LibTorch's default CPU
/// generator), "cuda" (the default generator of this process's CUDA device; needs CUDA) and
/// "generator" (`generator`, which must then be given): `RNGType`'s spellings, one
/// `synchronize_rng_state` each. A collective: every process must call it with the same names.
/// Every name is checked before anything is exchanged.
void synchronize_rng_states(const PartialState& state, const std::vector<std::string>& rng_types,
                            std::optional<at::Generator> generator = std::nullopt);
/// `synchronize_rng_states` on the process-wide state.
void synchronize_rng_states(const std::vector<std::string>& rng_types,
                            std::optional<at::Generator> generator = std::nullopt);

}  // namespace accelerate
