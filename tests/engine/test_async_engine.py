"""The async engine: concurrent streams, disconnects, bad input, all on the step thread."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from loraplex.engine import async_engine
from loraplex.engine.api import (
    AdapterError,
    AsyncEngine,
    EngineConfig,
    Fairness,
    LoRARequest,
    SamplingParams,
    Tier,
)
from tests.factories import make_llm

PROMPTS = ["the river", "a cat sleeps", "old city light", "the king tells of a story"]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = AsyncEngine(
        EngineConfig(model=str(tiny_llama), memory_budget="64MiB", dtype="float32")
    )
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params, request_id=None, lora=None):
    text, tokens, deltas = "", [], 0
    async for delta in engine.generate(prompt, params, request_id, lora):
        text += delta.outputs[0].text
        tokens += delta.outputs[0].token_ids
        deltas += 1
        last = delta
    return text, tokens, deltas, last


def test_concurrent_streams_match_the_offline_engine(engine, tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(engine, p, params) for p in PROMPTS))

    streamed = asyncio.run(main())
    offline = make_llm(tiny_llama).generate(PROMPTS, params)
    for (text, tokens, deltas, last), result in zip(streamed, offline, strict=True):
        assert tokens == result.outputs[0].token_ids
        assert text == result.outputs[0].text
        assert deltas == 20  # one delta per generated token
        assert last.finished and last.outputs[0].finish_reason == "length"


def test_a_request_not_streamed_comes_in_two_deltas_that_add_up_to_the_stream(engine):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2, n=2)

    async def main():
        streamed, whole = [], []
        async for delta in engine.generate("the river", params):
            streamed.append(delta)
        async for delta in engine.generate("the river", params, stream=False):
            whole.append(delta)
        return streamed, whole

    streamed, whole = asyncio.run(main())
    assert len(streamed) >= 30 and len(whole) == 2  # the first token, then the rest at the end
    assert whole[-1].finished and whole[0].first_token_time == whole[-1].first_token_time
    for index in (0, 1):
        for field in ("token_ids", "logprobs", "text"):
            got = [getattr(o, field) for d in whole for o in d.outputs if o.index == index]
            want = [getattr(o, field) for d in streamed for o in d.outputs if o.index == index]
            assert list(itertools.chain(*got)) == list(itertools.chain(*want))


def test_leaving_the_stream_aborts_the_request_and_frees_its_pages(engine):
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def disconnect_early():
        async for _ in engine.generate("the river", params, "leaver"):
            break  # the client went away

    asyncio.run(disconnect_early())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = engine.stats()
        if (
            stats.num_running_requests == 0
            and stats.free_pages + stats.cached_pages == stats.num_pages
        ):
            break
        time.sleep(0.01)
    assert stats.num_running_requests == stats.num_waiting_requests == 0
    assert stats.free_pages + stats.cached_pages == stats.num_pages


def test_bad_input_raises_before_anything_runs_and_serving_continues(engine):
    async def main():
        with pytest.raises(ValueError, match="max_tokens must be in"):
            await collect(engine, "the river", SamplingParams(max_tokens=10**6))
        return await collect(engine, "the river", SamplingParams(max_tokens=3, ignore_eos=True))

    _, tokens, _, last = asyncio.run(main())
    assert len(tokens) == 3 and last.finished


def test_duplicate_request_id_is_refused(engine):
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def main():
        first = engine.generate("the river", params, "same-id")
        tokens = (await anext(first)).outputs[0].token_ids  # now surely in flight
        with pytest.raises(ValueError, match="already in flight"):
            await collect(engine, "a cat", params, "same-id")
        async for delta in first:
            tokens += delta.outputs[0].token_ids
        return tokens

    assert len(asyncio.run(main())) == 50


def test_adapters_through_the_async_api(engine, tiny_adapters, tiny_llama):
    lora = LoRARequest("async-a", str(tiny_adapters["attn-r8"]))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def main():
        await engine.load_adapter(lora, pin=True)
        pinned = await engine.pool_snapshot()
        _, tokens, _, _ = await collect(engine, "the river", params, lora=lora)
        with pytest.raises(AdapterError, match="not a directory"):
            await engine.load_adapter(LoRARequest("nowhere", "/nonexistent/adapter"))
        await engine.unpin_adapter("async-a")
        await engine.unload_adapter("async-a")
        return pinned, tokens, await engine.pool_snapshot()

    pinned, tokens, after = asyncio.run(main())
    assert [r.adapter_ids for r in pinned.resident] == [("async-a",)]
    assert pinned.resident[0].pinned
    offline = make_llm(tiny_llama).generate(["the river"], params, adapters=[lora])
    assert tokens == offline[0].outputs[0].token_ids
    assert after.resident == () and after.free_pages + after.cached_pages == after.num_pages


def test_an_interactive_arrival_holds_background_work_for_a_moment_only(engine, monkeypatch):
    """While an interactive request is prepared, batch-tier steps wait; released, or past the
    hold's cap (a caller that never gets there), they go on. The cap is lengthened here, so
    that a slow machine's pauses fall inside it."""
    monkeypatch.setattr(async_engine, "HOLD_SECONDS", 3.0)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    background = Fairness("bulk", 1.0, Tier.BATCH)

    async def main():
        produced = [0]

        async def drain():  # one background request after another
            while True:
                async for delta in engine.generate("the river", params, fairness=background):
                    produced[0] += len(delta.outputs[0].token_ids)

        async def progress_after(seconds: float) -> int:
            before = produced[0]
            await asyncio.sleep(seconds)
            return produced[0] - before

        async def quiet() -> None:  # a step already running ends and its tokens arrive
            for _ in range(20):
                if not await progress_after(0.05):
                    return

        task = asyncio.create_task(drain())
        while produced[0] < 5:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.005)
        try:
            release = engine.hold_background()
            await quiet()  # with the hold broken, it never gets quiet: `held` fails
            held = await progress_after(0.2)
            # an interactive request is not held back
            interactive = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            _, tokens, _, _ = await collect(engine, "a cat sleeps", interactive)
            release()
            released = await progress_after(0.3)
            engine.hold_background()  # never released: the cap lets background work go on
            await asyncio.sleep(3.1)
            past_the_cap = await progress_after(0.3)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return held, len(tokens), released, past_the_cap

    held, interactive_tokens, released, past_the_cap = asyncio.run(main())
    assert held == 0
    assert interactive_tokens == 4
    assert released > 0 and past_the_cap > 0
