// Uses the installed library: a state, a split, a version string.
#include <accelerate/accelerate.h>

#include <iostream>

int main() {
  accelerate::PartialState state;
  auto mine = state.split_between_processes(std::vector<int>{1, 2, 3});
  std::cout << "consumer ok: " << accelerate::to_string(state.distributed_type()) << " " << mine.size() << " "
            << accelerate::accelerate_version() << "\n";
  return mine.size() == 3 ? 0 : 1;
}
