# Sourced by the bench/run_* runners: reads `[--quick] [repetitions] [flags...]`, builds the
# release tree unless BUILD_DIR names one already built (bench/run does), and picks the rows file.
# Sets: quick ("" or "--quick"), reps, extra (the remaining flags), build, rows, standalone.
# A runner appends its rows (schema: bench/summarize.py) to "$rows"; run alone (no BENCH_ROWS),
# it summarises them itself with `finish NAME`.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=""
if [ "${1:-}" = "--quick" ]; then quick="--quick"; shift; fi
reps=3
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then reps=$1; shift; fi
extra=("$@")
build=${BUILD_DIR:-build/release}

# bench_build TARGET...: configures and builds the release tree unless BUILD_DIR is set.
bench_build() {
  if [ -z "${BUILD_DIR:-}" ]; then
    scripts/setup.sh --bench >/dev/null
    cmake --preset release >/dev/null
    cmake --build --preset release --target "$@" >/dev/null
  fi
  mkdir -p "$build/bench"
}

# launch N [launcher flags...] PROGRAM [args...]: runs PROGRAM through our launcher on N
# processes, one OpenMP/OpenBLAS thread each, with process 0's lines unprefixed. Callers name the
# back-end (--backend gloo|mpi): the launcher's own default is MPI when the build has it.
launch() {
  local n=$1
  shift
  "$build/bin/accelerate" launch -n "$n" --num_cpu_threads_per_process 1 --main_process_port 0 "$@" \
    | sed 's/^\[rank0\]: //'
}

# Whether this build has the MPI back-end: its runs are the "cpp-mpi" side, while the "cpp" side
# runs on Gloo like the PyTorch twins.
has_mpi() { "$build/bin/accelerate" env | grep -q "MPI available: yes"; }

standalone=0
if [ -z "${BENCH_ROWS:-}" ]; then standalone=1; fi

# finish NAME: run alone, prints the table of this runner's rows and writes
# $build/bench/results_NAME.json.
finish() {
  if [ "$standalone" = 1 ]; then
    /usr/bin/python3 bench/summarize.py "$rows" --json "$build/bench/results_$1.json"
  fi
}
