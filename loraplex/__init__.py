"""loraplex: multi-tenant LoRA adapter serving."""

from loraplex.engine.engine import LoRARequest
from loraplex.engine.llm import LLM
from loraplex.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]
