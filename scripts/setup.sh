#!/usr/bin/env bash
# Installs every build, test and benchmark dependency from Debian packages.
# Safe to run repeatedly; needs root (or sudo) on Debian 12 (bookworm), 13 (trixie) or sid: the
# package names below exist under the same names in each (python3-safetensors from 13 on).
# `--bench` is accepted for the benchmark runner: what its PyTorch twins need is always installed.
# ACCELERATE_TORCH_PACKAGE=libtorch-cuda-dev picks the CUDA build of LibTorch
# (Debian 13 and later, in the contrib component; it brings the CUDA toolkit, from non-free).
set -euo pipefail

torch_package=${ACCELERATE_TORCH_PACKAGE:-libtorch-dev}
case "$torch_package" in
  libtorch-dev) gloo_package=libgloo-dev ;;
  libtorch-cuda-dev) gloo_package=libgloo-cuda-dev ;;  # LibTorch's CMake package also wants nvcc (below)
  *) echo "setup.sh: ACCELERATE_TORCH_PACKAGE must be libtorch-dev or libtorch-cuda-dev, got '$torch_package'" >&2; exit 2 ;;
esac

packages=(
  build-essential cmake ninja-build ccache git pkg-config
  "$torch_package" "$gloo_package"    # tensor engine and its c10d/Gloo headers
  libopenblas0-pthread                # fast BLAS for LibTorch's fp32 matrix products
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev
  libcurl4-openssl-dev                # the MLflow tracker's HTTP client
  python3-venv                        # the tests' environment of Python packages (scripts/python_env.sh)
  libprotobuf-dev protobuf-compiler
  libnuma-dev
  openmpi-bin libopenmpi-dev          # the MPI process-group back-end and mpirun
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  python3 python3-protobuf            # python3-protobuf: the test suite's TensorBoard file reader
  iproute2                            # the multi-host tests' hosts: network namespaces and veth pairs
  slurm-wlm munge                     # the multi-host tests' Slurm cluster (tests/support/cluster.h)
  openssh-server openssh-client       # the multi-host tests' ssh servers, which mpirun logs in to
  clang libclang-rt-dev               # the libFuzzer target (scripts/fuzz.sh)
)

# LibTorch's CMake package finds CUDA through nvcc; c10d's NCCL headers include <nccl.h>.
if [ "$torch_package" = libtorch-cuda-dev ]; then
  packages+=(nvidia-cuda-toolkit libnccl-dev)
fi

# Debian's PyTorch: the other side of the checkpoint interop tests (tests/python/upstream_checkpoint.py)
# and the benchmarks' twins. Debian 13 and later also package safetensors for Python, whose reader
# the tests run on the project's files.
packages+=(python3-torch)
if [ -r /etc/os-release ] && [ "$(. /etc/os-release && echo "${VERSION_ID:-}")" != "12" ]; then
  packages+=(python3-safetensors)
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
  # The daemons above (sshd, munged, slurmctld, slurmd) are for the tests, which start and stop
  # their own: a policy-rc.d that refuses keeps the packages from starting them on this machine.
  # One the machine already has is left alone.
  policy=/usr/sbin/policy-rc.d
  own_policy=0
  if [ ! -e $policy ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee $policy >/dev/null
    $sudo chmod 755 $policy
    own_policy=1
  fi
  status=0
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y --no-install-recommends "${missing[@]}" || status=$?
  if [ $own_policy -eq 1 ]; then $sudo rm -f $policy; fi
  [ $status -eq 0 ] || exit $status
  # The downloaded packages (over a gigabyte, LibTorch's and PyTorch's mostly) are not needed once
  # installed; the build trees need the room.
  $sudo apt-get clean
else
  echo "setup.sh: all Debian packages already installed"
fi
