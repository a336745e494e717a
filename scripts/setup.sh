#!/usr/bin/env bash
# Installs every build, test and benchmark dependency from Debian packages.
# Safe to run repeatedly; needs root (or sudo) on Debian 12. `--bench` adds what the
# benchmarks' PyTorch twins need.
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache git pkg-config
  libtorch-dev libgloo-dev            # tensor engine and its c10d/Gloo headers
  libopenblas0-pthread                # fast BLAS for LibTorch's fp32 matrix products
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev
  libprotobuf-dev protobuf-compiler
  libnuma-dev
  openmpi-bin libopenmpi-dev          # the MPI process-group back-end and mpirun
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  python3 python3-protobuf            # python3-protobuf: the test suite's TensorBoard file reader
  clang libclang-rt-14-dev           # the libFuzzer target (scripts/fuzz.sh)
)

# The benchmarks compare against PyTorch twins, which need Debian's PyTorch (the same LibTorch).
if [ "${1:-}" = "--bench" ]; then
  packages+=(python3-torch)
fi

if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo=sudo; else
    echo "setup.sh: must run as root (or with sudo available) to install Debian packages" >&2
    exit 1
  fi
else
  sudo=
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup.sh: installing ${missing[*]}"
  $sudo apt-get update
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends "${missing[@]}"
else
  echo "setup.sh: all Debian packages already installed"
fi
