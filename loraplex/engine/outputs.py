"""What the engine hands back: per-step deltas while streaming, whole results when done."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from loraplex.engine.errors import EngineError
from loraplex.engine.sequence import Sequence, Status, TokenLogprob


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    num_pages_needed: int  # by one of its sequences at its longest, its adapter included
    tag: object = None  # the caller's, handed back with every delta
    arrival_time: float = field(default_factory=time.monotonic)
    error: EngineError | None = None  # why it failed, if it did
    prompt_logprobs_sent: bool = False

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


@dataclass(frozen=True)
class SequenceDelta:
    """What one completion gained in one step. `text` may be empty while a possible stop string
    or an unfinished UTF-8 character is held back."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running


@dataclass(frozen=True)
class RequestDelta:
    request_id: str
    outputs: list[SequenceDelta]
    finished: bool
    num_prompt_tokens: int
    arrival_time: float
    first_token_time: float | None
    tag: object = None
    error: EngineError | None = None  # set on the last delta of a request that failed
    # with SamplingParams.prompt_logprobs, once, on the first delta after the prompt is
    # computed: one entry per prompt token, None for the first (nothing comes before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    """A whole request's result, built by adding up its deltas (`add`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    arrival_time: float = 0.0
    first_token_time: float | None = None
    error: EngineError | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, delta: RequestDelta) -> None:
        for part in delta.outputs:
            out = self.outputs[part.index]
            out.text += part.text
            out.token_ids.extend(part.token_ids)
            if part.logprobs is not None:
                out.logprobs = (out.logprobs or []) + part.logprobs
            out.finish_reason = part.finish_reason or out.finish_reason
        self.first_token_time = delta.first_token_time
        self.finished = delta.finished
        self.error = delta.error or self.error
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs


def merge_deltas(earlier: RequestDelta, later: RequestDelta) -> RequestDelta:
    """One delta saying what two consecutive deltas of a request say."""
    by_index = {out.index: out for out in earlier.outputs}
    for out in later.outputs:
        before = by_index.get(out.index)
        if before is None:
            by_index[out.index] = out
            continue
        logprobs = None
        if before.logprobs is not None or out.logprobs is not None:
            logprobs = [*(before.logprobs or []), *(out.logprobs or [])]
        by_index[out.index] = SequenceDelta(
            out.index,
            before.text + out.text,
            before.token_ids + out.token_ids,
            logprobs,
            out.finish_reason or before.finish_reason,
        )
    return replace(
        later,
        outputs=list(by_index.values()),
        first_token_time=earlier.first_token_time or later.first_token_time,
        prompt_logprobs=earlier.prompt_logprobs or later.prompt_logprobs,
    )


def take_delta(request: Request, touched: list[Sequence]) -> RequestDelta:
    """The delta of `request` for the sequences that changed this step; marks it handed out."""
    outputs = [_take_sequence_delta(seq) for seq in touched]
    first_times = [s.first_token_time for s in request.seqs if s.first_token_time is not None]
    return RequestDelta(
        request_id=request.request_id,
        outputs=outputs,
        finished=request.is_finished,
        num_prompt_tokens=len(request.prompt_token_ids),
        arrival_time=request.arrival_time,
        first_token_time=min(first_times, default=None),
        tag=request.tag,
        error=request.error,
        prompt_logprobs=_take_prompt_logprobs(request),
    )


def _take_prompt_logprobs(request: Request) -> list[TokenLogprob | None] | None:
    first = request.seqs[0]
    if request.prompt_logprobs_sent or first.params.prompt_logprobs is None:
        return None
    if len(first.prompt_logprobs) < first.num_prompt_tokens - 1:
        return None  # the prompt is still being computed
    request.prompt_logprobs_sent = True
    return [None, *first.prompt_logprobs]


def _take_sequence_delta(seq: Sequence) -> SequenceDelta:
    new_tokens = seq.output_token_ids[seq.num_emitted_tokens :]
    logprobs = None
    if seq.params.logprobs is not None:
        logprobs = seq.logprobs[seq.num_emitted_tokens :]
    seq.num_emitted_tokens += len(new_tokens)
    return SequenceDelta(
        index=seq.index,
        text=seq.detokenizer.take_new_text(final=seq.status is Status.FINISHED),
        token_ids=new_tokens,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
    )
