// The `accelerate` command: a thin dispatcher over accelerate::commands.
#include "accelerate/commands/config.h"
#include "accelerate/commands/env.h"
#include "accelerate/commands/estimate.h"
#include "accelerate/commands/launch.h"
#include "accelerate/commands/merge.h"
#include "accelerate/commands/test.h"
#include "accelerate/utils/environment.h"

#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

namespace {

void usage(std::ostream& out) {
  out << "usage: accelerate <command> [<args>]\n\n"
         "commands:\n"
         "  config           create or update the default configuration (accelerate config --help)\n"
         "  env              print the versions and settings a bug report needs\n"
         "  estimate-memory  estimate a checkpoint's memory for inference and training\n"
         "  launch           run a program on one or several processes (accelerate launch --help)\n"
         "  merge-weights    merge a sharded safetensors checkpoint into one file\n"
         "  test             check the configured setup end to end (accelerate test --help)\n"
         "  version          print the versions of accelerate-cpp and LibTorch\n";
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    usage(args.empty() ? std::cerr : std::cout);
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  namespace commands = accelerate::commands;
  if (command == "launch") return commands::launch_main(args);
  if (command == "config") return commands::config_main(args, std::cin, std::cout, std::cerr);
  if (command == "env") return commands::env_main(args, std::cin, std::cout, std::cerr);
  if (command == "estimate-memory") return commands::estimate_memory_main(args, std::cin, std::cout, std::cerr);
  if (command == "merge-weights") return commands::merge_weights_main(args, std::cin, std::cout, std::cerr);
  if (command == "test") return commands::test_main(args, std::filesystem::read_symlink("/proc/self/exe").string());
  if (command == "version" || command == "--version") {
    std::cout << "accelerate-cpp " << accelerate::accelerate_version() << " (LibTorch " << accelerate::torch_version()
              << ")\n";
    return 0;
  }
  std::cerr << "accelerate: unknown command '" << command << "'\n";
  usage(std::cerr);
  return 2;
}
