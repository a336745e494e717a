#!/usr/bin/env bash
# Installs the dependencies, builds everything and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh dev
ctest --preset dev "$@"
# The unit tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
scripts/build.sh asan accelerate_unit_tests
ctest --preset asan "$@"
# The safetensors header parser under libFuzzer for a minute.
scripts/fuzz.sh
