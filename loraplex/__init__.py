"""loraplex: multi-tenant LoRA adapter serving.

`from loraplex import LLM, SamplingParams, LoRARequest` loads the engine (and torch) on first
use only, so that light commands (`loraplex admin ...`) start fast.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "loraplex.engine.llm",
    "LoRARequest": "loraplex.engine.engine",
    "SamplingParams": "loraplex.engine.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'loraplex' has no attribute {name!r}")
