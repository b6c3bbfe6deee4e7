"""The public API the server builds on (`loraplex.engine.api`), used the way the server uses it:
chat encoding, adapter validation, coded errors, stats, health, back-pressure, shutdown."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import threading
import time

import pytest

from loraplex.engine.adapters.peft_format import AdapterReader, random_peft_adapter
from loraplex.engine.api import (
    AdapterError,
    AsyncEngine,
    EngineConfig,
    EngineDeadError,
    EngineShutdownError,
    ErrorCode,
    InvalidRequestError,
    LoRARequest,
    OverloadedError,
    RequestFailedError,
    SamplingParams,
)
from loraplex.engine.config import ModelConfig
from tests.factories import build_adapter, make_llm, poison_adapter, wedged

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_engine(model_dir, **options) -> AsyncEngine:
    options.setdefault("memory_budget", "64MiB")
    options.setdefault("dtype", "float32")
    return AsyncEngine(EngineConfig(model=str(model_dir), **options))


@pytest.fixture(scope="module")
def roots(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("adapter-roots")
    build_adapter(tiny_llama, root / "qv", rank=4, seed=1)
    build_adapter(tiny_llama, root / "wide", rank=16, targets=("q_proj",), seed=2)
    poison_adapter(build_adapter(tiny_llama, root / "k", rank=4, targets=("k_proj",)), root / "bad")
    (root / "garbage").mkdir()
    shutil.copy(root / "qv" / "adapter_config.json", root / "garbage")
    (root / "garbage" / "adapter_model.safetensors").write_bytes(b"\x00 not safetensors" * 9)
    other_base = dataclasses.replace(ModelConfig.from_dir(tiny_llama), hidden_size=48)
    random_peft_adapter(root / "other-base", other_base, 4)
    return root


@pytest.fixture(scope="module")
def engine(tiny_llama, roots):
    engine = make_engine(
        tiny_llama, adapter_roots=(str(roots),), max_lora_rank=8, max_model_len=256, num_pages=12
    )
    yield engine
    engine.shutdown()


async def collect(engine, prompt, params=GREEDY, lora=None, tag=None):
    text, tokens, tags = "", [], set()
    async for delta in engine.generate(prompt, params, lora=lora, tag=tag):
        text += delta.outputs[0].text
        tokens += delta.outputs[0].token_ids
        tags.add(delta.tag)
    return text, tokens, tags


def test_chat_encoding_and_tags_reach_every_delta(engine, tiny_llama):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the sea"}]
    ids = engine.encode_chat(messages)
    text, tokens, tags = asyncio.run(collect(engine, ids, tag=("tenant-7", "key-1")))
    offline = make_llm(tiny_llama).chat(messages, GREEDY)[0].outputs[0]
    assert (text, tokens) == (offline.text, offline.token_ids)
    assert tags == {("tenant-7", "key-1")}
    with pytest.raises(InvalidRequestError, match="messages"):
        engine.encode_chat([{"role": "user", "content": 5}])


def test_validate_adapter_reports_it_and_changes_nothing(engine, roots):
    before = asyncio.run(engine.pool_snapshot())
    loads = engine.stats().num_adapter_loads
    info = asyncio.run(engine.validate_adapter(LoRARequest("qv", str(roots / "qv"))))
    assert (info.rank, info.target_modules, info.num_layers) == (4, ("q_proj", "v_proj"), 3)
    assert (
        info.num_pages == 1 and info.nbytes == 3 * 4 * (64 + 64 + 64 + 32) * 4
    )  # q: A, B; v: A, B (kv 32)
    assert len(info.content_hash) == 64
    assert asyncio.run(engine.pool_snapshot()) == before
    assert engine.stats().num_adapter_loads == loads


@pytest.mark.parametrize(
    ("adapter", "code"),
    [
        ("missing", ErrorCode.ADAPTER_NOT_FOUND),
        ("/etc", ErrorCode.ADAPTER_OUTSIDE_ROOTS),
        ("garbage", ErrorCode.ADAPTER_CORRUPT),
        ("other-base", ErrorCode.ADAPTER_INCOMPATIBLE),
        ("wide", ErrorCode.ADAPTER_RANK_TOO_HIGH),
    ],
)
def test_adapter_errors_carry_codes(engine, roots, adapter, code):
    lora = LoRARequest(adapter, str(roots / adapter))
    for call in (engine.validate_adapter(lora), collect(engine, "the river", lora=lora)):
        with pytest.raises(AdapterError) as error:
            asyncio.run(call)
        assert error.value.code is code


def test_request_errors_carry_codes_and_params(engine):
    cases = [
        ([5] * 300, GREEDY, ErrorCode.PROMPT_TOO_LONG, "prompt"),
        ([5] * 100, SamplingParams(max_tokens=200), ErrorCode.PROMPT_TOO_LONG, "max_tokens"),
        ([5] * 180, SamplingParams(max_tokens=20), ErrorCode.EXCEEDS_POOL, "max_tokens"),
        ("the river", SamplingParams(stop_token_ids=[9999]), ErrorCode.INVALID_REQUEST, None),
    ]
    for prompt, params, code, param in cases:
        with pytest.raises(InvalidRequestError) as error:
            asyncio.run(collect(engine, prompt, params))
        assert error.value.code is code
        assert param is None or error.value.param == param
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(top_p=2)
    assert (error.value.code, error.value.param) == (ErrorCode.INVALID_REQUEST, "top_p")


def test_stats_count_what_was_served(engine, roots):
    before = engine.stats()
    lora = LoRARequest("qv", str(roots / "qv"))

    async def main():
        return await asyncio.gather(collect(engine, "the river"), collect(engine, "a", lora=lora))

    asyncio.run(main())
    after = engine.stats()
    assert after.num_generated_tokens - before.num_generated_tokens == 16
    assert after.num_steps > before.num_steps and after.step_seconds > before.step_seconds
    assert after.num_running_requests == after.num_waiting_requests == 0
    assert after.kv_pages == 0
    assert after.free_pages + after.cached_pages + after.adapter_pages == after.num_pages
    assert engine.model_info().max_model_len == 256 and engine.model_info().has_chat_template


def test_non_finite_output_fails_that_stream_only(engine, roots):
    bad = LoRARequest("bad", str(roots / "bad"))

    async def main():
        return await asyncio.gather(
            collect(engine, "the city", lora=bad),
            collect(engine, "the river"),
            return_exceptions=True,
        )

    poisoned, fine = asyncio.run(main())
    assert isinstance(poisoned, RequestFailedError) and poisoned.code is ErrorCode.NON_FINITE
    assert len(fine[1]) == 8
    assert engine.stats().num_failed_requests >= 1


def test_health_check_sees_a_wedged_engine_thread(engine):
    asyncio.run(engine.check_health(timeout=5))

    async def wedge_and_probe():
        task = asyncio.create_task(collect(engine, "the river"))
        await asyncio.sleep(0.2)  # the engine thread is now stuck in the step
        with pytest.raises(EngineDeadError, match="wedged"):
            await engine.check_health(timeout=0.5)
        return task

    async def main():
        with wedged(engine):
            task = await wedge_and_probe()
        return await task

    assert len(asyncio.run(main())[1]) == 8
    asyncio.run(engine.check_health(timeout=5))


def test_too_many_waiting_requests_are_refused_at_once(tiny_llama):
    engine = make_engine(tiny_llama, max_waiting_requests=2)

    async def main():
        with wedged(engine):
            waiting = [asyncio.create_task(collect(engine, p)) for p in ("the river", "a cat")]
            await asyncio.sleep(0.2)
            started = time.monotonic()
            with pytest.raises(OverloadedError) as error:
                await collect(engine, "old city")
            assert time.monotonic() - started < 0.1
            assert error.value.code is ErrorCode.OVERLOADED
        return await asyncio.gather(*waiting)

    try:
        assert [len(tokens) for _, tokens, _ in asyncio.run(main())] == [8, 8]
        assert len(asyncio.run(collect(engine, "old city"))[1]) == 8  # room again
    finally:
        engine.shutdown()


def test_shutdown_drains_within_the_grace_then_fails_the_rest(tiny_llama):
    engine = make_engine(tiny_llama)
    long = SamplingParams(temperature=0.0, max_tokens=500, n=32, ignore_eos=True)  # seconds

    async def main():
        short = asyncio.create_task(collect(engine, "the river"))
        endless = asyncio.create_task(collect(engine, "a cat", long))
        await asyncio.sleep(0.1)
        started = time.monotonic()
        await asyncio.to_thread(engine.shutdown, 0.3)
        took = time.monotonic() - started
        with pytest.raises(EngineShutdownError):
            await endless
        with pytest.raises(EngineShutdownError):
            await collect(engine, "too late")
        with pytest.raises(EngineShutdownError):
            await engine.pool_snapshot()
        return await short, took

    (_, tokens, _), took = asyncio.run(main())
    assert len(tokens) == 8  # finished inside the grace period
    assert took < 5


def test_adapters_are_never_read_on_the_engine_thread(tiny_llama, tiny_adapters, monkeypatch):
    threads = []
    real_read = AdapterReader.read

    def recording_read(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(AdapterReader, "read", recording_read)
    engine = make_engine(tiny_llama, adapter_host_cache=1)  # every other read is a miss

    async def main():
        loras = [LoRARequest(name, str(path)) for name, path in tiny_adapters.items()]
        for _ in range(2):
            await asyncio.gather(*(engine.load_adapter(lora) for lora in loras))
            await asyncio.gather(*(collect(engine, "the river", lora=lora) for lora in loras))

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert threads and "loraplex-engine" not in threads


def test_a_failed_step_ends_every_stream(tiny_llama):
    """Fault injection: a step that fails after requests finished in it. Every caller gets an
    end (its last delta or an error), nobody waits forever, and every page comes back."""
    engine = make_engine(tiny_llama)
    update = engine._engine.scheduler.update
    failures = iter([RuntimeError("injected")])

    def failing_update(out):
        if any(item.seq.is_finished for item in out.scheduled):
            error = next(failures, None)
            if error is not None:
                raise error
        return update(out)

    engine._engine.scheduler.update = failing_update
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    async def main():
        return await asyncio.wait_for(
            asyncio.gather(
                collect(engine, "the river", short),
                collect(engine, "a cat", long),
                return_exceptions=True,
            ),
            timeout=20,
        )

    try:
        results = asyncio.run(main())
        assert all(
            (isinstance(r, RequestFailedError) and r.code is ErrorCode.STEP_FAILED)
            or isinstance(r, tuple)
            for r in results
        ), results
        assert any(isinstance(r, RequestFailedError) for r in results)
        assert len(asyncio.run(collect(engine, "old city"))[1]) == 8  # it keeps serving
        stats = engine.stats()
        assert stats.free_pages + stats.cached_pages == stats.num_pages
    finally:
        engine.shutdown()


def test_aclose_lets_streams_flow_while_it_drains(tiny_llama):
    engine = make_engine(tiny_llama)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)

    async def main():
        stream = asyncio.create_task(collect(engine, "the river", params))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await engine.aclose(grace_seconds=20)
        return await stream, time.monotonic() - started

    (_, tokens, _), took = asyncio.run(main())
    assert len(tokens) == 60  # finished inside the grace period, while aclose waited
    assert took < 15
