#!/usr/bin/env bash
# Set up and run the whole test suite (arguments go to pytest, e.g. -m "not smollm2").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh ray  # the Ray Serve tests run too
scripts/chromium.sh
. .venv/bin/activate
exec python -m pytest "$@"
