"""Frozen reports the engine hands out: about the model, an adapter, and the engine's counters."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    model: str  # the checkpoint directory served
    architecture: str
    dtype: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    max_lora_rank: int
    num_pages: int
    page_size: int  # tokens of KV per page


@dataclass(frozen=True)
class AdapterInfo:
    """What validating an adapter found; `content_hash` is its identity in the pool."""

    rank: int
    target_modules: tuple[str, ...]
    num_layers: int  # layers the adapter changes
    scale: float
    nbytes: int  # host memory, in the serving dtype
    num_pages: int  # pool pages it occupies when resident
    content_hash: str


@dataclass(frozen=True)
class EngineStats:
    """Counters since start (`num_*`, `*_seconds`) and gauges at the last step."""

    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_steps: int = 0
    step_seconds: float = 0.0  # summed over all steps
    last_step_seconds: float = 0.0
    last_batch_size: int = 0  # sequences in the last step
    last_batch_tokens: int = 0
    num_computed_tokens: int = 0  # run through the model: prompts, recomputes, decodes
    num_prefix_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_failed_requests: int = 0  # non-finite output
    num_adapter_loads: int = 0  # into the pool
    num_adapter_evictions: int = 0
    adapter_load_seconds: float = 0.0
    num_adapter_disk_reads: int = 0
    adapter_disk_read_seconds: float = 0.0
    num_pages: int = 0
    free_pages: int = 0
    kv_pages: int = 0  # held by requests
    cached_pages: int = 0  # KV kept for later prefixes (prefix caching), given back on demand
    adapter_pages: int = 0
    num_resident_adapters: int = 0
