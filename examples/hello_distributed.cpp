// The smallest end-to-end program: run it alone or with `accelerate launch --num_processes 2`.
// Each process learns where it stands, takes its share of the work, and the processes agree on a
// result through a collective.
#include <accelerate/accelerate.h>

#include <torch/torch.h>

#include <string>
#include <vector>

namespace acc = accelerate;

int main() {
  acc::PartialState state;  // reads the launcher's environment, or runs as a single process
  state.print("running on", state.num_processes(), "process(es):", acc::to_string(state.distributed_type()));

  // Preparation that must happen once (a download, a cache) runs on the main process first.
  state.main_process_first([&] { state.print("main process prepares the data first"); });

  // Each process takes its own contiguous share of the prompts.
  const std::vector<std::string> prompts = {"to be", "or not", "to be:", "that is", "the question"};
  auto mine = state.split_between_processes(prompts, /*apply_padding=*/true);
  std::string joined;
  for (const auto& p : mine) joined += "'" + p + "' ";
  std::cout << "process " << state.process_index() << " handles " << joined << std::endl;

  // Work on tensors, then agree: any process can raise the trigger, every process sees it.
  auto x = torch::arange(4, torch::kFloat) * (state.process_index() + 1);
  if (x.sum().item<float>() > 10) state.set_trigger();
  const bool someone_large = state.check_trigger();
  state.wait_for_everyone();
  state.print("some process saw a large sum:", someone_large ? "yes" : "no");
  acc::PartialState::reset();
  return 0;
}
