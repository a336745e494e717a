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

// The generator a name stands for on this process.
at::Generator generator_for(RNGType type, const PartialState& state, const std::optional<at::Generator>& generator) {
  switch (type) {
    case RNGType::kTorch:
      return at::detail::getDefaultCPUGenerator();
    case RNGType::kCuda: {
      // This process's device, else (a CPU state on a CUDA machine) the current CUDA device.
      const auto index = state.device().is_cuda() ? state.device().index() : c10::DeviceIndex(-1);
      return at::globalContext().defaultGenerator(c10::Device(c10::kCUDA, index));
    }
    case RNGType::kGenerator:
      return *generator;
    default: break;  // refused by check_synchronisable
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

namespace {

// Refuses, before anything is exchanged, a type this process cannot synchronise.
void check_synchronisable(RNGType type, const std::optional<at::Generator>& generator, const char* caller) {
  switch (type) {
    case RNGType::kTorch: return;
    case RNGType::kCuda:
      TORCH_CHECK(is_cuda_available(), "[", caller, "] \"cuda\" needs CUDA, which this process does not have");
      return;
    case RNGType::kGenerator:
      TORCH_CHECK_VALUE(generator.has_value(), "[", caller,
                        "] \"generator\" needs a generator to synchronise, but none was given");
      return;
    default:
      C10_THROW_ERROR(ValueError, c10::str("[", caller, "] cannot synchronise \"", to_string(type),
                                           "\" generators: that device has no LibTorch support in accelerate-cpp "
                                           "(supported: \"torch\", \"cuda\", \"generator\")"));
  }
}

}  // namespace

void synchronize_rng_state(const PartialState& state, RNGType rng_type, std::optional<at::Generator> generator) {
  check_synchronisable(rng_type, generator, "synchronize_rng_state");
  copy_state_from_main_process(state, generator_for(rng_type, state, generator));
}

void synchronize_rng_state(RNGType rng_type, std::optional<at::Generator> generator) {
  synchronize_rng_state(PartialState(), rng_type, std::move(generator));
}

void synchronize_rng_states(const PartialState& state, const std::vector<std::string>& rng_types,
                            std::optional<at::Generator> generator) {
  // Every name is checked before the first exchange.
  std::vector<RNGType> types;
  types.reserve(rng_types.size());
  for (const auto& name : rng_types) {
    try {
      types.push_back(parse_rng_type(name));
    } catch (const c10::ValueError& e) {
      C10_THROW_ERROR(ValueError, c10::str("[", kSynchronize, "] ", e.what_without_backtrace()));
    }
    check_synchronisable(types.back(), generator, kSynchronize);
  }
  for (const RNGType type : types) copy_state_from_main_process(state, generator_for(type, state, generator));
}

void synchronize_rng_states(const std::vector<std::string>& rng_types, std::optional<at::Generator> generator) {
  synchronize_rng_states(PartialState(), rng_types, std::move(generator));
}

}  // namespace accelerate
