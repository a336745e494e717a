#!/usr/bin/env bash
# Installs the dependencies, builds everything and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh dev
ctest --preset dev "$@"
# The unit tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
scripts/build.sh asan accelerate_unit_tests load_state_fuzzer
ctest --preset asan "$@"
# The threaded parts (the data loader's workers, logging, the progress bar, the rendezvous store,
# the launcher's supervision, the MPI group's queue and watchdog) under ThreadSanitizer.
scripts/build.sh tsan accelerate_unit_tests accelerate_multiprocess_tests accelerate_cli mp_worker mp_collectives
ctest --preset tsan "$@"
# The safetensors header parser under libFuzzer for a minute, and load_state of mutated
# checkpoints under the sanitizers for half a minute.
scripts/fuzz.sh
