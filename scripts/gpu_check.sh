#!/usr/bin/env bash
# Builds accelerate-cpp against the CUDA build of PyTorch that pip installed on a machine with an
# NVIDIA GPU, and checks its CUDA paths there: the GPU test tier, `accelerate env`, the main job on
# one GPU in bf16, and the W1 benchmark beside plain PyTorch. That machine needs PyTorch (pip,
# with CUDA), nvcc, CMake >= 3.25, ninja and a C++20 compiler, but no package registry: what the
# build needs beyond PyTorch is prepared beforehand on a machine with Debian's registry.
#
# Usage:
#   scripts/gpu_check.sh --prepare [DIR]   as root, on a machine with Debian's registry: downloads
#                                          into DIR (default .cache/gpu-deps, git-ignored) what the
#                                          build needs beyond PyTorch; nothing is installed
#   scripts/gpu_check.sh [--steps LIST] [DIR]
#                                          on the GPU machine: builds under build/gpu with DIR's
#                                          dependencies and runs the checks
#   scripts/gpu_check.sh --help
#
# --prepare fetches with `apt-get download` / `apt-get source --download-only` (through a private
# source list: the system's apt configuration is not changed) and unpacks with `dpkg -x` / `tar`:
#   root/usr/{include,share/cmake}/  nlohmann-json and CLI11 (headers and CMake packages)
#   root/usr/src/googletest/         GoogleTest and GoogleMock sources (Debian's googletest)
#   src/yaml-cpp/                    yaml-cpp sources (Debian's source package)
#   gloo/include/gloo/               Gloo headers (Debian's libgloo-dev), used only when the
#                                    PyTorch wheel lacks them (see "Gloo" below)
#   MANIFEST                         what came from which package version
# DIR travels with the checkout (with the device tool: carry ".cache/gpu-deps").
#
# Steps of the check, in order (--steps takes a comma-separated subset, e.g. "tests,main-job" on
# a tree built before); each step's output is also in build/gpu/logs/STEP.log:
#   deps       GoogleTest and yaml-cpp built from DIR (static, position-independent) and installed
#              into build/gpu/deps/prefix
#   configure  CMake (Release, Ninja) with CMAKE_PREFIX_PATH = torch.utils.cmake_prefix_path, that
#              prefix and DIR/root/usr; no MPI back-end
#   build      the library, `accelerate` (accelerate_cli), the GPU tier (accelerate_gpu_tests and
#              the programs it launches), the main example char_gpt and the benchmark programs
#              of the device table (bench_training, bench_training_plain, bench_fsdp)
#   env        `accelerate env` (must report CUDA)
#   tests      ctest -L gpu, one test at a time (fails when every test skipped)
#              a test that crashes is run again alone under gdb and compute-sanitizer, where
#              the machine has them (logs in build/gpu/logs/crash-NAME.*.log)
#   main-job   examples/char_gpt through `accelerate launch`, 1 process on one GPU, 100 steps,
#              --mixed_precision bf16 (the validation loss must fall)
#   bench      the GPU table, bench/device_table.py --device cuda on one GPU: W1 (the MLP) and W2
#              (the transformer) in fp32, bf16 and fp16 with the scaler, the library's loop beside
#              the same loop in plain LibTorch (bench_training_plain, the limit) and beside its
#              PyTorch twin; the main job's tokens/s; W9 (bench_fsdp) at 2 processes sharing the
#              GPU: DDP, FULL_SHARD and SHARD_GRAD_OP, peak device memory of process 0; W12, the
#              GPT-2-small-shaped model in bf16 (tokens/s, MFU, peak memory) beside plain LibTorch
#              and nanoGPT-style PyTorch, eager and under torch.compile
# The script goes on after a failed step where later steps do not depend on it, then prints a
# summary and exits 1 naming the failed steps. Where one command may only run for a few minutes,
# split it: `--steps deps,configure,build`, then `--steps env,tests,main-job,bench` on the same
# machine (build/gpu is kept).
#
# Gloo and NCCL. src/ includes c10d's ProcessGroupGloo.hpp (under USE_C10D_GLOO, which LibTorch's
# CMake package defines) and ProcessGroupNCCL.hpp (under USE_C10D_NCCL). The first needs Gloo's
# headers: the wheel's own (torch/include/gloo) when they are there and compile, else DIR's
# Debian ones when those compile with this PyTorch, else the build goes on without Gloo
# (-UUSE_C10D_GLOO: CPU jobs of several processes are then unavailable; GPU jobs use NCCL). The
# second includes <nccl.h>, which pip wheels keep in NVIDIA's nccl package, not in torch/include:
# it is looked up there and added to the include path (when nothing compiles, "nccl" is reported
# failed and the build goes on without NCCL). Each choice is made by compiling the header once
# and is printed in the configure log (the compiler's output in build/gpu/probe/).
#
# Environment: PYTHON (default python3, the one with torch), JOBS (default nproc), CXX, CXXFLAGS
# (added to the flags the configure step chooses; "-g1" gives backtraces function names), and
# CUDA_VISIBLE_DEVICES (the single-GPU steps use its first entry, else GPU 0). HF_HOME is set to
# build/gpu/hf_home, so that no `accelerate config` file of the machine's changes the jobs.
set -euo pipefail
cd "$(dirname "$0")/.."
root_dir=$PWD
self="$root_dir/scripts/gpu_check.sh"

