"""Fixtures for the platform: adapters for the tiny model under one allowed root, and a server
shared by the tests of a module (each test makes its own tenants, so they do not interfere)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.factories import build_adapter, poison_adapter
from tests.platform.servers import start_server

DEMO_ADAPTERS = Path(__file__).resolve().parents[2] / "demo" / "adapters"


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory, tiny_llama):
    """Adapters the servers may register (LORAPLEX_ADAPTER_ROOTS), and some they must refuse."""
    root = tmp_path_factory.mktemp("served-adapters")
    build_adapter(tiny_llama, root / "alpha", rank=4, seed=11)
    build_adapter(
        tiny_llama, root / "beta", rank=8, targets=("q_proj", "k_proj", "o_proj"), seed=12
    )
    build_adapter(tiny_llama, root / "gamma", rank=6, targets=("gate_proj", "down_proj"), seed=13)
    k_only = build_adapter(tiny_llama, root / "k-only", rank=4, targets=("k_proj",), seed=14)
    poison_adapter(k_only, root / "poison")
    shutil.copytree(root / "alpha", root / "pickled")
    (root / "pickled" / "adapter_model.safetensors").rename(root / "pickled" / "adapter_model.bin")
    shutil.copytree(root / "alpha", root / "corrupt")
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"\x07garbage" * 100)
    shutil.copytree(DEMO_ADAPTERS / "ahoy", root / "wrong-base")  # made for SmolLM2
    return root


@pytest.fixture(scope="session")
def outside_adapter(tmp_path_factory, tiny_llama):
    return build_adapter(tiny_llama, tmp_path_factory.mktemp("outside") / "a", rank=4, seed=15)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama, adapter_root):
    server = start_server(
        tiny_llama,
        tmp_path_factory.mktemp("server-data"),
        adapter_roots=adapter_root,
        served_model_name="llama",
    )
    yield server
    server.stop()
