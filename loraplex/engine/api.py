"""The engine's public API: the only module the platform imports from `loraplex.engine`.

The engine sees prompts, sampling parameters, request ids, adapter ids with their paths and an
opaque per-request tag; it knows nothing of tenants or keys. Every exception it raises is an
`EngineError` with a machine-readable `code` (`ErrorCode`), so a server maps it to a status
without reading message text; `AsyncEngine`'s docstring lists which call raises which.
"""

from loraplex.engine.adapters.manager import PoolSnapshot, ResidentInfo
from loraplex.engine.async_engine import AsyncEngine
from loraplex.engine.config import EngineConfig, UnsupportedModelError
from loraplex.engine.engine import LoRARequest
from loraplex.engine.errors import (
    AdapterError,
    EngineDeadError,
    EngineError,
    EngineShutdownError,
    ErrorCode,
    InvalidRequestError,
    OverloadedError,
    RequestFailedError,
)
from loraplex.engine.fairness import Fairness, Tier
from loraplex.engine.front import Front, FrontMethods
from loraplex.engine.info import AdapterInfo, EngineStats, ModelInfo
from loraplex.engine.outputs import RequestDelta, SequenceDelta
from loraplex.engine.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams
from loraplex.engine.sequence import TokenLogprob
from loraplex.engine.structured import StructuredOutput

__all__ = [
    "MAX_LOGPROBS",
    "MAX_N",
    "AdapterError",
    "AdapterInfo",
    "AsyncEngine",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineShutdownError",
    "EngineStats",
    "ErrorCode",
    "Fairness",
    "Front",
    "FrontMethods",
    "InvalidRequestError",
    "LoRARequest",
    "ModelInfo",
    "OverloadedError",
    "PoolSnapshot",
    "RequestDelta",
    "RequestFailedError",
    "ResidentInfo",
    "SamplingParams",
    "SequenceDelta",
    "StructuredOutput",
    "Tier",
    "TokenLogprob",
    "UnsupportedModelError",
]
