// Programs with a collective that some processes skip, for the collective watch (Note [The
// collective watch] in src/detail/collective_watch.cpp). Errors escape main, so the launcher
// reports them as a user's job would.
//   skipped_collective gather RANK       every process gathers, but RANK waits for everyone
//   skipped_collective state_dict        under FSDP only the main process asks for the whole
//                                        state dict (a collective); then every process waits
//                                        for everyone
//   skipped_collective slow SECONDS      the main process sleeps SECONDS (a long save) while the
//                                        others wait for everyone; prints "done" on each
//   skipped_collective ended RANK        RANK ends its program at once; the others wait for
//                                        everyone
//   skipped_collective backward RANK     under DDP every process but RANK runs a backward pass
//                                        (the reducer's allreduce); RANK waits for everyone
//   skipped_collective stopped RANK FILE RANK writes its pid to FILE and stops itself (SIGSTOP)
//                                        before the barrier; a test continues it
//   skipped_collective trigger RANK      every process checks the trigger (an all-reduce) but
//                                        RANK, which waits for everyone
//   skipped_collective pair RANK         every process sums 4 floats (an all-reduce) but RANK,
//                                        which broadcasts 4 floats: a pair MPI may match by
//                                        size; prints what each process got
#include "accelerate/accelerator.h"
#include "accelerate/state.h"
#include "accelerate/utils/operations.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <csignal>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>

#include <unistd.h>

namespace acc = accelerate;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  const std::string arg = argc > 2 ? argv[2] : "";
  if (mode == "state_dict") {
    acc::Accelerator accelerator;
    TORCH_CHECK(accelerator.fsdp_plugin().has_value(), "the job was not launched with --use_fsdp");
    torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
    auto adamw = std::make_shared<torch::optim::AdamW>(net->parameters(), torch::optim::AdamWOptions(0.01));
    auto [model, optimizer] = accelerator.prepare(net, adamw);
    std::cout << "prepared" << std::endl;
    if (accelerator.is_main_process()) {
      auto state = accelerator.get_state_dict(net);  // a collective the others skip
      std::cout << "got " << state.size() << " tensors" << std::endl;
    }
    accelerator.wait_for_everyone();
    std::cout << "done" << std::endl;
    return 0;
  }
  if (mode == "backward") {
    // DDP: every process but RANK runs a backward pass (the reducer's bucket allreduce); RANK
    // waits for everyone.
    acc::Accelerator accelerator;
    torch::nn::Linear net(8, 4);
    auto sgd = std::make_shared<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.1));
    auto [model, optimizer] = accelerator.prepare(net, sgd);
    std::cout << "prepared" << std::endl;
    if (accelerator.process_index() == std::stoi(arg)) {
      accelerator.wait_for_everyone();
    } else {
      accelerator.backward(model(torch::ones({2, 8})).sum());
    }
    std::cout << "done" << std::endl;
    return 0;
  }
  acc::PartialState state;
  const int rank = state.process_index();
  state.wait_for_everyone();  // every process is up
  if (mode == "gather") {
    if (rank == std::stoi(arg)) {
      state.wait_for_everyone();
    } else {
      acc::gather(state, at::ones({4}));
    }
    std::cout << "done" << std::endl;
    return 0;
  }
  if (mode == "trigger") {
    if (rank == std::stoi(arg)) {
      state.wait_for_everyone();
    } else {
      (void)state.check_trigger();
    }
    std::cout << "done" << std::endl;
    return 0;
  }
  if (mode == "pair") {
    const at::Tensor mine = at::full({4}, static_cast<float>(rank + 1));
    const at::Tensor got = rank == std::stoi(arg) ? acc::broadcast(state, mine, 0) : acc::reduce(state, mine, "sum");
    std::cout << "got " << got[0].item<float>() << std::endl;
    std::cout << "done" << std::endl;
    return 0;
  }
  if (mode == "slow") {
    if (state.is_main_process()) std::this_thread::sleep_for(std::chrono::seconds(std::stoi(arg)));
    state.wait_for_everyone();
    std::cout << "done" << std::endl;
    return 0;
  }
  if (mode == "ended") {
    if (rank == std::stoi(arg)) {
      std::cout << "ending" << std::endl;
      return 0;
    }
    state.wait_for_everyone();
    std::cout << "done" << std::endl;
    return 0;
  }
  if (mode == "stopped") {
    if (rank == std::stoi(arg)) {
      if (argc < 4) throw std::invalid_argument("stopped RANK FILE");
      std::ofstream(argv[3]) << ::getpid() << std::endl;
      ::raise(SIGSTOP);
    }
    state.wait_for_everyone();
    std::cout << "done" << std::endl;
    return 0;
  }
  std::cerr << "skipped_collective: unknown mode '" << mode << "'" << std::endl;
  return 2;
}
