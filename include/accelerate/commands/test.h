// `accelerate test` (upstream: accelerate/commands/test.py with test_utils/scripts/test_script.py):
// launches a built-in end-to-end check on the configured setup — the same launcher, processes and
// back-end a user's job gets — and says clearly whether everything passed. The checks: process
// control (ranks, `main_process_first`, `split_between_processes`), data sharding (every sample
// seen once across processes), training equivalence (distributed SGD equals one process on the
// whole batch), collectives (gather, reduce, broadcast, padding), and a checkpoint save/load.
// Setting `ACCELERATE_TEST_FAIL_CHECK=<check>` makes that check expect a wrong value, to see a
// failure reported.
#pragma once

#include <string>
#include <vector>

namespace accelerate::commands {

/// The checks of `accelerate test`, in the order they run.
const std::vector<std::string>& test_checks();

/// Runs every check in this process as one process of the job described by the environment; the
/// main process prints one line per check. Throws naming the first failed check.
void run_test_checks();

/// `accelerate test [--config_file F]`: launches `<accelerate_program> test --run_checks` through
/// `accelerate launch` with the configuration, prints the outcome, and returns 0 when every check
/// passed on every process, else the launcher's exit code.
int test_main(const std::vector<std::string>& argv, const std::string& accelerate_program);

}  // namespace accelerate::commands
