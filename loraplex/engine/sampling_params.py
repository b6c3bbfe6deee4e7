"""Sampling parameters, in the shape vLLM users know, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_N = 64


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. `logprobs=None` returns no log-probabilities; `logprobs=k` returns
    the sampled token's and the k most likely alternatives' (k may be 0). `max_tokens=None` runs
    to the end of the model's context.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_int("n", self.n, 1, MAX_N)
        _check_range("temperature", self.temperature, 0.0, None, "[0, inf)")
        _check_range("top_p", self.top_p, 0.0, 1.0, "(0, 1]", low_open=True)
        if self.top_k is not None:
            _check_int("top_k", self.top_k, 1, None)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "[-2, 2]")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "[-2, 2]")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        self._check_stops()

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop allows at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _check_range(
    name: str, value: float, low: float, high: float | None, shown: str, low_open: bool = False
) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (high is None or value <= high)
    if not ok:
        raise ValueError(f"{name} must be in {shown}, got {value!r}")


def _check_int(name: str, value: int, low: int, high: int | None) -> None:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
