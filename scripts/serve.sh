#!/usr/bin/env bash
# Set up, prepare the default model (SmolLM2-135M-Instruct) on first use, and serve the platform
# on the embedded defaults: SQLite in the data dir, a demo tenant with the two demo adapters.
# Prints the URL, where the admin token is, and a demo API key. Arguments go to `loraplex serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
loraplex model prepare >/dev/null
exec loraplex serve --demo "$@"
