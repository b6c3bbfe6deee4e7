"""Running a completion on the engine and shaping what comes back: whole JSON replies, or SSE
chunks ending with `data: [DONE]`, for the chat and the legacy endpoint.

A call may hold several engine requests (the legacy endpoint takes a list of prompts); each is
primed (its first delta awaited) before the HTTP reply starts, so that an error the engine raises
up front (bad input, overload) is a proper status, not an event in a stream already begun.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from loraplex.engine.api import (
    AsyncEngine,
    EngineError,
    LoRARequest,
    RequestDelta,
    SamplingParams,
    TokenLogprob,
)
from loraplex.platform import openai_schema as oa
from loraplex.platform.calls import Call
from loraplex.platform.errors import APIError, from_engine

DONE = "data: [DONE]\n\n"


@dataclass
class Primed:
    """An engine request whose first delta has arrived."""

    index: int  # which prompt of the call
    first: RequestDelta
    rest: AsyncIterator[RequestDelta]


async def start(
    engine: AsyncEngine,
    call: Call,
    prompts: list[list[int]],
    params: SamplingParams,
    lora: LoRARequest | None,
    stream: bool = True,
) -> list[Primed]:
    """Submit every prompt and wait for each one's first delta; raises APIError. Unless
    `stream`, the rest of each request's output comes in one piece at its end."""
    streams = [
        engine.generate(
            ids,
            params,
            f"{call.id}-{i}",
            lora,
            tag=call.caller.tenant_id,
            fairness=call.fairness,
            stream=stream,
        )
        for i, ids in enumerate(prompts)
    ]
    call.prompt_tokens = sum(len(ids) for ids in prompts)  # once per prompt, whatever n
    try:
        if len(streams) == 1:
            firsts = [await anext(streams[0])]
        else:
            firsts = await asyncio.gather(*(anext(s) for s in streams))
    except BaseException as error:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        if isinstance(error, EngineError):
            raise from_engine(error) from None
        raise
    finally:
        call.started()
    return [Primed(i, first, s) for i, (first, s) in enumerate(zip(firsts, streams, strict=True))]


async def deltas(call: Call, primed: list[Primed]) -> AsyncIterator[tuple[int, RequestDelta]]:
    """(prompt index, delta) from every request, as they come, counted into the call; closing
    this closes them all (which aborts what is still running). Raises APIError for an engine
    error mid-way."""
    done = False
    try:
        if len(primed) == 1:
            only = primed[0]
            call.output(only.first)
            yield only.index, only.first
            if not only.first.finished:
                async for delta in only.rest:
                    call.output(delta)
                    yield only.index, delta
        else:
            async for index, delta in _merged(primed):
                call.output(delta)
                yield index, delta
        done = True
    except EngineError as error:
        raise from_engine(error) from None
    finally:
        if not done:  # left early: close what still runs (which aborts it)
            await asyncio.gather(*(p.rest.aclose() for p in primed), return_exceptions=True)


async def _merged(primed: list[Primed]) -> AsyncIterator[tuple[int, RequestDelta]]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(p: Primed) -> None:
        try:
            await queue.put((p.index, p.first))
            async for delta in p.rest:
                await queue.put((p.index, delta))
            await queue.put((p.index, None))
        except Exception as error:
            await queue.put((p.index, error))

    tasks = [asyncio.create_task(pump(p)) for p in primed]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# -- accumulating ----------------------------------------------------------------------------


@dataclass
class ChoiceState:
    text: str = ""
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


def choice_index(prompt_index: int, sequence_index: int, n: int) -> int:
    return prompt_index * n + sequence_index


def finish_reason(engine_reason: str | None) -> str | None:
    return engine_reason if engine_reason in ("stop", "length") else None


async def collect(call: Call, primed: list[Primed], n: int) -> dict[int, ChoiceState]:
    choices: dict[int, ChoiceState] = {}
    async for prompt_index, delta in deltas(call, primed):
        for out in delta.outputs:
            state = choices.setdefault(choice_index(prompt_index, out.index, n), ChoiceState())
            state.text += out.text
            state.num_tokens += len(out.token_ids)
            state.logprobs += out.logprobs or []
            state.finish_reason = finish_reason(out.finish_reason) or state.finish_reason
    return dict(sorted(choices.items()))


def usage(call: Call) -> oa.Usage:
    return oa.Usage(
        prompt_tokens=call.prompt_tokens,
        completion_tokens=call.completion_tokens,
        total_tokens=call.prompt_tokens + call.completion_tokens,
    )


# -- logprobs --------------------------------------------------------------------------------


def _token(engine: AsyncEngine, token_id: int) -> tuple[str, list[int]]:
    raw = engine.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(engine: AsyncEngine, entries: list[TokenLogprob]) -> oa.ChoiceLogprobs:
    content = []
    for entry in entries:
        text, raw = _token(engine, entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            top_text, top_raw = _token(engine, token_id)
            top.append(oa.TopLogprob(token=top_text, logprob=logprob, bytes=top_raw))
        content.append(
            oa.TokenLogprob(token=text, logprob=entry.logprob, bytes=raw, top_logprobs=top)
        )
    return oa.ChoiceLogprobs(content=content)


def legacy_logprobs(
    engine: AsyncEngine, entries: list[TokenLogprob], offset: int
) -> oa.LegacyLogprobs:
    tokens, offsets, top = [], [], []
    for entry in entries:
        text, _ = _token(engine, entry.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        top.append({_token(engine, t)[0]: lp for t, lp in entry.top} if entry.top else None)
    return oa.LegacyLogprobs(
        tokens=tokens,
        token_logprobs=[e.logprob for e in entries],
        top_logprobs=top,
        text_offset=offsets,
    )


# -- SSE -------------------------------------------------------------------------------------


# JSON leaves these unescaped in strings, but str.splitlines() breaks lines at them, and so does
# httpx's `aiter_lines()`, a common way to read a stream: a chunk whose text held one would reach
# such a client cut in two. Escaped, the JSON means the same.
_RAW_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(model) -> str:
    return f"data: {model.model_dump_json().translate(_RAW_LINE_BREAKS)}\n\n"


def sse_error(error: APIError) -> str:
    return f"data: {json.dumps(error.body())}\n\n"
