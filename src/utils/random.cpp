// Seeding and synchronising random generators; see include/accelerate/utils/random.h.
#include "accelerate/utils/random.h"

#include "accelerate/utils/environment.h"
#include "detail/collectives.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <mutex>

namespace accelerate {
namespace {

constexpr const char* kSynchronize = "synchronize_rng_states";

enum class RngType { kTorch, kCuda, kGenerator };

RngType parse_rng_type(const std::string& name) {
  if (name == "torch") return RngType::kTorch;
  if (name == "cuda") return RngType::kCuda;
  if (name == "generator") return RngType::kGenerator;
  C10_THROW_ERROR(ValueError, c10::str("[", kSynchronize, "] unknown generator type \"", name,
                                       "\"; expected one of \"torch\", \"cuda\", \"generator\""));
}

// The generator a name stands for on this process.
at::Generator generator_for(RngType type, const PartialState& state, const std::optional<at::Generator>& generator) {
  switch (type) {
    case RngType::kTorch:
      return at::detail::getDefaultCPUGenerator();
    case RngType::kCuda: {
      // This process's device, else (a CPU state on a CUDA machine) the current CUDA device.
      const auto index = state.device().is_cuda() ? state.device().index() : c10::DeviceIndex(-1);
      return at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, index));
    }
    case RngType::kGenerator:
      return *generator;
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled generator type");
}

void copy_state_from_main_process(const PartialState& state, at::Generator generator) {
  at::Tensor rng_state;
  {
    // See Note [Acquire lock when using random generators] in ATen.
    std::lock_guard<std::mutex> lock(generator.mutex());
    rng_state = generator.get_state();
  }
  rng_state = detail::broadcast(state, rng_state, /*from_process=*/0, kSynchronize);
  if (state.is_main_process()) return;
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(rng_state);
}

void seed_everything(uint64_t seed, bool deterministic) {
  at::manual_seed(seed);  // the CPU generator and, when there are GPUs, every CUDA device's
  std::srand(static_cast<unsigned>(seed));
  if (deterministic) at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
}

}  // namespace

void set_seed(uint64_t seed, bool device_specific, bool deterministic) {
  if (device_specific) seed += static_cast<uint64_t>(PartialState().process_index());
  seed_everything(seed, deterministic);
}

void set_seed(const PartialState& state, uint64_t seed, bool device_specific, bool deterministic) {
  if (device_specific) seed += static_cast<uint64_t>(state.process_index());
  seed_everything(seed, deterministic);
}

void synchronize_rng_states(const PartialState& state, const std::vector<std::string>& rng_types,
                            std::optional<at::Generator> generator) {
  // Every name is checked before the first exchange.
  std::vector<RngType> types;
  types.reserve(rng_types.size());
  for (const auto& name : rng_types) {
    types.push_back(parse_rng_type(name));
    TORCH_CHECK(types.back() != RngType::kCuda || is_cuda_available(), "[", kSynchronize,
                "] \"cuda\" needs CUDA, which this process does not have");
    TORCH_CHECK_VALUE(types.back() != RngType::kGenerator || generator.has_value(), "[", kSynchronize,
                      "] \"generator\" needs a generator to synchronise, but none was given");
  }
  for (const RngType type : types) copy_state_from_main_process(state, generator_for(type, state, generator));
}

void synchronize_rng_states(const std::vector<std::string>& rng_types, std::optional<at::Generator> generator) {
  synchronize_rng_states(PartialState(), rng_types, std::move(generator));
}

}  // namespace accelerate
