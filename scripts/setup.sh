#!/usr/bin/env bash
# Create .venv and install loraplex with its test tools, and the extras named in $1 (comma
# separated, e.g. "ray"). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The CPU build first: left to itself, pip would resolve `torch` to a CUDA build of several GB.
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test${1:+,$1}]"
