#!/usr/bin/env bash
# Runs the project's test command inside a Debian root made with debootstrap, so that the tree is
# checked against that release's LibTorch, compiler and Open MPI without leaving this machine.
#
# Usage: scripts/test_debian.sh SUITE [--cuda] [--prepare | --build | --dev | --release-check |
#                                --main-job | --bench NAME] [-- ARGS...]
#   SUITE       bookworm (LibTorch 1.13), trixie (2.6) or sid (newest)
#   --cuda      use the release's CUDA build of LibTorch (libtorch-cuda-dev, in contrib); CUDA code
#               is compiled and its tests run, those that need a GPU skipping with a reason
#   --prepare   only make the root and install the packages scripts/setup.sh names (CI does this
#               while the native build compiles)
#   --build     only build the dev tree, which fills the root's compiler cache (CI does this at
#               the lowest priority while the native tests run, so that --dev then compiles little)
#   --dev       only the dev tier (unit, cli, multiprocess and gpu tests; built at -O3 with
#               warnings as errors), without the sanitizer and fuzzer stages of scripts/test.sh,
#               and without the tests against Python packages from the package index (label
#               `packages`: the root has no environment of them; the machine's own run has)
#   --release-check  only the main job's targets built in release with warnings as errors
#   --main-job  the README's other command instead, scripts/run_main_job.sh (ARGS go to the example)
#   --bench NAME  a benchmark runner instead, bench/run_NAME, with that release's PyTorch twins
#               (trixie's PyTorch runs its own FSDP on CPU processes: W9's twin)
#   ARGS        passed to ctest (or to the main job, or to the runner)
#
# The root lives in .cache/debian/SUITE[-cuda] (git-ignored) and is made once; later runs reuse it.
# Its compiler cache lives outside the checkout, like the native build's ccache, in
# $ACCELERATE_DEBIAN_CCACHE (default ~/.cache/accelerate-cpp/ccache-SUITE[-cuda]), so that fresh
# clones on the same machine (CI) reuse it too. Each run copies the checkout (tracked files and
# untracked files git does not ignore) into a fresh folder of the root and runs the project's own
# scripts/setup.sh there, so the release's own package names are what gets installed. Needs root
# and debootstrap.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '5,21p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
suite=$1; shift
case "$suite" in bookworm|trixie|sid|forky) ;; *) echo "test_debian.sh: unknown suite '$suite'" >&2; usage ;; esac
cuda=0; tier=all; ctest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) cuda=1 ;;
    --prepare) tier=prepare ;;
    --build) tier=build ;;
    --dev) tier=dev ;;
    --main-job) tier=main-job ;;
    --release-check) tier=release-check ;;
    --bench)
      [ $# -ge 2 ] || usage
      tier=bench; runner=$2; shift
      [ -x "bench/run_$runner" ] || { echo "test_debian.sh: no benchmark runner bench/run_$runner" >&2; exit 2; } ;;
    --) shift; ctest_args=("$@"); break ;;
    *) echo "test_debian.sh: unknown option '$1'" >&2; usage ;;
  esac
  shift
done
[ "$(id -u)" -eq 0 ] || { echo "test_debian.sh: needs root (debootstrap, chroot and mounts)" >&2; exit 1; }
if ! command -v debootstrap >/dev/null 2>&1; then
  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap
fi

name=$suite; [ $cuda -eq 1 ] && name=$suite-cuda
root=$PWD/.cache/debian/$name
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
components=main; [ $cuda -eq 1 ] && components=main,contrib,non-free

if [ ! -e "$root/.ready" ]; then
  echo "test_debian.sh: making a Debian $suite root in $root"
  rm -rf --one-file-system "$root"; mkdir -p "$root"
  debootstrap --variant=minbase --components="$components" "$suite" "$root" "$mirror"
  # debootstrap writes only the first component into sources.list.
  echo "deb $mirror $suite ${components//,/ }" > "$root/etc/apt/sources.list"
  touch "$root/.ready"
fi
cp /etc/resolv.conf "$root/etc/resolv.conf"
# Mirrors that serve a snapshot of a moving suite (sid) carry Release files past their date.
echo 'Acquire::Check-Valid-Until "false";' > "$root/etc/apt/apt.conf.d/99accelerate-snapshot"

