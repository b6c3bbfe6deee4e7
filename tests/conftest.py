"""Shared fixtures: tiny random models built on the spot, the real SmolLM2, a report of figures.

Tiny models are saved as ordinary Hugging Face checkpoint directories (safetensors + tokenizer),
so the engine loads them through the same code path as any real checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Without a GPU, Triton kernels run in Triton's interpreter. This must be set before anything
# imports triton (transformers may), hence here, first; importing torch does not import triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from loraplex.engine.adapters.peft_format import MODULES
from tests.factories import build_adapter, build_tiny_model, build_tiny_tokenizer

torch.set_num_threads(os.cpu_count() or 1)

_REPORT: list[str] = []


@pytest.fixture(scope="session")
def report():
    """Append a line to the summary printed at the end of the run (near-ties, figures)."""
    return _REPORT.append


def pytest_terminal_summary(terminalreporter):
    if _REPORT:
        terminalreporter.section("loraplex figures")
        for line in _REPORT:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tiny_tokenizer_dir, tiny_llama) -> dict[str, Path]:
    dirs = {"llama": tiny_llama}
    for family in ("llama3", "qwen2", "mistral"):
        dirs[family] = build_tiny_model(
            tmp_path_factory.mktemp(f"tiny-{family}"), family, tiny_tokenizer_dir
        )
    return dirs


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from loraplex.engine.default_model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tiny_adapters(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    """PEFT-made adapters on the tiny Llama: ranks 1..128, different module sets, alpha, rsLoRA."""
    root = tmp_path_factory.mktemp("tiny-adapters")
    specs = {
        "qv-r4": dict(rank=4, targets=("q_proj", "v_proj")),
        "attn-r8": dict(rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"), alpha=4.0),
        "mlp-r16": dict(rank=16, targets=("gate_proj", "up_proj", "down_proj")),
        "all-r2": dict(rank=2, targets=MODULES, rslora=True),
        "qkv-r8": dict(rank=8, targets=("q_proj", "k_proj", "v_proj")),
        "o-down-r12": dict(rank=12, targets=("o_proj", "down_proj"), rslora=True),
        "q-r1": dict(rank=1, targets=("q_proj",)),
        "layer1-r6": dict(rank=6, targets=("v_proj", "gate_proj"), layers=[1]),
        # rank 128: its matrices are larger than one of the tiny model's pages, so they are
        # split across pages
        "kv-r128": dict(rank=128, targets=("k_proj", "v_proj", "up_proj"), std=0.02),
    }
    return {
        name: build_adapter(tiny_llama, root / name, seed=i, **spec)
        for i, (name, spec) in enumerate(specs.items())
    }
