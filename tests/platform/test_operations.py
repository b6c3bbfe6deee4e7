"""Operations on a real server: Prometheus metrics, readiness, request ids and JSON request logs
without secrets, and a graceful stop under streaming load."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from loraplex.platform import registry
from loraplex.platform.app import create_app
from loraplex.platform.settings import load_settings
from tests.factories import wedged
from tests.platform.servers import ADMIN_TOKEN, free_port, start_server, wait_ready

SECRET_PROMPT = "zebra-orchid-7341 tell me a secret"


def scrape(server) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from /metrics."""
    reply = httpx.get(f"{server.url}/metrics", timeout=10)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(reply.text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key=key, max_retries=0)


def test_metrics_move_as_requests_are_served(server, adapter_root):
    tenant = server.tenant("metered")
    key = server.key(tenant)
    server.register("metered-alpha", adapter_root / "alpha", tenant)
    sdk = client(server, key)
    before = scrape(server)

    for model in ("llama", "llama", "metered-alpha"):
        sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}]
        )

    # while a long stream runs, the engine gauges show it; afterwards the pool is idle again
    stream = sdk.completions.create(
        model="llama", prompt="count", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    during = scrape(server)
    for _ in stream:
        pass
    after = scrape(server)

    route = "/v1/chat/completions"
    ok = value(after, "loraplex_requests_total", route=route, model="llama", status="200")
    assert (
        ok - value(before, "loraplex_requests_total", route=route, model="llama", status="200") == 2
    )
    labels = dict(route=route, model="metered-alpha", status="200")
    assert value(after, "loraplex_requests_total", **labels) == 1
    # an unknown model is counted under "-", so made-up names mint no series
    assert value(after, "loraplex_requests_total", route=route, model="-", status="404") >= 1
    assert not any("no-such-model" in str(labels) for _, labels in after)

    for histogram in ("time_to_first_token", "e2e_request_latency", "inter_token_latency"):
        name = f"loraplex_{histogram}_seconds_count"
        assert value(after, name) > value(before, name), histogram
    generated = value(after, "loraplex_generation_tokens_total", tenant=tenant)
    assert generated == 5 + 5 + 5 + 400
    assert value(after, "loraplex_prompt_tokens_total", tenant=tenant) > 0

    assert value(during, "loraplex_num_requests_running") >= 1
    assert value(during, "loraplex_pool_pages", use="kv") > 0
    assert value(during, "loraplex_batch_size") >= 1
    pages = [value(after, "loraplex_pool_pages", use=u) for u in ("kv", "adapter", "free")]
    assert pages[0] == 0 and pages[1] > 0  # the adapter stays resident until evicted
    assert value(after, "loraplex_adapter_loads_total") >= 1
    assert value(after, "loraplex_adapter_load_seconds_count") >= 1


def test_request_ids_and_json_request_lines_without_secrets(server):
    tenant = server.tenant("logged")
    key = server.key(tenant)
    sdk = client(server, key)
    raw = sdk.chat.completions.with_raw_response.create(
        model="llama",
        messages=[{"role": "user", "content": SECRET_PROMPT}],
        max_tokens=8,
        extra_headers={"x-request-id": "trace-abc.123"},
    )
    assert raw.headers["x-request-id"] == "trace-abc.123"
    completion = raw.parse().choices[0].message.content
    # without one (or with a malformed one), the server makes one; errors carry it too
    fresh = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
    assert fresh.status_code == 401 and len(fresh.headers["x-request-id"]) == 32
    odd = httpx.get(f"{server.url}/health", headers={"x-request-id": "bad id\twith spaces"})
    assert odd.headers["x-request-id"] != "bad id\twith spaces"

    time.sleep(0.2)  # the log line is written once the reply is sent
    lines = [json.loads(line) for line in server.output().splitlines() if line.startswith("{")]
    mine = [line for line in lines if line.get("request_id") == "trace-abc.123"]
    assert len(mine) == 1
    line = mine[0]
    assert line["tenant_id"] == tenant and line["model"] == "llama" and line["status"] == 200
    assert line["route"] == "/v1/chat/completions" and line["completion_tokens"] == 8
    assert line["prompt_tokens"] > 0 and line["latency_ms"] > 0
    assert any(line.get("request_id") == fresh.headers["x-request-id"] for line in lines)

    log = server.output()
    assert key not in log and key[12:] not in log  # not even the secret part of the key
    assert "zebra-orchid" not in log
    assert completion.strip() == "" or completion.strip()[:20] not in log


def test_ready_is_503_until_the_model_is_loaded(tmp_path, tiny_llama):
    server = start_server(tiny_llama, tmp_path, wait=False)
    try:
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and 200 not in seen:
            with contextlib.suppress(httpx.TransportError):  # not listening yet
                seen.append(httpx.get(f"{server.url}/ready", timeout=2).status_code)
            time.sleep(0.01)
        assert seen[0] == 503 and seen[-1] == 200, seen
        wait_ready(server)
    finally:
        assert server.stop() == 0


def test_ready_turns_503_while_the_engine_thread_is_wedged(tmp_path, tiny_llama):
    """The server in this process, so that its engine thread can be made to hang."""
    port = free_port()
    settings = load_settings(model=str(tiny_llama), data_dir=tmp_path, port=port, dev_mode=True)
    app = create_app(settings, ADMIN_TOKEN)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not app.state.platform.ready:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.get(f"{url}/ready").status_code == 200
        with ThreadPoolExecutor(1) as pool, wedged(app.state.platform.engine):
            body = {"model": tiny_llama.name, "prompt": "stuck", "max_tokens": 4}
            headers = {"Authorization": f"Bearer {make_key(app)}"}
            post = partial(httpx.post, json=body, headers=headers, timeout=60)
            pending = pool.submit(post, f"{url}/v1/completions")
            time.sleep(0.3)  # the engine thread is now stuck in its step
            probe = httpx.get(f"{url}/ready", timeout=30)
            assert probe.status_code == 503 and "wedged" in probe.json()["error"]["message"]
        assert pending.result(timeout=60).status_code == 200
        assert httpx.get(f"{url}/ready").status_code == 200
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def make_key(app) -> str:
    """A tenant and key made straight in the registry of an in-process server."""
    db = app.state.platform.db
    tenant = db.transaction(lambda s: registry.create_tenant(s, "probe"))
    return db.transaction(lambda s: registry.create_key(s, tenant.id, "probe"))[1]


def test_sigterm_drains_streams_refuses_new_work_and_keeps_every_usage_row(tmp_path, tiny_llama):
    server = start_server(tiny_llama, tmp_path, shutdown_grace_seconds=60)
    tenant = server.tenant("draining")
    key = server.key(tenant)
    sdk = client(server, key)
    sdk.completions.create(model=server_model(server), prompt="warm", max_tokens=2)

    results: dict[int, tuple[str | None, int]] = {}
    started = threading.Barrier(5)

    def stream(i: int) -> None:
        chunks = sdk.completions.create(
            model=server_model(server),
            prompt=f"story {i}",
            max_tokens=300,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        reason, tokens = None, 0
        for n, chunk in enumerate(chunks):
            if n == 0:
                started.wait(timeout=60)
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        results[i] = (reason, tokens)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    started.wait(timeout=60)
    server.process.send_signal(signal.SIGTERM)

    # new work is refused at once while the streams go on; readiness turns 503
    deadline = time.monotonic() + 10
    while httpx.get(f"{server.url}/ready").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(openai.InternalServerError) as refused:
        sdk.completions.create(model=server_model(server), prompt="late", max_tokens=2)
    assert refused.value.status_code == 503
    assert refused.value.body["code"] == "shutting_down"

    for thread in threads:
        thread.join(timeout=120)
    assert server.process.wait(timeout=60) == 0
    assert results == {i: ("length", 300) for i in range(4)}
    with sqlite3.connect(tmp_path / "loraplex.db") as db:
        rows = db.execute(
            "SELECT status, completion_tokens FROM usage WHERE tenant_id = ?", (tenant,)
        ).fetchall()
    assert sorted(rows) == [(200, 2)] + [(200, 300)] * 4


def server_model(server) -> str:
    return server.env["LORAPLEX_MODEL"].rstrip("/").rsplit("/", 1)[-1]