usage() { sed -n '2,/^set -euo pipefail/p' "$self" | grep '^#' | sed 's/^# \{0,1\}//'; }
die() { echo "gpu_check.sh: $*" >&2; exit 1; }

# ---- --prepare: on a machine with Debian's registry ---------------------------------------------

# Writes a deb-src copy of the system's Debian sources (one-line and deb822 formats) into $1.
debian_source_lists() {
  local out=$1
  mkdir -p "$out/parts"
  : > "$out/sources.list"
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    grep -E '^[[:space:]]*deb[[:space:]]' "$f" | grep -i debian | sed -E 's/^[[:space:]]*deb[[:space:]]/deb-src /' \
      >> "$out/sources.list" || true
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    # One paragraph per source: keep the enabled Debian ones, as deb-src.
    awk 'BEGIN { RS = ""; ORS = "\n\n" }
         tolower($0) ~ /uris:[^\n]*debian/ && $0 ~ /(^|\n)Types:[^\n]*deb/ && $0 !~ /(^|\n)Enabled:[[:space:]]*no/ {
           sub(/(^|\n)Types:[^\n]*/, "\nTypes: deb-src"); sub(/^\n/, ""); print }' "$f" \
      > "$out/parts/$(basename "$f")"
  done
}

prepare() {
  local dir=${1:-.cache/gpu-deps}
  [ "$(id -u)" -eq 0 ] || die "--prepare needs root (apt-get download and apt-get source as root)"
  if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
    die "--prepare needs apt-get and dpkg (a Debian machine)"
  fi
  mkdir -p "$(dirname "$dir")"
  dir=$(cd "$(dirname "$dir")" && pwd)/$(basename "$dir")
  prepare_tmp=$(mktemp -d)
  trap 'rm -rf "$prepare_tmp"' EXIT
  local tmp=$prepare_tmp
  local packages=(nlohmann-json3-dev libcli11-dev googletest libgloo-dev)
  if ! apt-cache show "${packages[@]}" >/dev/null 2>&1; then apt-get update; fi
  # apt's download sandbox user cannot write into a root-only temporary folder.
  local sandbox=(-o APT::Sandbox::User=root)

  echo "gpu_check.sh: downloading ${packages[*]}"
  mkdir -p "$tmp/debs"
  (cd "$tmp/debs" && apt-get "${sandbox[@]}" download "${packages[@]}")
  # Everything is unpacked into a staging folder first and moved into place at the end.
  local out="$tmp/out"
  mkdir -p "$out"
  : > "$tmp/manifest"
  local deb
  for deb in "$tmp"/debs/*.deb; do
    dpkg -x "$deb" "$out/root"
    echo "$(dpkg-deb -f "$deb" Package) $(dpkg-deb -f "$deb" Version) (binary package, dpkg -x into root/)" >> "$tmp/manifest"
  done
  # Gloo: the headers alone, apart (used only when the wheel lacks its own); no library, no CMake package.
  mkdir -p "$out/gloo/include"
  mv "$out/root/usr/include/gloo" "$out/gloo/include/gloo"
  rm -rf "$out/root/usr/share/cmake/Gloo" "$out/root/usr/lib" "$out/root/usr/share/doc" "$out/root/usr/share/man"

  echo "gpu_check.sh: downloading the yaml-cpp source package"
  debian_source_lists "$tmp/apt"
  mkdir -p "$tmp/apt/lists/partial" "$tmp/apt/cache/archives/partial" "$tmp/src"
  local apt_src=(-o Dir::Etc::SourceList="$tmp/apt/sources.list" -o Dir::Etc::SourceParts="$tmp/apt/parts"
                 -o Dir::State::Lists="$tmp/apt/lists" -o Dir::Cache="$tmp/apt/cache" "${sandbox[@]}")
  apt-get "${apt_src[@]}" update >/dev/null || echo "gpu_check.sh: warning: some deb-src indices failed to download" >&2
  (cd "$tmp/src" && apt-get "${apt_src[@]}" source --download-only yaml-cpp) \
    || die "could not download yaml-cpp's source package (the deb-src lists come from /etc/apt/sources.list*)"
  local orig
  orig=$(find "$tmp/src" -maxdepth 1 -name 'yaml-cpp_*.orig.tar.*' -print -quit)
  [ -n "$orig" ] || die "apt-get source yaml-cpp brought no orig tarball"
  mkdir -p "$tmp/unpack" "$out/src"
  tar -xf "$orig" -C "$tmp/unpack"
  mv "$tmp"/unpack/* "$out/src/yaml-cpp"
  echo "yaml-cpp $(basename "$orig" | sed -E 's/^yaml-cpp_(.*)\.orig\.tar\..*$/\1/') (source package, orig tarball into src/yaml-cpp)" \
    >> "$tmp/manifest"
  sort "$tmp/manifest" > "$out/MANIFEST"
  # A folder made by an earlier --prepare is replaced (moved aside into the staging area, which
  # goes away on exit); any other non-empty folder is left alone.
  if [ -f "$dir/MANIFEST" ]; then
    mv "$dir" "$tmp/previous"
  elif [ -e "$dir" ] && [ -n "$(ls -A "$dir")" ]; then
    die "$dir is not empty and was not made by --prepare; pass an empty or new folder"
  else
    rmdir "$dir" 2>/dev/null || true
  fi
  mkdir -p "$(dirname "$dir")"
  mv "$out" "$dir"
  echo
  cat "$dir/MANIFEST"
  echo "gpu_check.sh: prepared $dir: $(du -sh "$dir" | cut -f1)"
}

# ---- the check: on the GPU machine --------------------------------------------------------------

all_steps="deps,configure,build,env,tests,main-job,bench"

# The facts about the installed PyTorch that the build needs, as shell assignments.
torch_facts() {
  "$PYTHON" - <<'EOF'
import glob, os, shlex
import torch, torch.utils
import torch.distributed as dist
facts = {
    "TORCH_VERSION": torch.__version__,
    "TORCH_PREFIX": torch.utils.cmake_prefix_path,
    "TORCH_INCLUDE": os.path.join(os.path.dirname(torch.__file__), "include"),
    "TORCH_CUDA": torch.version.cuda or "",
    "TORCH_ABI": str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
    "TORCH_GPUS": str(torch.cuda.device_count() if torch.cuda.is_available() else 0),
    "TORCH_NCCL": str(int(dist.is_available() and dist.is_nccl_available())),
}
if torch.cuda.is_available():
    major, minor = torch.cuda.get_device_capability(0)
    facts["TORCH_ARCH"] = f"{major}.{minor}"
    facts["TORCH_GPU_NAMES"] = "; ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
# Header folders of the pip packages of NVIDIA's libraries (nccl.h lives there, not in torch/include).
try:
    import nvidia
    roots = list(nvidia.__path__)
except ImportError:
    roots = []
nccl = [h for r in roots for h in glob.glob(os.path.join(r, "**", "include", "nccl.h"), recursive=True)]
facts["NCCL_INCLUDE"] = os.path.dirname(nccl[0]) if nccl else ""
includes = sorted({d for r in roots for d in glob.glob(os.path.join(r, "**", "include"), recursive=True) if os.path.isdir(d)})
facts["NVIDIA_PIP_INCLUDES"] = " ".join(includes)
for key, value in facts.items():
    print(f"{key}={shlex.quote(value)}")
EOF
}

# Compiles a file that includes one c10d header with the given extra flags; true when it compiles.
probe_header() {
  local header=$1; shift
  local file
  file="$BUILD/probe/$(basename "$header" .hpp).cpp"
  mkdir -p "$BUILD/probe"
  printf '#include <torch/csrc/distributed/c10d/%s>\nint main() { return 0; }\n' "$header" > "$file"
  # shellcheck disable=SC2086  # CUDA_INCLUDE_FLAGS holds several flags
  "${CXX:-c++}" -std=c++20 -fsyntax-only -D_GLIBCXX_USE_CXX11_ABI="$TORCH_ABI" -DUSE_DISTRIBUTED \
    -isystem "$TORCH_INCLUDE" -isystem "$TORCH_INCLUDE/torch/csrc/api/include" $CUDA_INCLUDE_FLAGS "$@" "$file" \
    >> "$BUILD/probe/$(basename "$header" .hpp).log" 2>&1
}

# Decides the extra compiler flags for Gloo and NCCL (see the header of this file); sets
# EXTRA_CXX_FLAGS and NCCL_OK.
choose_backend_flags() {
  EXTRA_CXX_FLAGS=""
  NCCL_OK=1
  if probe_header ProcessGroupGloo.hpp -DUSE_C10D_GLOO; then
    echo "Gloo: the headers of this PyTorch ($TORCH_INCLUDE/gloo) compile"
  elif [ -d "$DEPS/gloo/include/gloo" ] && probe_header ProcessGroupGloo.hpp -DUSE_C10D_GLOO -isystem "$DEPS/gloo/include"; then
    echo "Gloo: this PyTorch ships no Gloo headers; using Debian's from $DEPS/gloo/include"
    EXTRA_CXX_FLAGS+=" -isystem $DEPS/gloo/include"
  else
    echo "Gloo: no Gloo headers compile with this PyTorch (see $BUILD/probe/ProcessGroupGloo.log); building" \
         "without Gloo (-UUSE_C10D_GLOO): CPU jobs of several processes are unavailable in this build" >&2
    EXTRA_CXX_FLAGS+=" -UUSE_C10D_GLOO"
  fi
  if [ "$TORCH_NCCL" != 1 ]; then
    echo "NCCL: this PyTorch has no NCCL (torch.distributed.is_nccl_available() is false)" >&2
    EXTRA_CXX_FLAGS+=" -UUSE_C10D_NCCL"
    NCCL_OK=0
    return
  fi
  local nccl_flags=()
  [ -n "$NCCL_INCLUDE" ] && nccl_flags=(-isystem "$NCCL_INCLUDE")
  if probe_header ProcessGroupNCCL.hpp -DUSE_C10D_NCCL "${nccl_flags[@]}"; then
    echo "NCCL: ProcessGroupNCCL.hpp compiles with nccl.h from ${NCCL_INCLUDE:-the default include path}"
    EXTRA_CXX_FLAGS+=" -DUSE_C10D_NCCL ${nccl_flags[*]}"
    return
  fi
  # Headers of other CUDA libraries that LibTorch's CUDA headers include may be in pip packages only.
  local after=()
  local d
  for d in $NVIDIA_PIP_INCLUDES; do after+=(-idirafter "$d"); done
  if [ ${#after[@]} -gt 0 ] && probe_header ProcessGroupNCCL.hpp -DUSE_C10D_NCCL "${nccl_flags[@]}" "${after[@]}"; then
    echo "NCCL: ProcessGroupNCCL.hpp compiles with the header folders of NVIDIA's pip packages after the toolkit's"
    EXTRA_CXX_FLAGS+=" -DUSE_C10D_NCCL ${nccl_flags[*]} ${after[*]}"
    return
  fi
  echo "NCCL: ProcessGroupNCCL.hpp does not compile (nccl.h ${NCCL_INCLUDE:+from $NCCL_INCLUDE }- see" \
       "$BUILD/probe/ProcessGroupNCCL.log); building without NCCL (-UUSE_C10D_NCCL)" >&2
  EXTRA_CXX_FLAGS+=" -UUSE_C10D_NCCL"
  NCCL_OK=0
}

# Configures, builds and installs one dependency from source into $BUILD/deps/prefix.
build_dependency() {
  local name=$1 source=$2; shift 2
  cmake -S "$source" -B "$BUILD/deps/$name" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_INSTALL_PREFIX="$BUILD/deps/prefix" -DCMAKE_INSTALL_LIBDIR=lib -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5 "$@"
  cmake --build "$BUILD/deps/$name" -j "$JOBS"
  cmake --install "$BUILD/deps/$name"
}

step_deps() {
  [ -d "$DEPS/root/usr/src/googletest" ] || die "$DEPS/root/usr/src/googletest is missing: run --prepare"
  [ -f "$DEPS/src/yaml-cpp/CMakeLists.txt" ] || die "$DEPS/src/yaml-cpp is missing: run --prepare"
  build_dependency googletest "$DEPS/root/usr/src/googletest" -DBUILD_GMOCK=ON -DINSTALL_GTEST=ON \
    -DCMAKE_CXX_FLAGS="-D_GLIBCXX_USE_CXX11_ABI=$TORCH_ABI"
  # yaml-cpp 0.7 misses <cstdint> for GCC 13 and later; the forced include is harmless elsewhere.
  build_dependency yaml-cpp "$DEPS/src/yaml-cpp" -DYAML_CPP_BUILD_TESTS=OFF -DYAML_CPP_BUILD_TOOLS=OFF \
    -DYAML_BUILD_SHARED_LIBS=OFF -DBUILD_SHARED_LIBS=OFF -DCMAKE_CXX_FLAGS="-D_GLIBCXX_USE_CXX11_ABI=$TORCH_ABI -include cstdint"
}

# The folder holding a CMake package's config file under $1 (the first match).
config_dir() { dirname "$(find "$1" -name "$2" -print -quit | grep . || echo "$1/missing/$2")"; }

step_configure() {
  local prefix="$BUILD/deps/prefix"
  [ -d "$prefix" ] || die "$prefix is missing: run the deps step first"
  echo "PyTorch $TORCH_VERSION (CUDA $TORCH_CUDA, C++11 ABI $TORCH_ABI) at $TORCH_PREFIX"
  echo "GPUs: $TORCH_GPU_NAMES (compute capability of GPU 0: $TORCH_ARCH)"
  echo "nvcc: $NVCC"
  choose_backend_flags
  echo "extra compiler flags:$EXTRA_CXX_FLAGS"
  echo "$NCCL_OK" > "$BUILD/nccl_ok"
  # LibTorch's CMake package enables CUDA and reads the architecture list.
  export TORCH_CUDA_ARCH_LIST="$TORCH_ARCH"
  export CUDACXX="$NVCC"
  cmake -S "$root_dir" -B "$BUILD" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$TORCH_PREFIX;$prefix;$DEPS/root/usr" \
    -DCMAKE_CXX_FLAGS="$EXTRA_CXX_FLAGS ${CXXFLAGS:-}" \
    -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="${TORCH_ARCH/./}" \
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5 \
    -Dyaml-cpp_DIR="$(config_dir "$prefix" yaml-cpp-config.cmake)" \
    -DGTest_DIR="$(config_dir "$prefix" GTestConfig.cmake)" \
    -Dnlohmann_json_DIR="$(config_dir "$DEPS/root" nlohmann_jsonConfig.cmake)" \
    -DCLI11_DIR="$(config_dir "$DEPS/root" CLI11Config.cmake)" \
    -DACCELERATE_WITH_MPI=OFF \
    -DACCELERATE_BUILD_TESTS=ON -DACCELERATE_BUILD_EXAMPLES=ON -DACCELERATE_BUILD_BENCHMARKS=ON
}

step_build() {
  # -k 0: a compiler error does not stop the other files, so one run reports every error.
  cmake --build "$BUILD" -j "$JOBS" --target accelerate accelerate_cli accelerate_gpu_tests char_gpt bench_training \
    bench_training_plain bench_fsdp -- -k 0
  interposed_symbols
}

# The wheel's libtorch exported its own std::filesystem::remove_all, and the dynamic linker bound
# our calls to that copy, which crashed (Note [Removing a tree] in src/detail/files.cpp). Lists
# every C++ standard library function our programs import that one of PyTorch's libraries defines
# too: each is a call that may land in PyTorch's copy instead of libstdc++'s.
interposed_symbols() {
  local torch_lib ours theirs both
  torch_lib=$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  command -v nm >/dev/null 2>&1 || { echo "interposed symbols: nm is missing, not checked"; return 0; }
  ours=$(nm -D --undefined-only "$BUILD/tests/accelerate_gpu_tests" "$BUILD/bin/accelerate" 2>/dev/null \
    | awk '{print $NF}' | grep -E '^_ZN(K)?St|^_ZSt' | sort -u)
  theirs=$(for f in "$torch_lib"/*.so*; do nm -D --defined-only "$f" 2>/dev/null | awk '{print $NF}'; done | sort -u)
  both=$(comm -12 <(echo "$ours") <(echo "$theirs") | grep -v '^$' || true)
  if [ -z "$both" ]; then
    echo "interposed symbols: none of the standard library functions our programs import is defined by PyTorch's libraries"
  else
    echo "interposed symbols: PyTorch's libraries define $(wc -l <<< "$both") standard library function(s) our programs import:"
    c++filt <<< "$both" | sed 's/^/  /'
  fi
}

step_env() {
  local out
  out=$("$BUILD/bin/accelerate" env)
  echo "$out"
  grep -q -- "- PyTorch accelerator: CUDA" <<< "$out" || die "accelerate env does not report CUDA"
}

# Each GPU test that crashed (a signal, not a failed assertion) is run again alone, under gdb for
# a backtrace of every thread and under compute-sanitizer's memcheck for the faulting access,
# where the machine has them; the logs are build/gpu/logs/crash-NAME.{gdb,memcheck}.log and their
# first lines are printed, so one device call brings back what a crash needs to be understood.
diagnose_crashes() {
  local name program="$BUILD/tests/accelerate_gpu_tests"
  while read -r name; do
    [ -n "$name" ] || continue
    echo "---- $name crashed: running it again alone"
    if command -v gdb >/dev/null 2>&1; then
      ACCELERATE_BINARY_DIR=$BUILD timeout 300 gdb -q -batch -ex run -ex "thread apply all bt 30" \
        --args "$program" --gtest_filter="$name" > "$BUILD/logs/crash-$name.gdb.log" 2>&1 || true
      grep -E '^(Thread|#[0-9]+ )|SIG' "$BUILD/logs/crash-$name.gdb.log" | head -n 60
    fi
    local sanitizer
    sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1 || true)
    if [ -n "$sanitizer" ]; then
      ACCELERATE_BINARY_DIR=$BUILD timeout 300 "$sanitizer" --tool memcheck --show-backtrace host \
        "$program" --gtest_filter="$name" > "$BUILD/logs/crash-$name.memcheck.log" 2>&1 || true
      grep -E 'Invalid|Address|at 0x|====' "$BUILD/logs/crash-$name.memcheck.log" | head -n 40
    fi
  done < <(grep -E 'Test +#[0-9]+: .*\*\*\*Exception' <<< "$1" | sed -E 's/.*Test +#[0-9]+: ([^ ]+) .*/\1/')
}

