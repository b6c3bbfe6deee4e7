"""Typed configuration: the model's shape (read from a checkpoint) and the engine's knobs."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.engine.device import choose_dtype

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint is of an architecture or configuration loraplex does not run."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, independent of where its weights live."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} is not a checkpoint directory: no config.json")
        hf = json.loads(path.read_text())
        generation = Path(model_dir) / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id", hf.get("eos_token_id"))
        else:
            eos = hf.get("eos_token_id")
        return cls.from_hf_dict(hf, eos)

    @classmethod
    def from_hf_dict(cls, hf: dict, eos: int | list[int] | None = None) -> ModelConfig:
        architecture = _check_architecture(hf)
        num_heads = hf["num_attention_heads"]
        hidden_size = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden_size // num_heads
        max_positions = hf.get("max_position_embeddings", 4096)
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        if window and window < max_positions:
            # Sliding-window attention only differs from full attention past the window, so
            # capping the context at the window keeps every answer exact.
            max_positions = window
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden_size,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=max_positions,
            rope=_rope_config(hf),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=architecture == "Qwen2ForCausalLM" or hf.get("attention_bias", False),
            eos_token_ids=_as_tuple(eos if eos is not None else hf.get("eos_token_id")),
            bos_token_id=hf.get("bos_token_id"),
        )


def _check_architecture(hf: dict) -> str:
    architectures = hf.get("architectures") or [f"<model_type {hf.get('model_type')!r}>"]
    architecture = architectures[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {architecture} is not supported; "
            f"loraplex runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
    if hf.get("mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    return architecture


def _rope_config(hf: dict) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints use rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        ),
    )


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}


def parse_size(value: int | str) -> int:
    """`"2GiB"` -> 2147483648; ints pass through."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"memory size {value!r} is not of the form '2GiB', '512MiB' or bytes")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start; validated on construction.

    `model` is a checkpoint directory or "default" (SmolLM2-135M-Instruct, prepared on first use).
    The page pool is sized from `memory_budget` unless `num_pages` is given.
    """

    model: str = "default"
    # "auto": bfloat16 where the device computes it natively, else float32 (float16 on a CUDA
    # GPU without bfloat16); resolved on construction, so `dtype` is always concrete after it
    dtype: str = "auto"
    device: str = "cpu"
    memory_budget: int | str = "2GiB"
    num_pages: int | None = None
    page_size: int = 16  # tokens of KV per page
    max_num_batched_tokens: int = 256  # per-step token budget (also the prefill chunk)
    max_num_seqs: int = 64
    max_model_len: int | None = None  # defaults to the model's context
    num_threads: int | None = None  # torch intra-op threads on CPU; None = all cores
    seed: int = 0
    max_lora_rank: int = 128
    adapter_roots: tuple[str, ...] | None = None  # None: any directory (offline use)
    adapter_host_cache: int | str = "1GiB"  # validated adapters kept in host memory
    lora_backend: str | None = None  # None: decided by the device (see engine/device.py)
    # keep full KV pages for reuse by later requests with the same prefix and adapter
    enable_prefix_caching: bool = True
    # AsyncEngine: requests accepted but not yet started beyond this are refused at once with
    # OverloadedError (None: no bound; the offline LLM never bounds)
    max_waiting_requests: int | None = None
    # who goes first (engine/fairness.py): "fair" shares between fairness keys with tiers,
    # "fcfs" first come, first served
    scheduling_policy: str = "fair"

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        object.__setattr__(self, "dtype", choose_dtype(self.dtype, self.device))
        for name in ("page_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if parse_size(self.memory_budget) < 1:
            raise ValueError(f"memory_budget must be positive, got {self.memory_budget!r}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(
                f"max_waiting_requests must be >= 1 or None, got {self.max_waiting_requests}"
            )
        if self.scheduling_policy not in ("fair", "fcfs"):
            raise ValueError(
                f"scheduling_policy must be fair or fcfs, got {self.scheduling_policy!r}"
            )
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if isinstance(self.adapter_roots, list):
            object.__setattr__(self, "adapter_roots", tuple(self.adapter_roots))

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def memory_budget_bytes(self) -> int:
        return parse_size(self.memory_budget)
