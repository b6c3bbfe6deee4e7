#!/usr/bin/env bash
# Set up, prepare the default model (SmolLM2-135M-Instruct) on first use, and answer a prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
loraplex model prepare >/dev/null
exec loraplex generate "${1:-What is the capital of France?}" "${@:2}"