step_tests() {
  local out status=0
  out=$(ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 600 2>&1) || status=$?
  echo "$out"
  local total skipped
  total=$(grep -cE '^ *[0-9]+/[0-9]+ Test +#' <<< "$out" || true)
  skipped=$(grep -c '\*\*\*Skipped' <<< "$out" || true)
  echo "gpu tier: $total tests, $skipped skipped"
  diagnose_crashes "$out"
  [ "$status" -eq 0 ] || return "$status"
  [ "$total" -gt 0 ] || die "ctest found no test labelled gpu"
  [ "$skipped" -lt "$total" ] || die "every GPU test skipped: the tests see no GPU"
}

step_main_job() {
  local out_dir="$BUILD/runs/char_gpt"
  rm -rf "$out_dir"
  local start=$SECONDS
  CUDA_VISIBLE_DEVICES=$ONE_GPU "$BUILD/bin/accelerate" launch --num_processes 1 --main_process_port 0 \
    "$BUILD/examples/char_gpt" --max_steps 100 --mixed_precision bf16 --output_dir "$out_dir" 2>&1 \
    | tee "$BUILD/main_job.out"
  local seconds=$((SECONDS - start))
  local first last
  first=$(grep -oE 'step 0: val_loss [0-9.]+' "$BUILD/main_job.out" | awk '{print $4}' | head -n 1)
  last=$(grep -oE 'step 100: train_loss [0-9.]+, val_loss [0-9.]+' "$BUILD/main_job.out" | awk '{print $6}' | tail -n 1)
  grep -q 'mixed precision: bf16' "$BUILD/main_job.out" || die "the main job did not run in bf16"
  if [ -z "$first" ] || [ -z "$last" ]; then die "the main job printed no validation loss at step 0 and 100"; fi
  awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }' || die "the validation loss did not fall: $first -> $last"
  ls -d "$out_dir"/checkpoints/checkpoint_* >/dev/null 2>&1 || die "the main job wrote no checkpoint"
  echo "main job: 100 steps in ${seconds} s on GPU $ONE_GPU (launch included); validation loss $first -> $last"
}

