// A program for the launcher tests: each mode exercises one behaviour of `accelerate launch`
// (environment, output, failures, signals, restarts) from inside a real worker process.
//
//   worker env VAR...              print VAR=value for each variable
//   worker state                   rendezvous, then print what PartialState reports
//   worker pool                    build the state, then print whether the process's buffer pool is on
//   worker pool_steps              train a DDP model with AdamW for 8 steps, reducing and gathering
//                                  a 4 MiB metric each step; print how many large buffers steps
//                                  4 to 8 took fresh, and how many the pool served again
//   worker states                  build the process-wide state, a standalone one, then the
//                                  process-wide one again after a reset; print "built 3 states"
//   worker exit CODE RANK          RANK prints an error and exits with CODE; others sleep
//   worker sigkill RANK            RANK kills itself with SIGKILL; others sleep
//   worker ignore_term RANK CODE DIR
//                                  every other rank ignores SIGTERM (and says so in DIR); RANK
//                                  exits with CODE once they all do
//   worker throw RANK              RANK throws an exception out of main after rendezvous
//   worker sleep DIR               write pid to DIR/pid_<rank>, print "ready", sleep
//   worker until_go DIR            write pid to DIR/pid_<rank>, then exit 0 once DIR/go exists
//                                  (at most a minute later); handles no signal
//   worker stubborn DIR            like sleep, but ignore SIGTERM and append a line to
//                                  DIR/alive_<rank> every 20 ms until killed
//   worker orphan DIR              leave behind a child of its own process group that ignores
//                                  SIGTERM (its pid in DIR/orphan_<rank>), then exit 0
//   worker orphan_stubborn DIR     leave the same child, then ignore SIGINT and SIGTERM, write pid
//                                  to DIR/pid_<rank>, print "ready" and sleep until killed
//   worker daemon DIR              start `env -i setsid sleep 302 &` (a session of its own, no
//                                  environment; its pid in DIR/daemon_<rank> once it runs sleep),
//                                  then exit 0
//   worker barriers DIR [SECONDS]  rendezvous (collective timeout SECONDS), write pid to
//                                  DIR/pid_<rank>, then meet the others in a barrier every 10 ms
//                                  for up to 2 minutes
//   worker fail_once RANK          on the first attempt RANK exits 3; later attempts succeed
//   worker mismatch                every rank gathers a tensor of a different length; prints
//                                  the error it gets, meets the others, exits 3
#include "accelerate/accelerator.h"
#include "accelerate/state.h"
#include "accelerate/utils/operations.h"
#include "detail/buffer_pool.h"

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unistd.h>

