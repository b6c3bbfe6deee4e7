"""The engine's public API: the only module the platform imports from `loraplex.engine`.

The engine sees prompts, sampling parameters, request ids and adapter ids with their paths; it
knows nothing of tenants or keys.
"""

from loraplex.engine.adapters.manager import PoolSnapshot
from loraplex.engine.adapters.peft_format import AdapterError
from loraplex.engine.async_engine import AsyncEngine, EngineDeadError
from loraplex.engine.config import EngineConfig, UnsupportedModelError
from loraplex.engine.engine import LoRARequest
from loraplex.engine.outputs import RequestDelta, SequenceDelta
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import TokenLogprob

__all__ = [
    "AdapterError",
    "AsyncEngine",
    "EngineConfig",
    "EngineDeadError",
    "LoRARequest",
    "PoolSnapshot",
    "RequestDelta",
    "SamplingParams",
    "SequenceDelta",
    "TokenLogprob",
    "UnsupportedModelError",
]
