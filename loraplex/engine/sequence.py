"""A sequence is one completion being generated; a request with n > 1 has n of them."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from loraplex.engine.adapters.catalog import AdapterRef
from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.fairness import DEFAULT_FAIRNESS, Fairness
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.structured import Matcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens, best first


@dataclass(eq=False)
class Sequence:
    """Token ids (prompt then output) and how far the model has computed them.

    `num_computed_tokens` counts tokens whose KV is in the cache. When it reaches `num_tokens` the
    last forward pass produced logits for a new token. Preemption resets it to 0: the prompt and
    the output so far are recomputed, nothing is sampled twice.
    """

    request_id: str
    index: int
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    adapter: AdapterRef | None = None
    matcher: Matcher | None = None  # where its output stands in its constraint's grammar
    holds_adapter: bool = False  # counted as a user of its resident adapter (while running)
    num_bypassed: int = 0  # steps in which later requests were admitted ahead of this one
    fairness: Fairness = DEFAULT_FAIRNESS  # whom it is served for, at which tier
    num_charged_tokens: int = 0  # tokens computed and counted to its fairness key
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full pages
    finish_reason: str | None = None
    first_token_time: float | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # with params.prompt_logprobs, on the first sequence of a request: entry i is for prompt
    # token i + 1 given the tokens before it (computed once, even if the prompt is recomputed)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    num_emitted_tokens: int = 0  # output tokens already handed to the caller

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
