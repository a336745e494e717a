#!/usr/bin/env bash
# Installs the dependencies, builds, and runs the main example on 2 processes: a character-level
# GPT trained on examples/data/tinyshakespeare.txt (logs, TensorBoard files and checkpoints go to
# runs/char_gpt). Extra arguments go to the example, e.g. `--resume` or `--mixed_precision bf16`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh release accelerate_cli char_gpt
exec build/release/bin/accelerate launch --num_processes 2 build/release/examples/char_gpt --output_dir runs/char_gpt "$@"
