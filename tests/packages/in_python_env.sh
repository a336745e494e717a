#!/bin/sh
# Runs a Python script in the tests' environment of packages: in_python_env.sh <env> <script> [args...]
env_dir=$1
shift
if [ ! -f "$env_dir/.complete" ]; then
  echo "the tests' Python environment $env_dir is missing: run scripts/python_env.sh (scripts/test.sh does)" >&2
  exit 1
fi
exec "$env_dir/bin/python" "$@"
