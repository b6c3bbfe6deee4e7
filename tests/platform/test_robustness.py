"""Robustness of a real server: every route of its OpenAPI description fuzzed with schemathesis
(no 500, every error in OpenAI's shape, still serving afterwards), and a load at twice the
engine's capacity (fast 503s for the excess, nothing lost or hung, the pool idle again)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import zlib
from collections import Counter

import httpx
import pytest
import schemathesis

# Schemathesis imports most of itself on first use, and pytest rewrites the asserts of a plugin's
# modules as it imports them (ast.parse). Mid-test, one such parse failed in CI with CPython
# 3.11's "AST constructor recursion depth mismatch": its AST state is shared, and a garbage
# collection inside the parse can run code that parses again. Loaded here, at collection.
import schemathesis.specs.openapi._hypothesis
import schemathesis.specs.openapi.coverage
import schemathesis.specs.openapi.negative
import schemathesis.specs.openapi.schemas
import schemathesis.specs.openapi.stateful
import schemathesis.transport.requests
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.platform.servers import ADMIN_TOKEN, start_server

BASE_MODEL = "llama"
FLOOD_TOKENS = 128  # each answer of the load test: long enough to stand well clear of a 503
MAX_FUZZ_TOKENS = 16  # generation requests the fuzzer makes stay short
FUZZ_EXAMPLES = 20  # per operation and mode (well-formed, malformed)
STATUSES: Counter = Counter()


@pytest.fixture(scope="module")
def tenant_key(server) -> str:
    return server.key(server.tenant("fuzzed"))


def admin_route(path: str) -> bool:
    return path.startswith(("/admin/", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"))


def aim_at_the_engine(case) -> None:
    """Half of the well-formed completion bodies name the served model (the rest exercise the
    404 path), with small token counts, so that the fuzzer drives the engine without running
    long generations."""
    body = case.body
    if not isinstance(body, dict) or not case.path.endswith("completions"):
        return
    if zlib.crc32(repr(sorted(body.items(), key=str)).encode()) % 2:
        body["model"] = BASE_MODEL
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int) and body[field] > MAX_FUZZ_TOKENS:
            body[field] = MAX_FUZZ_TOKENS
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2


def test_fuzzed_requests_get_no_500_and_errors_in_openai_shape(server, tenant_key):
    """Each operation of the OpenAPI description, with well-formed and malformed requests."""
    described = httpx.get(f"{server.url}/openapi.json").json()
    # The credentials are the test's to set (a tenant key or the admin token); left described,
    # malformed cases would mostly drop them and stop at 401 before reaching the body.
    for operations in described["paths"].values():
        for operation in operations.values():
            operation.pop("security", None)
    schema = schemathesis.openapi.from_dict(described)
    for found in schema.get_all_operations():
        operation = found.ok()
        for mode in GenerationMode:

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=FUZZ_EXAMPLES,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def fuzz(case) -> None:
                check_reply(server, tenant_key, case)

            try:
                fuzz()
            except Unsatisfiable:  # no malformed variant of an operation without inputs
                continue
            except Exception as error:
                raise AssertionError(f"{operation.label} ({mode.value}): {error}") from error


def check_reply(server, tenant_key: str, case) -> None:
    aim_at_the_engine(case)
    secret = ADMIN_TOKEN if admin_route(case.path) else tenant_key
    headers = {**(case.headers or {}), "Authorization": f"Bearer {secret}"}
    response = case.call(base_url=server.url, headers=headers, timeout=60)
    STATUSES[response.status_code] += 1
    assert response.status_code < 500 or response.status_code == 503, response.text
    assert "x-request-id" in response.headers
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, response.text
        assert isinstance(error["message"], str) and error["message"]


def test_still_serving_after_the_fuzzing(server, tenant_key, report):
    reply = httpx.post(
        f"{server.api}/chat/completions",
        headers={"Authorization": f"Bearer {tenant_key}"},
        json={
            "model": BASE_MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            # sampled at temperature 1, the random model ended one answer at its EOS after 3
            "ignore_eos": True,
        },
        timeout=60,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{server.url}/ready").status_code == 200
    assert sum(STATUSES.values()) > 100  # the fuzzing above really ran
    report(
        f"schemathesis: {sum(STATUSES.values())} fuzzed requests, statuses "
        + ", ".join(f"{status}: {n}" for status, n in sorted(STATUSES.items()))
        + "; no 500, every error in OpenAI's shape, still serving"
    )


def test_load_at_twice_capacity_gets_fast_503s_and_loses_nothing(tmp_path, tiny_llama, report):
    running, waiting = 4, 4  # the engine's capacity: 8 requests at a time
    server = start_server(
        tiny_llama,
        tmp_path,
        served_model_name=BASE_MODEL,
        max_waiting_requests=waiting,
        engine__max_num_seqs=running,
    )
    try:
        key = server.key(server.tenant("loaded"))
        outcomes = asyncio.run(flood(server, key, 2 * (running + waiting), rounds=3))
        engine = server.admin_ok("GET", "/engine")
    finally:
        assert server.stop() == 0

    served = [o for o in outcomes if o["status"] == 200]
    refused = [o for o in outcomes if o["status"] == 503]
    assert len(served) + len(refused) == len(outcomes)  # nothing lost, hung or failed otherwise
    assert served and refused
    assert all(o["tokens"] == FLOOD_TOKENS for o in served)
    assert all(o["code"] == "overloaded" for o in refused)
    # the excess is refused at once: each refusal came back before its round's first answer
    for round_ in {o["round"] for o in refused}:
        first_answer = min(o["seconds"] for o in served if o["round"] == round_)
        late = [
            o["seconds"] for o in refused if o["round"] == round_ and o["seconds"] >= first_answer
        ]
        assert not late, (
            f"round {round_}: refusals after {late} s, first answer after {first_answer} s"
        )
    # every request has its usage row (the refused ones too, with no tokens); the pool is idle
    with sqlite3.connect(tmp_path / "loraplex.db") as db:
        rows = db.execute("SELECT status, completion_tokens FROM usage").fetchall()
    assert sorted(rows) == [(200, FLOOD_TOKENS)] * len(served) + [(503, 0)] * len(refused)
    stats, pool = engine["stats"], engine["pool"]
    assert stats["num_running_requests"] == stats["num_waiting_requests"] == 0
    idle = pool["free_pages"] + pool["cached_pages"]  # cached: prefixes kept, given back on demand
    assert pool["kv_pages"] == 0 and idle == pool["num_pages"] - pool["adapter_pages"]
    refusal = sorted(o["seconds"] for o in refused)[len(refused) // 2]
    answer = sorted(o["seconds"] for o in served)[len(served) // 2]
    report(
        f"overload: {len(outcomes)} requests at 2x capacity ({running} running + {waiting} "
        f"waiting) in 3 rounds: {len(served)} served, {len(refused)} refused with 503 "
        f"(p50 {refusal * 1000:.1f} ms vs {answer * 1000:.0f} ms for an answer), 0 lost, "
        f"{len(rows)} usage rows, pool idle afterwards"
    )


async def flood(server, key: str, concurrency: int, rounds: int) -> list[dict]:
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": BASE_MODEL, "prompt": "load", "max_tokens": FLOOD_TOKENS, "ignore_eos": True}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(headers=headers, timeout=120, limits=limits) as client:

        async def one(round_: int) -> dict:
            started = time.perf_counter()
            reply = await client.post(f"{server.api}/completions", json=body)
            seconds = time.perf_counter() - started
            outcome = {"round": round_, "status": reply.status_code, "seconds": seconds}
            if reply.status_code == 200:
                outcome["tokens"] = reply.json()["usage"]["completion_tokens"]
            else:
                outcome["code"] = reply.json()["error"]["code"]
            return outcome

        outcomes = []
        for round_ in range(rounds):
            outcomes += await asyncio.wait_for(
                asyncio.gather(*(one(round_) for _ in range(concurrency))), timeout=120
            )
        return outcomes
