#!/usr/bin/env bash
# Installs the dependencies, builds, and runs the main example on 2 processes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh release accelerate_cli hello_distributed
exec build/release/bin/accelerate launch --num_processes 2 build/release/examples/hello_distributed "$@"
