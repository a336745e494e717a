#!/usr/bin/env bash
# Installs the dependencies, builds everything and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The Python packages some tests read the project's output with (wandb, mlflow; upstream
# Accelerate on PyTorch's CPU wheel), in virtual environments outside the checkout, made once
# (Note [Tests against the real packages]).
scripts/python_env.sh >/dev/null
scripts/python_env.sh tests/python/requirements-wandb.txt >/dev/null
scripts/python_env.sh tests/python/requirements-upstream.txt >/dev/null
# From nothing, the four build trees take about 5.5 GB and the compiler cache up to 2.5 GB more:
# say so at the start rather than let a full disk stop a link half an hour in.
free_kb=$(df -Pk . | awk 'NR == 2 { print $4 }')
if [ "${free_kb:-0}" -lt $((8 * 1024 * 1024)) ]; then
  echo "test.sh: warning: $((free_kb / 1024)) MiB free on this checkout's file system; a build from nothing needs about 8 GiB" >&2
fi
# The dev preset compiles at -O3, as release builds do, with warnings as errors: the analyses
# GCC's optimiser runs only there (-Warray-bounds, ...) fail the build of every target.
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