namespace {

int env_int(const char* key, int fallback) {
  const char* value = std::getenv(key);
  return value != nullptr ? std::atoi(value) : fallback;
}

void sleep_seconds(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  // Under mpirun the rank comes from Open MPI's variable.
  const int rank = env_int("RANK", env_int("OMPI_COMM_WORLD_RANK", 0));
  auto arg = [&](int i) { return i < argc ? std::string(argv[i]) : std::string(); };

  if (mode == "env") {
    for (int i = 2; i < argc; ++i) {
      const char* value = std::getenv(argv[i]);
      std::cout << argv[i] << "=" << (value != nullptr ? value : "<unset>") << "\n";
    }
    return 0;
  }
  if (mode == "pool") {
    accelerate::PartialState state;
    std::cout << "pool " << (accelerate::detail::host_pool_stats().installed ? "on" : "off") << std::endl;
    return 0;
  }
  if (mode == "pool_steps") {
    accelerate::Accelerator acc;
    torch::manual_seed(0);
    auto net = torch::nn::Sequential(torch::nn::Linear(1024, 1024), torch::nn::ReLU(), torch::nn::Linear(1024, 512));
    auto [model, opt] = acc.prepare(net, std::make_shared<torch::optim::AdamW>(net->parameters(), 1e-3));
    auto step = [&, &model = model, &opt = opt](int i) {
      opt.zero_grad();
      acc.backward(model(torch::randn({8, 1024})).pow(2).mean());
      opt.step();
      auto metric = torch::full({int64_t{1} << 20}, static_cast<float>(i));
      (void)acc.reduce(metric);
      (void)acc.gather(metric);
    };
    for (int i = 0; i < 3; ++i) step(i);
    const auto warm = accelerate::detail::host_pool_stats();
    for (int i = 3; i < 8; ++i) step(i);
    const auto steady = accelerate::detail::host_pool_stats();
    std::cout << "process " << acc.process_index() << ": fresh large buffers in steady steps: "
              << steady.fresh - warm.fresh << ", served again: " << steady.reused - warm.reused << std::endl;
    return 0;
  }
  if (mode == "state") {
    accelerate::PartialState state;
    state.wait_for_everyone();
    std::cout << "process " << state.process_index() << " of " << state.num_processes() << " local "
              << state.local_process_index() << " type " << accelerate::to_string(state.distributed_type())
              << " backend " << state.backend() << std::endl;
    if (state.process_index() == state.num_processes() - 1) state.set_trigger();
    std::cout << "trigger " << (state.check_trigger() ? "seen" : "missed") << std::endl;
    return 0;
  }
  if (mode == "states") {
    accelerate::PartialState first;
    (void)accelerate::PartialState::standalone({});
    accelerate::PartialState::reset();
    accelerate::PartialState again;
    std::cout << "built 3 states" << std::endl;
    return 0;
  }
  if (mode == "exit") {
    if (rank == std::stoi(arg(3))) {
      std::cerr << "Error: worker " << rank << " gives up" << std::endl;
      return std::stoi(arg(2));
    }
    sleep_seconds(60);
    return 0;
  }
  if (mode == "sigkill") {
    if (rank == std::stoi(arg(2))) {
      sleep_seconds(0.3);
      ::raise(SIGKILL);
    }
    sleep_seconds(60);
    return 0;
  }
  if (mode == "ignore_term") {
    // ignore_term RANK CODE DIR: RANK exits with CODE once every other rank ignores SIGTERM (each
    // says so with a file in DIR).
    const std::string dir = arg(4);
    if (rank == std::stoi(arg(2))) {
      const int world = env_int("WORLD_SIZE", env_int("OMPI_COMM_WORLD_SIZE", 1));
      for (int other = 0; other < world; ++other) {
        const std::string ready = dir + "/ignoring_" + std::to_string(other);
        for (int i = 0; other != rank && i < 3000 && !std::ifstream(ready).good(); ++i) sleep_seconds(0.01);
      }
      return std::stoi(arg(3));
    }
    std::signal(SIGTERM, SIG_IGN);
    std::cout << "ignoring SIGTERM" << std::endl;
    std::ofstream(dir + "/ignoring_" + std::to_string(rank)) << "1" << std::endl;
    sleep_seconds(60);
    return 0;
  }
  if (mode == "throw") {
    accelerate::PartialState state;
    if (state.process_index() == std::stoi(arg(2))) {
      throw std::runtime_error("boom from rank " + std::to_string(state.process_index()));
    }
    sleep_seconds(60);
    return 0;
  }
  if (mode == "sleep") {
    std::ofstream(arg(2) + "/pid_" + std::to_string(rank)) << ::getpid() << std::endl;
    std::cout << "ready" << std::endl;
    sleep_seconds(60);
    return 0;
  }
  if (mode == "until_go") {
    std::ofstream(arg(2) + "/pid_" + std::to_string(rank)) << ::getpid() << std::endl;
    for (int i = 0; i < 6000 && !std::ifstream(arg(2) + "/go").good(); ++i) sleep_seconds(0.01);
    return 0;
  }
  if (mode == "stubborn") {
    std::signal(SIGTERM, SIG_IGN);
    std::ofstream(arg(2) + "/pid_" + std::to_string(rank)) << ::getpid() << std::endl;
    std::cout << "ready" << std::endl;
    std::ofstream alive(arg(2) + "/alive_" + std::to_string(rank));
    for (int i = 0; i < 3000; ++i) {
      alive << i << std::endl;
      sleep_seconds(0.02);
    }
    return 0;
  }
  if (mode == "orphan" || mode == "orphan_stubborn") {
    // The child tells its parent once it is in a group of its own and ignores SIGTERM: before
    // that, a signal to the worker's group (the launcher forwards SIGINT so) would end it too, and
    // a slow child (under a sanitizer, on a busy machine) was still in the worker's group when
    // the tests sent it.
    int ready[2];
    if (::pipe(ready) != 0) return 5;
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(ready[0]);
      ::setpgid(0, 0);
      std::signal(SIGTERM, SIG_IGN);
      const char byte = 1;
      if (::write(ready[1], &byte, 1) != 1) ::_exit(1);
      ::close(ready[1]);
      for (int i = 0; i < 3000; ++i) sleep_seconds(0.02);
      ::_exit(0);
    }
    ::close(ready[1]);
    char byte = 0;
    if (child < 0 || ::read(ready[0], &byte, 1) != 1) return 5;
    ::close(ready[0]);
    std::ofstream(arg(2) + "/orphan_" + std::to_string(rank)) << child << std::endl;
    if (mode == "orphan") return 0;
    std::signal(SIGINT, SIG_IGN);
    std::signal(SIGTERM, SIG_IGN);
    std::ofstream(arg(2) + "/pid_" + std::to_string(rank)) << ::getpid() << std::endl;
    std::cout << "ready" << std::endl;
    sleep_seconds(60);
    return 0;
  }
  if (mode == "daemon") {
    // The shell's background job is no process-group leader, so setsid makes the session itself
    // and execs sleep in the same process: $! is the daemon.
    const std::string file = arg(2) + "/daemon_" + std::to_string(rank);
    const std::string command = "env -i setsid sleep 302 & echo $! >" + file + ".tmp";
    if (std::system(command.c_str()) != 0) return 4;
    int pid = 0;
    std::ifstream(file + ".tmp") >> pid;
    bool sleeping = false;
    for (int i = 0; i < 3000 && !sleeping; ++i) {  // until it runs sleep, so that the launcher names it so
      std::string name;
      std::getline(std::ifstream("/proc/" + std::to_string(pid) + "/comm"), name);
      sleeping = name == "sleep";
      if (!sleeping) sleep_seconds(0.01);
    }
    if (!sleeping) return 4;
    std::ofstream(file) << pid << std::endl;
    return 0;
  }
  if (mode == "rejoin") {
    // Attempt 0 meets in barriers until a peer is lost; a later attempt meets in a few and ends.
    const int attempt = env_int("TORCHELASTIC_RESTART_COUNT", -1);
    std::ofstream(arg(2) + "/started_" + std::to_string(attempt) + "_" + std::to_string(rank))
        << ::getpid() << std::endl;
    accelerate::PartialStateOptions options;
    options.init_kwargs.timeout = std::chrono::seconds(30);
    accelerate::PartialState state(options);
    std::ofstream(arg(2) + "/pid_" + std::to_string(rank)) << ::getpid() << std::endl;
    for (int i = 0; i < (attempt == 0 ? 12000 : 20); ++i) {
      state.wait_for_everyone();
      sleep_seconds(0.01);
    }
    std::cout << "attempt " << attempt << " done" << std::endl;
    return 0;
  }
  if (mode == "barriers") {
    accelerate::PartialStateOptions options;
    if (!arg(3).empty()) options.init_kwargs.timeout = std::chrono::seconds(std::stoi(arg(3)));
    accelerate::PartialState state(options);
    std::ofstream(arg(2) + "/pid_" + std::to_string(rank)) << ::getpid() << std::endl;
    for (int i = 0; i < 12000; ++i) {
      state.wait_for_everyone();
      sleep_seconds(0.01);
    }
    return 0;
  }
  if (mode == "fail_once") {
    const int attempt = env_int("TORCHELASTIC_RESTART_COUNT", -1);
    if (attempt == 0 && rank == std::stoi(arg(2))) {
      std::cerr << "Error: failing on purpose in attempt 0" << std::endl;
      return 3;
    }
    accelerate::PartialState state;
    state.wait_for_everyone();
    std::cout << "attempt " << attempt << " ok" << std::endl;
    return 0;
  }
  if (mode == "mismatch") {
    accelerate::PartialState state;
    try {
      accelerate::gather(state, at::zeros({state.process_index() + 3}));
      std::cout << "no error" << std::endl;
      return 0;
    } catch (const c10::Error& e) {
      std::cerr << "caught: " << e.what_without_backtrace() << std::endl;
    }
    state.wait_for_everyone();  // the check itself completed, so the group is still usable
    return 3;
  }
  std::cerr << "worker: unknown mode '" << mode << "'" << std::endl;
  return 2;
}