step_bench() {
  CUDA_VISIBLE_DEVICES=$ONE_GPU "$PYTHON" bench/device_table.py --build "$BUILD" --device cuda --reps 2 \
    --python "$PYTHON" --out "$BUILD/device_table.jsonl"
}

# Runs one step in a child shell (errexit applies inside it), its output on the console and in
# $LOGS/NAME.log; records a failure.
failed=()
step_lines=()
run_step() {
  local name=$1 start=$SECONDS
  printf '\n==> %s\n' "$name"
  if bash "$self" --run-step "$name" 2>&1 | tee "$LOGS/$name.log"; then
    printf '==> %s: ok (%d s)\n' "$name" $((SECONDS - start))
    step_lines+=("$(printf '%-10s ok      %4d s' "$name" $((SECONDS - start)))")
  else
    printf '==> %s: FAILED (%d s); log: %s\n' "$name" $((SECONDS - start)) "$LOGS/$name.log"
    step_lines+=("$(printf '%-10s FAILED  %4d s  %s' "$name" $((SECONDS - start)) "$LOGS/$name.log")")
    failed+=("$name")
    return 1
  fi
}

# The closing summary: each step's result and time, the GPU tier's counts, and the figures.
summary() {
  echo
  echo "gpu_check.sh: summary (logs in $LOGS; $SECONDS s in all)"
  printf '  %s\n' "${step_lines[@]}"
  if [ -f "$LOGS/tests.log" ]; then
    local counts failed_tests
    counts=$(grep -E '^gpu tier: ' "$LOGS/tests.log" | tail -n 1)
    failed_tests=$(grep -oE '[0-9]+ tests failed out of [0-9]+' "$LOGS/tests.log" | tail -n 1)
    echo "  ${counts:-gpu tier: no count}${failed_tests:+; $failed_tests}"
    grep -E '^\s+[0-9]+ - .*\((Failed|SEGFAULT|Subprocess aborted|Timeout|Exception)' "$LOGS/tests.log" | sed -E 's/^[[:space:]]+/    failed: /'
  fi
  [ -f "$LOGS/main-job.log" ] && grep -E '^main job: ' "$LOGS/main-job.log" | sed 's/^/  /'
  [ -f "$LOGS/bench.log" ] && sed -n '/^Device table/,$p' "$LOGS/bench.log" | sed 's/^/  /'
}

