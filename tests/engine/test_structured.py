"""Structured outputs in the engine: constraints hold under every sampling option beside them,
with any adapter, and compile off the engine thread."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time

import pytest

from loraplex.engine.api import AsyncEngine, EngineConfig, SamplingParams, StructuredOutput
from loraplex.engine.structured import Grammars
from tests.factories import make_llm

CHOICES = ["the old cat", "a blue river", "hello world"]
PROMPTS = ["the river", "a cat sleeps", "old city light", "the king tells of a story"]


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return make_llm(tiny_llama)


def texts(results) -> list[str]:
    return [out.text for result in results for out in result.outputs]


def test_choice_holds_under_temperature_top_k_top_p_n_and_seed(tiny):
    params = SamplingParams(
        n=4, temperature=1.5, top_p=0.9, top_k=20, seed=11, max_tokens=20,
        structured_outputs=StructuredOutput.choice(CHOICES),
    )  # fmt: skip
    first = tiny.generate(PROMPTS, params)
    assert set(texts(first)) <= set(CHOICES)
    assert {out.finish_reason for r in first for out in r.outputs} == {"stop"}
    assert texts(tiny.generate(PROMPTS, params)) == texts(first)  # seeded: reproducible


def test_logit_bias_steers_within_the_constraint_and_cannot_leave_it(tiny):
    hello = tiny.tokenizer.encode("hello", add_special_tokens=False)
    assert len(hello) == 1
    outside = tiny.tokenizer.encode(" dog", add_special_tokens=False)[0]
    choice = StructuredOutput.choice(CHOICES)
    steered = SamplingParams(
        temperature=1.0, max_tokens=20, logit_bias={hello[0]: 100.0}, structured_outputs=choice
    )
    assert texts(tiny.generate(PROMPTS, steered)) == ["hello world"] * len(PROMPTS)
    pushed_out = SamplingParams(
        temperature=0.0, max_tokens=20, logit_bias={outside: 100.0}, structured_outputs=choice
    )
    free = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={outside: 100.0})
    assert texts(tiny.generate(PROMPTS[:1], free))[0].startswith(" dog")  # the bias works...
    assert set(texts(tiny.generate(PROMPTS, pushed_out))) <= set(CHOICES)  # ...but not past it


def test_penalties_cannot_break_a_constraint_that_repeats(tiny):
    params = SamplingParams(
        temperature=0.0, max_tokens=30, presence_penalty=2.0, frequency_penalty=2.0,
        structured_outputs=StructuredOutput.regex("(cat ){3}dog"),
    )  # fmt: skip
    assert texts(tiny.generate(PROMPTS, params)) == ["cat cat cat dog"] * len(PROMPTS)


def test_logprobs_come_with_every_constrained_token(tiny):
    params = SamplingParams(
        temperature=0.0, max_tokens=12, logprobs=3,
        structured_outputs=StructuredOutput.regex("[0-9]{6}"),
    )  # fmt: skip
    for result in tiny.generate(PROMPTS, params):
        out = result.outputs[0]
        assert re.fullmatch("[0-9]{6}", out.text)
        assert len(out.logprobs) == len(out.token_ids)
        for token, entry in zip(out.token_ids, out.logprobs, strict=True):
            assert entry.token_id == token
            assert math.isfinite(entry.logprob) and entry.logprob <= 0.0
            assert len(entry.top) == 3


def test_a_stop_string_ends_a_constrained_output_early(tiny):
    params = SamplingParams(
        temperature=0.0, max_tokens=30, stop=[" runs"],
        structured_outputs=StructuredOutput.regex("the (cat|dog) runs quickly"),
    )  # fmt: skip
    for result in tiny.generate(PROMPTS, params):
        assert result.outputs[0].text in ("the cat", "the dog")
        assert result.outputs[0].finish_reason == "stop"


def test_a_constrained_request_cut_by_max_tokens_ends_with_length(tiny):
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    params = SamplingParams(
        temperature=0.0, max_tokens=4, structured_outputs=StructuredOutput.json_schema(schema)
    )
    out = tiny.generate(PROMPTS[:1], params)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert out.text.startswith("{")
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_every_adapter_keeps_the_constraint_and_free_neighbours_are_untouched(tiny, tiny_adapters):
    schema = {
        "type": "object",
        "properties": {
            "color": {"enum": ["green", "blue"]},
            "size": {"type": "integer", "minimum": 0, "maximum": 9},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "size", "ok"],
        "additionalProperties": False,
    }
    names = [None, *tiny_adapters]
    constrained = SamplingParams(
        temperature=0.0, max_tokens=40, structured_outputs=StructuredOutput.json_schema(schema)
    )
    free = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    adapters = [tiny_adapters[n] if n else None for n in names]
    alone = tiny.generate([PROMPTS[0]] * len(names), free, adapters)
    mixed = tiny.generate(
        [PROMPTS[0]] * (2 * len(names)), [constrained, free] * len(names),
        [a for a in adapters for _ in (0, 1)],
    )  # fmt: skip
    for i, name in enumerate(names):
        value = json.loads(mixed[2 * i].outputs[0].text)
        assert value["color"] in ("green", "blue") and 0 <= value["size"] <= 9, name
        assert isinstance(value["ok"], bool) and set(value) == {"color", "size", "ok"}, name
        assert mixed[2 * i + 1].outputs[0].token_ids == alone[i].outputs[0].token_ids, name


def test_a_slow_compile_runs_off_the_engine_thread_while_other_requests_stream(
    tiny_llama, monkeypatch
):
    compiled_on: list[str] = []
    real_compile = Grammars._compile

    def slow_compile(self, constraint):
        compiled_on.append(threading.current_thread().name)
        time.sleep(1.5)
        return real_compile(self, constraint)

    monkeypatch.setattr(Grammars, "_compile", slow_compile)
    engine = AsyncEngine(EngineConfig(model=str(tiny_llama), memory_budget="64MiB"))
    free = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=StructuredOutput.choice(CHOICES)
    )

    async def stream_times():
        times = []
        async for _ in engine.generate("the river", free):
            times.append(time.monotonic())
        return times

    async def constrained_text():
        await asyncio.sleep(0.05)  # the free stream is under way
        started, first, text = time.monotonic(), None, ""
        prompt = engine.encode("a cat sleeps")  # token ids: made on the spot unless it compiles
        async for delta in engine.generate(prompt, constrained):
            first = first or time.monotonic()
            text += delta.outputs[0].text
        return started, first, text

    async def main():
        return await asyncio.gather(stream_times(), constrained_text())

    try:
        times, (started, first, text) = asyncio.run(main())
    finally:
        engine.shutdown()
    assert text in CHOICES
    assert len(compiled_on) == 1
    assert compiled_on[0] not in (engine._thread.name, threading.main_thread().name)
    assert first - started >= 1.5
    during = [t for t in times if started < t < first]
    assert len(during) >= 5  # tokens kept coming while the grammar compiled