# Mounts the tests need; undone on every exit.
mounted=()
mount_in() {  # mount_in TARGET MOUNT-ARGS...
  local target=$root$1; shift
  mkdir -p "$target"
  mount "$@" "$target"
  mounted=("$target" "${mounted[@]}")
}
cleanup() { for m in "${mounted[@]}"; do umount -l "$m" 2>/dev/null || true; done; }
trap cleanup EXIT
# The root is a mount point of its own, so that `ip netns` (the multihost tests' hosts) can make
# its mounts private inside the chroot ("mount --make-rslave /" needs / to be a mount).
mount_in "" --bind "$root"
mount_in /proc -t proc proc
mount_in /sys -t sysfs sysfs
mount_in /dev --rbind /dev
mount --make-rslave "$root/dev"
mount_in /dev/shm -t tmpfs -o mode=1777 shm
mount_in /tmp -t tmpfs -o mode=1777 tmp
ccache_dir=${ACCELERATE_DEBIAN_CCACHE:-$HOME/.cache/accelerate-cpp/ccache-$name}
mkdir -p "$ccache_dir"
mount_in /var/cache/ccache --bind "$ccache_dir"

# A clean copy of the checkout.
work=$root/work/accelerate
rm -rf "$work"; mkdir -p "$work"
git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c 'test -e "{}" && printf "%s\0" "{}"' |
  tar --null -T - -cf - | tar -xf - -C "$work"

torch_pkg=libtorch-dev; [ $cuda -eq 1 ] && torch_pkg=libtorch-cuda-dev

# Note [cuDNN stand-in]
# libtorch-cuda-dev depends on nvidia-cudnn, a contrib package whose installation downloads cuDNN
# from NVIDIA; a machine that reaches only Debian's mirror cannot finish it. There, the root gets
# a stand-in libcudnn.so.9 that defines the cuDNN functions LibTorch links against (same version
# node) and aborts if one is ever called: enough to link and to run every test that needs no GPU
# (no cuDNN call can happen without one). A machine with a GPU uses the real cuDNN.
if [ $cuda -eq 1 ]; then
  chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    /bin/bash -euo pipefail -c '
      dpkg-query -W -f="\${Status}" libtorch-cuda-dev 2>/dev/null | grep -q "install ok installed" && exit 0
      apt-get update
      apt-get install -y --no-install-recommends build-essential || true
      apt-get install -y --no-install-recommends libtorch-cuda-dev || true
      dpkg-query -W -f="\${Status}" nvidia-cudnn | grep -q "install ok installed" && exit 0
      echo "test_debian.sh: cuDNN could not be downloaded; linking against a stand-in (Note [cuDNN stand-in])"
      lib=/usr/lib/x86_64-linux-gnu
      symbols=$(nm -D --undefined-only $lib/libtorch_cuda.so | sed -n "s/^ *U \(cudnn[A-Za-z0-9_]*\)@libcudnn.so.9$/\1/p" | sort -u)
      work=$(mktemp -d)
      { echo "#include <stdio.h>"; echo "#include <stdlib.h>"
        for f in $symbols; do echo "void $f(void) { fputs(\"cuDNN stand-in: $f called; install the real cuDNN\\n\", stderr); abort(); }"; done
      } > $work/cudnn.c
      printf "libcudnn.so.9 { global: cudnn*; local: *; };\n" > $work/cudnn.map
      gcc -shared -fPIC -o $lib/libcudnn.so.9 -Wl,-soname,libcudnn.so.9 -Wl,--version-script=$work/cudnn.map $work/cudnn.c
      printf "#!/bin/sh\nexit 0\n" > /var/lib/dpkg/info/nvidia-cudnn.postinst
      dpkg --configure -a'
fi
if [ $tier = prepare ]; then
  inner='scripts/setup.sh'
elif [ $tier = build ]; then
  inner='scripts/setup.sh && scripts/build.sh dev'
elif [ $tier = dev ]; then
  inner='scripts/setup.sh && scripts/build.sh dev && ctest --preset dev -LE packages "$@"'
elif [ $tier = release-check ]; then
  inner='scripts/setup.sh && scripts/build.sh release-check accelerate_cli char_gpt'
elif [ $tier = main-job ]; then
  inner='scripts/run_main_job.sh "$@"'
elif [ $tier = bench ]; then
  inner="bench/run_$runner \"\$@\""
else
  inner='scripts/test.sh "$@"'
fi
chroot "$root" /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" LANG=C.UTF-8 \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  CCACHE_DIR=/var/cache/ccache ACCELERATE_TORCH_PACKAGE=$torch_pkg \
  /bin/bash -c "set -euo pipefail; cd /work/accelerate; $inner" test_debian "${ctest_args[@]}"
