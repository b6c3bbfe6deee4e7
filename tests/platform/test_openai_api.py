"""The OpenAI routes through the official SDK (sync, async, streaming) against a real server."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from loraplex import LoRARequest, SamplingParams
from tests.factories import make_llm

QUESTION = [{"role": "user", "content": "the river runs"}]


def client(server, key: str) -> OpenAI:
    return OpenAI(base_url=server.api, api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tenants(server, adapter_root):
    """Two tenants with an adapter each (one name on both sides), and a shared adapter."""
    a, b = server.tenant("acme"), server.tenant("globex")
    server.register("helper", adapter_root / "alpha", a)
    server.register("secret-sauce", adapter_root / "beta", a)
    server.register("helper", adapter_root / "gamma", b)
    server.register("everyone", adapter_root / "beta", None)
    return {"a": server.key(a), "b": server.key(b), "a_id": a, "b_id": b}


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return make_llm(tiny_llama)


def engine_answer(offline, adapter_dir, messages=QUESTION, max_tokens=12):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    adapters = [LoRARequest(str(adapter_dir), str(adapter_dir))] if adapter_dir else None
    return offline.chat(messages, params, adapters=adapters)[0].outputs[0].text


def test_each_tenant_sees_its_own_models_and_the_shared_ones(server, tenants):
    for key, expected in ((tenants["a"], {"helper", "secret-sauce"}), (tenants["b"], {"helper"})):
        models = {m.id: m for m in client(server, key).models.list()}
        assert set(models) == {"llama", "everyone"} | expected
        assert models["everyone"].owned_by == "shared"
        assert models["helper"].parent == "llama"
    assert client(server, tenants["a"]).models.retrieve("helper").owned_by == "acme"


def test_another_tenants_adapter_answers_like_a_missing_one(server, tenants):
    b = client(server, tenants["b"])
    replies = {}
    for name in ("secret-sauce", "no-such-adapter"):
        with pytest.raises(openai.NotFoundError) as error:
            b.chat.completions.create(model=name, messages=QUESTION, max_tokens=2)
        replies[name] = error.value
    hidden, missing = replies["secret-sauce"], replies["no-such-adapter"]
    assert hidden.status_code == missing.status_code == 404
    assert hidden.body == {
        **missing.body,
        "message": missing.body["message"].replace("no-such-adapter", "secret-sauce"),
    }
    assert hidden.body["message"] == (
        "The model `secret-sauce` does not exist or you do not have access to it."
    )
    assert hidden.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        b.models.retrieve("secret-sauce")
    # the same work either way: no faster "missing" than "someone else's"
    timings = {name: [] for name in ("secret-sauce", "no-such-adapter")}
    for _ in range(15):
        for name in timings:
            started = time.perf_counter()
            httpx.post(
                f"{server.api}/chat/completions",
                headers={"Authorization": f"Bearer {tenants['b']}"},
                json={"model": name, "messages": QUESTION},
            )
            timings[name].append(time.perf_counter() - started)
    ratio = statistics.median(timings["secret-sauce"]) / statistics.median(
        timings["no-such-adapter"]
    )
    assert 0.33 < ratio < 3


def test_greedy_answers_equal_the_engine(server, tenants, offline, adapter_root):
    sync = client(server, tenants["a"])
    for model, adapter in (("helper", adapter_root / "alpha"), ("llama", None)):
        expected = engine_answer(offline, adapter)
        reply = sync.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=12, temperature=0
        )
        assert reply.choices[0].message.content == expected
        assert reply.usage.completion_tokens == 12 or reply.choices[0].finish_reason == "stop"
        streamed = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in sync.chat.completions.create(
                model=model, messages=QUESTION, max_tokens=12, temperature=0, stream=True
            )
            if chunk.choices
        )
        assert streamed == expected

    async def via_async():
        async_client = AsyncOpenAI(base_url=server.api, api_key=tenants["b"], max_retries=0)
        replies = await asyncio.gather(
            *(
                async_client.chat.completions.create(
                    model="helper", messages=QUESTION, max_tokens=12, temperature=0
                )
                for _ in range(3)
            )
        )
        await async_client.close()
        return [r.choices[0].message.content for r in replies]

    assert asyncio.run(via_async()) == [engine_answer(offline, adapter_root / "gamma")] * 3


def test_legacy_completions_equal_the_engine(server, tenants, offline, adapter_root):
    sync = client(server, tenants["a"])
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    lora = LoRARequest("alpha", str(adapter_root / "alpha"))
    prompts = ["the river", "old king tells"]
    expected = [r.outputs[0].text for r in offline.generate(prompts, params, adapters=[lora] * 2)]
    reply = sync.completions.create(
        model="helper",
        prompt=prompts,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == expected
    assert reply.usage.completion_tokens == 20
    ids = offline.tokenizer.encode("the river")
    stream = sync.completions.create(
        model="helper",
        prompt=ids,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0]
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].choices == []
    echoed = sync.completions.create(model="llama", prompt="the river", max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith("the river")


def test_a_stream_read_line_by_line_keeps_text_with_unicode_line_breaks(server, tenants):
    """httpx's `aiter_lines()` (like str.splitlines) also ends a line at U+0085, U+2028 and
    U+2029, which JSON leaves raw in strings: each chunk must still arrive as one line."""
    prompt = "one\u2028two\x85three\u2029four"
    body = {"model": "llama", "prompt": prompt, "max_tokens": 4, "echo": True, "stream": True}
    headers = {"Authorization": f"Bearer {tenants['a']}"}
    with httpx.stream("POST", f"{server.api}/completions", json=body, headers=headers) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert reply.status_code == 200 and events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text.startswith(prompt) and len(text) > len(prompt)


def test_sampling_fields_are_honoured(server, tenants, offline):
    sync = client(server, tenants["a"])

    def ask(**options):
        options.setdefault("max_tokens", 8)
        return sync.chat.completions.create(model="llama", messages=QUESTION, **options)

    seeded = [ask(temperature=1.0, seed=7).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1]
    multiple = ask(temperature=1.0, n=3, seed=3)
    assert [c.index for c in multiple.choices] == [0, 1, 2]
    assert len({c.message.content for c in multiple.choices}) > 1
    assert 3 <= multiple.usage.completion_tokens <= 24
    with_logprobs = ask(temperature=0, logprobs=True, top_logprobs=3)
    entries = with_logprobs.choices[0].logprobs.content
    assert len(entries) == with_logprobs.usage.completion_tokens
    assert all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
    assert "".join(bytes(e.bytes).decode(errors="replace") for e in entries) == (
        with_logprobs.choices[0].message.content
    )
    greedy = ask(temperature=0, max_completion_tokens=5)
    assert greedy.usage.completion_tokens == 5
    first = offline.chat(QUESTION, SamplingParams(temperature=0.0, max_tokens=1))[0]
    banned = ask(
        temperature=0,
        max_completion_tokens=5,
        logit_bias={str(first.outputs[0].token_ids[0]): -100},
    )
    assert banned.choices[0].message.content != greedy.choices[0].message.content
    stopped = ask(temperature=0, max_tokens=20, stop=[greedy.choices[0].message.content[2:4]])
    assert stopped.choices[0].finish_reason == "stop"
    extras = ask(
        temperature=0.8,
        max_tokens=6,
        extra_body={"top_k": 1, "ignore_eos": True, "stop_token_ids": [], "seed": 1},
    )
    assert (
        extras.choices[0].message.content
        == ask(temperature=0, max_tokens=6).choices[0].message.content
    )


@pytest.mark.parametrize(
    ("options", "field"),
    [
        # tools with no tool_choice mean "auto", which needs a tool-call parser loraplex lacks
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"service_tier": "scale"}, "service_tier"),
        ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
        ({"extra_body": {"min_p": 0.1}}, "min_p"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"store": True}, "store"),
    ],
)
def test_fields_that_cannot_be_honoured_are_refused_by_name(server, tenants, options, field):
    with pytest.raises(openai.BadRequestError) as error:
        client(server, tenants["a"]).chat.completions.create(
            model="llama", messages=QUESTION, max_tokens=2, **options
        )
    assert error.value.body["param"] == field
    assert field in error.value.body["message"]


def test_error_statuses_come_in_openai_shape(server, tenants, adapter_root):
    sync = client(server, tenants["a"])
    raw = httpx.Client(base_url=server.api, headers={"Authorization": f"Bearer {tenants['a']}"})
    for body, status in (
        (b"{not json", 400),
        (b'{"model": "llama"}', 400),  # no messages
        (b'{"model": "llama", "messages": [], "max_tokens": 2}', 400),
    ):
        reply = raw.post(
            "/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert reply.status_code == status
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert raw.get("/no/such/route").json()["error"]["type"] == "invalid_request_error"

    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=server.api, api_key="lpx-nope", max_retries=0).models.list()
    no_key = httpx.post(
        f"{server.api}/chat/completions", json={"model": "llama", "messages": QUESTION}
    )
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "missing_api_key"
    with pytest.raises(openai.BadRequestError) as error:
        sync.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "word " * 600}], max_tokens=2
        )
    assert "600" in error.value.message or "tokens" in error.value.message
    assert "context is 512 tokens" in error.value.message

    server.register("poisoned", adapter_root / "poison", tenants["a_id"])
    with pytest.raises(openai.InternalServerError) as error:
        sync.chat.completions.create(model="poisoned", messages=QUESTION, max_tokens=4)
    assert error.value.body["code"] == "non_finite_output"
    # the server keeps serving
    assert sync.chat.completions.create(model="llama", messages=QUESTION, max_tokens=2).choices


def test_a_disabled_tenant_is_refused_at_once(server):
    tenant = server.tenant("soon-disabled")
    sdk = client(server, server.key(tenant))
    assert sdk.models.list().data
    server.admin_ok("PATCH", f"/tenants/{tenant}", json={"disabled": True})
    with pytest.raises(openai.PermissionDeniedError):
        sdk.models.list()
    server.admin_ok("PATCH", f"/tenants/{tenant}", json={"disabled": False})
    assert sdk.models.list().data


def test_a_client_that_goes_away_aborts_its_request(server, tenants):
    sync = client(server, tenants["a"])
    stream = sync.chat.completions.create(
        model="llama",
        messages=QUESTION,
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = server.admin_ok("GET", "/engine")["stats"]
        if stats["num_running_requests"] == 0 and stats["kv_pages"] == 0:
            break
        time.sleep(0.1)
    assert stats["num_running_requests"] == 0 and stats["kv_pages"] == 0
    assert stats["num_generated_tokens"] < 10_000
