#!/usr/bin/env bash
# Makes, once, the virtual environment of the Python packages some tests read the project's
# output with (tests/python/requirements.txt: wandb, mlflow; or the requirements file given, e.g.
# tests/python/requirements-wandb.txt), outside the checkout:
# ${ACCELERATE_PYTHON_ENV_ROOT:-${XDG_CACHE_HOME:-~/.cache}/accelerate-cpp}/python-<hash of that file>,
# from Debian's python3 (python3-venv, which scripts/setup.sh installs) and the Python package
# index. Prints the environment's folder. A change of the requirements makes a new one; an
# environment whose installation did not finish is made again.
set -euo pipefail
cd "$(dirname "$0")/.."
requirements=${1:-tests/python/requirements.txt}
hash=$(sha256sum "$requirements" | cut -c1-12)
root=${ACCELERATE_PYTHON_ENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/accelerate-cpp}
env_dir="$root/python-$hash"
if [ ! -f "$env_dir/.complete" ]; then
  rm -rf "$env_dir"
  mkdir -p "$root"
  echo "python_env.sh: installing $(grep -c '^[a-z]' "$requirements") packages into $env_dir" >&2
  /usr/bin/python3 -m venv "$env_dir"
  "$env_dir/bin/pip" install --disable-pip-version-check --no-input -q -r "$requirements" 2>&1 |
    grep -v "^WARNING: Location" >&2 || true
  "$env_dir/bin/pip" check >/dev/null ||
    { echo "python_env.sh: the packages of $requirements did not install into $env_dir" >&2; exit 1; }
  touch "$env_dir/.complete"
fi
echo "$env_dir"
