// A program for the tracking test: every process of the job creates the same trackers under one
// project folder, logs three steps and ends training; only the main process may write.
//
//   mp_tracking PROJECT      log_with = {"all"} under PROJECT; prints, per process, whether it holds
//                            the real TensorBoard tracker or one that does nothing
#include "accelerate/accelerate.h"

#include <iostream>
#include <memory>
#include <string>

namespace acc = accelerate;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: mp_tracking PROJECT\n";
    return 2;
  }
  acc::Accelerator accelerator({.log_with = {"all"}, .project_dir = argv[1]});
  accelerator.init_trackers("run", {{"learning_rate", 0.5}, {"processes", accelerator.num_processes()}});
  for (int step = 0; step < 3; ++step) {
    accelerator.log({{"loss", 1.0 / (step + 1)}, {"rank", accelerator.process_index()}}, step);
  }
  const bool real =
      std::dynamic_pointer_cast<acc::TensorBoardTracker>(accelerator.get_tracker("tensorboard")) != nullptr;
  std::cout << "process " << accelerator.process_index() << " tensorboard " << (real ? "real" : "blank") << std::endl;
  accelerator.end_training();
  return 0;
}