wanted() { [[ ",$STEPS," == *",$1,"* ]]; }

check() {
  [ -d "$DEPS" ] || die "$DEPS does not exist: run 'scripts/gpu_check.sh --prepare $DEPS' on a machine with Debian's registry"
  DEPS=$(cd "$DEPS" && pwd)
  export DEPS BUILD="$root_dir/build/gpu" PYTHON=${PYTHON:-python3} JOBS=${JOBS:-$(nproc)}
  export LOGS="$BUILD/logs"
  # An `accelerate config` file of the machine's (upstream Accelerate may be installed there) must
  # not change the jobs: the launcher reads $HF_HOME/accelerate/default_config.yaml.
  export HF_HOME="$BUILD/hf_home"
  mkdir -p "$LOGS" "$HF_HOME"
  local tool
  for tool in cmake ninja "$PYTHON" "${CXX:-c++}"; do
    command -v "$tool" >/dev/null || die "$tool is not on PATH"
  done
  NVCC=$(command -v nvcc || true)
  [ -n "$NVCC" ] || { [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc; } || die "nvcc is not on PATH"
  local cuda_home
  cuda_home=$(cd "$(dirname "$NVCC")/.." && pwd)
  CUDA_INCLUDE_FLAGS="-isystem $cuda_home/include"
  [ -d "$cuda_home/targets/x86_64-linux/include" ] && CUDA_INCLUDE_FLAGS+=" -isystem $cuda_home/targets/x86_64-linux/include"
  export NVCC CUDA_INCLUDE_FLAGS
  local facts
  facts=$(torch_facts) || die "$PYTHON cannot import torch"
  eval "$facts"
  export TORCH_VERSION TORCH_PREFIX TORCH_INCLUDE TORCH_CUDA TORCH_ABI TORCH_GPUS TORCH_NCCL NCCL_INCLUDE NVIDIA_PIP_INCLUDES
  export TORCH_ARCH=${TORCH_ARCH:-} TORCH_GPU_NAMES=${TORCH_GPU_NAMES:-}
  [ -n "$TORCH_CUDA" ] || die "PyTorch $TORCH_VERSION is a CPU-only build; install a CUDA build"
  [ "$TORCH_GPUS" -gt 0 ] || die "PyTorch $TORCH_VERSION (CUDA $TORCH_CUDA) sees no GPU (torch.cuda.is_available() is false)"
  local visible=${CUDA_VISIBLE_DEVICES:-0}
  export ONE_GPU=${visible%%,*}
  echo "gpu_check.sh: PyTorch $TORCH_VERSION, CUDA $TORCH_CUDA, $TORCH_GPUS GPU(s): $TORCH_GPU_NAMES"
  echo "gpu_check.sh: dependencies from $DEPS; build in $BUILD; steps: $STEPS"

  # Later steps need the earlier ones (or a tree built before, when they were not asked for).
  local built=1 step
  rm -f "$BUILD/nccl_ok"
  for step in deps configure build; do
    if wanted "$step" && [ $built = 1 ]; then run_step "$step" || built=0; fi
    # The configure step writes whether NCCL could be compiled in; without it GPU jobs of several
    # processes cannot work, which counts as a failure even though the build goes on.
    if [ "$step" = configure ] && [ "$(cat "$BUILD/nccl_ok" 2>/dev/null)" = 0 ]; then
      echo "==> nccl: FAILED: NCCL is unusable in this build (see $LOGS/configure.log)"
      failed+=("nccl (configure found no usable NCCL)")
    fi
  done
  for step in env tests main-job bench; do
    wanted "$step" || continue
    if [ $built = 1 ]; then
      run_step "$step" || true
    else
      echo "==> $step: not run (an earlier step failed)"
      failed+=("$step (not run)")
    fi
  done

  summary
  if [ ${#failed[@]} -eq 0 ]; then
    echo "  every step passed: $STEPS"
    return 0
  fi
  printf '  FAILED: %s\n' "${failed[@]}"
  return 1
}

# ---- command line ---------------------------------------------------------------------------------

if [ "${1:-}" = "--run-step" ]; then  # internal: one step in a child shell
  case "$2" in
    deps) step_deps ;;
    configure) step_configure ;;
    build) step_build ;;
    env) step_env ;;
    tests) step_tests ;;
    main-job) step_main_job ;;
    bench) step_bench ;;
    *) die "unknown step '$2'" ;;
  esac
  exit 0
fi

STEPS=$all_steps
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --prepare) shift; prepare "$@"; exit 0 ;;
  --steps)
    [ $# -ge 2 ] || die "--steps needs a list, e.g. --steps tests,main-job"
    STEPS=$2; shift 2
    for s in ${STEPS//,/ }; do [[ ",$all_steps," == *",$s,"* ]] || die "unknown step '$s' (steps: $all_steps)"; done ;;
  -*) usage >&2; exit 2 ;;
esac
[ $# -le 1 ] || { usage >&2; exit 2; }
DEPS=${1:-.cache/gpu-deps}
export STEPS
check
