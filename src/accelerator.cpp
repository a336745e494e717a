// Accelerator construction; see include/accelerate/accelerator.h.
#include "accelerate/accelerator.h"

namespace accelerate {
namespace {

AcceleratorState make_state(const AcceleratorOptions& options) {
  AcceleratorStateOptions state_options;
  state_options.mixed_precision = options.mixed_precision;
  if (options.standalone_state) {
    state_options.partial = *options.standalone_state;
    state_options.partial.cpu = state_options.partial.cpu || options.cpu;
    if (!options.init_process_group_kwargs.backend.empty() || options.init_process_group_kwargs.timeout) {
      state_options.partial.init_kwargs = options.init_process_group_kwargs;
    }
    return AcceleratorState::standalone(state_options);
  }
  state_options.partial.cpu = options.cpu;
  state_options.partial.init_kwargs = options.init_process_group_kwargs;
  return AcceleratorState(state_options);
}

}  // namespace

Accelerator::Accelerator(const AcceleratorOptions& options)
    : state_(make_state(options)),
      gradient_state_(options.standalone_state ? GradientState::standalone() : GradientState()) {}

}  // namespace accelerate
