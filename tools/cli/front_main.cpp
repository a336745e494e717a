// The `accelerate` command. `accelerate launch` runs in this process, which does not load
// LibTorch; every other command is carried out by `accelerate-commands`, which this process
// becomes (Note [The launcher without LibTorch] in src/launch/CMakeLists.txt).
#include "accelerate/commands/launch.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>
#include <system_error>
#include <vector>

namespace {

namespace fs = std::filesystem;

// `accelerate-commands` beside this program (the build tree), else where it is installed.
std::vector<fs::path> commands_candidates() {
  std::error_code error;
  const fs::path self = fs::read_symlink("/proc/self/exe", error);
  if (error) return {};
  const fs::path folder = self.parent_path();
  return {folder / "accelerate-commands",
          (folder / ACCELERATE_COMMANDS_FROM_BIN / "accelerate-commands").lexically_normal()};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && std::string(argv[1]) == "launch") {
    return accelerate::commands::launch_main(std::vector<std::string>(argv + 2, argv + argc));
  }
  const auto candidates = commands_candidates();
  for (const auto& path : candidates) {
    if (::access(path.c_str(), X_OK) != 0) continue;
    ::execv(path.c_str(), argv);  // argv[0] stays `accelerate`, for its messages
    std::cerr << "accelerate: cannot run " << path.string() << ": " << std::strerror(errno) << "\n";
    return 127;
  }
  std::cerr << "accelerate: cannot find accelerate-commands, which carries out every command but `launch`";
  for (size_t i = 0; i < candidates.size(); ++i)
    std::cerr << (i == 0 ? " (looked for " : " and ") << candidates[i].string();
  std::cerr << (candidates.empty() ? "" : ")") << "; reinstall accelerate-cpp\n";
  return 127;
}
