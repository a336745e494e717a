#!/usr/bin/env bash
# Builds the safetensors header fuzzer, the pickle fuzzer and the fuzzer of torch.distributed.
# checkpoint's metadata with clang (libFuzzer + ASan + UBSan) into build/fuzz and runs them from
# their seed corpora (fuzz/corpus, fuzz/corpus_pickle, fuzz/corpus_dcp), the last two for half as
# long. Fails on any crash, leak or sanitizer report. Then, when the asan
# preset has built it, runs the load_state fuzzer (fuzz/load_state_fuzzer.cpp) for half as long,
# then on Python's layout and on DCP folders for a quarter each.
# Usage: scripts/fuzz.sh [seconds]   (default 60)
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
build=build/fuzz

cmake -S fuzz -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build"

# New inputs go to a scratch corpus; the committed seeds are only read.
mkdir -p "$build/corpus" "$build/artifacts"
"$build/safetensors_header_fuzzer" \
  -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -max_len=4096 \
  -dict=fuzz/safetensors.dict -artifact_prefix="$build/artifacts/" -print_final_stats=1 \
  "$build/corpus" fuzz/corpus

# The pickle reader under torch.save's files (protocol 2 as PyTorch writes it, numpy's objects in
# random states).
mkdir -p "$build/corpus_pickle"
"$build/pickle_fuzzer" \
  -max_total_time="$((seconds / 2))" -rss_limit_mb=2048 -timeout=10 -max_len=8192 \
  -artifact_prefix="$build/artifacts/" -print_final_stats=1 \
  "$build/corpus_pickle" fuzz/corpus_pickle

# The metadata of torch.distributed.checkpoint folders (upstream's FSDP), seeded with what
# PyTorch 2.13's dcp.save and this project write.
mkdir -p "$build/corpus_dcp"
"$build/dcp_metadata_fuzzer" \
  -max_total_time="$((seconds / 2))" -rss_limit_mb=2048 -timeout=10 -max_len=16384 \
  -artifact_prefix="$build/artifacts/" -print_final_stats=1 \
  "$build/corpus_dcp" fuzz/corpus_dcp

# load_state of mutated checkpoint folders, under ASan + UBSan (built by scripts/test.sh).
if [ -x build/asan/tests/load_state_fuzzer ]; then
  ASAN_OPTIONS=allocator_may_return_null=1 build/asan/tests/load_state_fuzzer --seconds "$((seconds / 2))" "$RANDOM"
  # Without LeakSanitizer: Note [LibTorch's archive reader leaks on a refused archive] in tests/CMakeLists.txt.
  ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=0 \
    build/asan/tests/load_state_fuzzer --seconds "$((seconds / 4))" "$RANDOM" --python
  ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=0 \
    build/asan/tests/load_state_fuzzer --seconds "$((seconds / 4))" "$RANDOM" --dcp
fi
