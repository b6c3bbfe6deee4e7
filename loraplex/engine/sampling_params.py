"""Sampling parameters, in the shape vLLM users know, validated on construction.

Every value is checked for its type as well as its range, so that anything a client can send
either builds a SamplingParams or raises InvalidRequestError (a ValueError) naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loraplex.engine.errors import InvalidRequestError, shown
from loraplex.engine.structured import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 1000  # characters per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_N = 64
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's own bound
# Below this, dividing logits by the temperature overflows float32 into inf (and sampling into
# NaN); any temperature this small picks the best token anyway, so it is greedy. vLLM uses the
# same threshold.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 (or below 1e-5) means greedy. `logprobs=None` returns no log-probabilities;
    `logprobs=k` returns the sampled token's and the k most likely alternatives' (k may be 0).
    `max_tokens=None` runs to the end of the model's context. `logit_bias` maps token ids to a
    value in [-100, 100] added to their logits before sampling (OpenAI's semantics).
    `structured_outputs` constrains the output (a JSON schema, any JSON object, a regex, a choice,
    a grammar); the request ends with "stop" when the constraint is complete, or "length" first.
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
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutput | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        _check_number("temperature", self.temperature, 0.0, None, "[0, inf)")
        _check_number("top_p", self.top_p, 0.0, 1.0, "(0, 1]", low_open=True)
        if self.top_k is not None:
            _check_int("top_k", self.top_k, 1, None)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "[-2, 2]")
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0, "[-2, 2]")
        if self.seed is not None:
            _check_int("seed", self.seed, None, None)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, None)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _invalid(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        self.stop = _stop_strings(self.stop)
        self.stop_token_ids = _token_id_list("stop_token_ids", self.stop_token_ids)
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutput
        ):
            raise _invalid(
                "structured_outputs",
                "structured_outputs must be a StructuredOutput, got "
                f"{shown(self.structured_outputs)}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _invalid(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _check_number(
    name: str, value: object, low: float, high: float | None, bounds: str, low_open: bool = False
) -> None:
    ok = _is_number(value) and _is_finite(value)
    ok = ok and (value > low if low_open else value >= low) and (high is None or value <= high)
    if not ok:
        raise _invalid(name, f"{name} must be a number in {bounds}, got {shown(value)}")


def _check_int(name: str, value: object, low: int | None, high: int | None) -> None:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or (low is not None and value < low) or (high is not None and value > high):
        if low is None:
            allowed = ""
        elif high is None:
            allowed = f" >= {low}"
        else:
            allowed = f" in [{low}, {high}]"
        raise _invalid(name, f"{name} must be an integer{allowed}, got {shown(value)}")


def _stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise _invalid(
            "stop", f"stop must be a non-empty string or a list of them, got {shown(stop)}"
        )
    if len(stop) > MAX_STOP_STRINGS:
        raise _invalid("stop", f"stop allows at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    if any(len(s) > MAX_STOP_LENGTH for s in stop):
        raise _invalid("stop", f"stop strings are at most {MAX_STOP_LENGTH} characters long")
    return list(stop)


def _token_id_list(name: str, ids: object) -> list[int]:
    if ids is None:
        return []
    ok = isinstance(ids, list | tuple) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
    )
    if not ok:
        raise _invalid(
            name, f"{name} must be a list of token ids (integers >= 0), got {shown(ids)}"
        )
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise _invalid(name, f"{name} allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    return list(ids)


def _logit_bias(bias: object) -> dict[int, float] | None:
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise _invalid("logit_bias", f"logit_bias must map token ids to numbers, got {shown(bias)}")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise _invalid(
            "logit_bias",
            f"logit_bias allows at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}",
        )
    checked: dict[int, float] = {}
    for token, value in bias.items():
        # JSON object keys are strings: "123" is token 123, as in OpenAI's API
        numeric = isinstance(token, str) and token.isascii() and token.isdigit() and len(token) < 12
        token_id = int(token) if numeric else token
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise _invalid("logit_bias", f"logit_bias keys must be token ids, got {shown(token)}")
        if not _is_number(value) or not -100 <= value <= 100:
            raise _invalid(
                "logit_bias", f"logit_bias values must be in [-100, 100], got {shown(value)}"
            )
        checked[token_id] = float(value)
    return checked
