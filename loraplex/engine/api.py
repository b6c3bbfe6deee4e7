"""The engine's public API: the only module the platform imports from `loraplex.engine`.

The engine sees prompts, sampling parameters and request ids; it knows nothing of tenants or keys.
"""

from loraplex.engine.async_engine import AsyncEngine, EngineDeadError
from loraplex.engine.config import EngineConfig, UnsupportedModelError
from loraplex.engine.outputs import RequestDelta, SequenceDelta
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import TokenLogprob

__all__ = [
    "AsyncEngine",
    "EngineConfig",
    "EngineDeadError",
    "RequestDelta",
    "SamplingParams",
    "SequenceDelta",
    "TokenLogprob",
    "UnsupportedModelError",
]
