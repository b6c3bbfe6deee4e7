"""loraplex on Ray Serve, for real: `loraplex serve --ray` starts a local Ray instance on this
machine with 2 engine replicas of the tiny model and 2 ingress replicas, sharing one PostgreSQL
registry and one Redis for the limits. Checked through the HTTP endpoint with the official SDK
and httpx: adapter affinity, outputs equal to the single-process server's, registration and
deletion seen by every replica, limits and revocations across ingress replicas, and a replica
killed mid-run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.factories import build_adapter
from tests.platform.servers import REDIS_URL, create_database, start_server

pytest.importorskip("ray.serve")  # the optional extra; scripts/setup.sh installs it

pytestmark = pytest.mark.timeout(600)

ADAPTERS = [f"r{i}" for i in range(6)]
PROMPTS = ["The river", "Seven lamps", "A quiet morning", "North of here"]
# the same engine on both sides of a comparison: one thread, as each replica has
SHARED = dict(served_model_name="llama", engine__num_threads=1, shutdown_grace_seconds=2)
REPLICA_PROCESS = "ServeReplica:loraplex:EngineReplica"


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_llama):
    root = tmp_path_factory.mktemp("ray-adapters")
    return {
        name: build_adapter(tiny_llama, root / name, rank=4 + i, seed=200 + i)
        for i, name in enumerate([*ADAPTERS, "late"])
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_llama, adapter_dirs):
    database, drop = create_database()
    server = start_server(
        tiny_llama,
        tmp_path_factory.mktemp("ray-data"),
        extra_args=("--ray",),
        database_url=database,
        redis_url=REDIS_URL,
        ray__engine_replicas=2,
        ray__ingress_replicas=2,
        registry_poll_seconds=0.25,
        **SHARED,
    )
    try:
        # Ray routes only to an ingress replica whose platform has started: once one answers,
        # every answer is ready (a replica still starting would say 503 "starting")
        assert all(httpx.get(f"{server.url}/ready").status_code == 200 for _ in range(8))
        wait_for_replicas(server, 2)
        yield server
    finally:
        server.stop(timeout=120)
        drop()


@pytest.fixture(scope="module")
def tenant(cluster, adapter_dirs):
    """A tenant with the 6 adapters, registered through the ingress."""
    tenant_id = cluster.tenant("ray-tenant")
    for name in ADAPTERS:
        cluster.register(name, adapter_dirs[name], tenant_id)
    return tenant_id, cluster.key(tenant_id)


def engine_report(server) -> dict:
    return server.admin_ok("GET", "/engine")


def wait_for_replicas(server, count: int, timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        replicas = engine_report(server)["replicas"] or []
        if len(replicas) == count or time.monotonic() > deadline:
            assert len(replicas) == count, replicas
            return replicas
        time.sleep(0.5)


def holding_replicas(server, adapter_id: str) -> list[str]:
    """The replicas whose pool holds the adapter."""
    return [
        r for r, report in by_replica(server).items() if adapter_id in report["resident_adapters"]
    ]


def adapter_requests(reports: dict[str, dict]) -> int:
    return sum(report["adapter_requests"] for report in reports.values())


def reports_counting(server, total: int) -> dict[str, dict]:
    """The replicas' reports once they account for `total` adapter requests in all (they
    report every half second)."""
    deadline = time.monotonic() + 5
    while True:
        reports = by_replica(server)
        if adapter_requests(reports) >= total or time.monotonic() > deadline:
            return reports
        time.sleep(0.2)


def settled(server) -> dict[str, dict]:
    """The replicas' reports once the calls made so far are in them."""
    time.sleep(1.5)
    return by_replica(server)


def assert_metrics_show(server, lines: list[str]) -> None:
    """/metrics shows every line within 5 s. Each ingress replica reads the replicas' reports on
    its own (every half second), and two calls may reach different ingress replicas, so an
    answer can lag the one before it by a read: give it a few."""
    deadline = time.monotonic() + 5
    while True:
        shown_lines = httpx.get(f"{server.url}/metrics").text.splitlines()
        if all(line in shown_lines for line in lines):
            return
        if time.monotonic() > deadline:
            names = {line.split(" ")[0] for line in lines}
            shown = [line for line in shown_lines if line.split(" ")[0] in names]
            raise AssertionError(f"/metrics never showed {lines}; it had {shown}")
        time.sleep(0.2)


def by_replica(server) -> dict[str, dict]:
    return {r["replica"]: r for r in engine_report(server)["replicas"]}


def complete(server, key: str, model: str, prompt: str, max_tokens: int = 12) -> str:
    client = openai.OpenAI(base_url=server.api, api_key=key, max_retries=0)
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].text


def test_the_single_process_server_does_not_import_ray():
    probe = (
        "import sys, loraplex.cli, loraplex.platform.server, loraplex.platform.app; "
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert found.returncode == 0 and found.stdout.strip() == "[]", found.stderr


def test_each_adapter_stays_on_the_replica_holding_it_and_outputs_match_one_process(
    cluster, tenant, tiny_llama, adapter_dirs, tmp_path, report
):
    _, key = tenant
    start = adapter_requests(settled(cluster))
    for name in ADAPTERS:  # warm-up: Ray places each adapter on a replica
        complete(cluster, key, name, PROMPTS[0])
    before = reports_counting(cluster, start + len(ADAPTERS))
    work = [(name, prompt) for prompt in PROMPTS for name in [*ADAPTERS, "llama"]]
    outputs = {(name, prompt): complete(cluster, key, name, prompt) for name, prompt in work}
    after = reports_counting(cluster, start + len(ADAPTERS) * (1 + len(PROMPTS)))
    requests = sum(after[r]["adapter_requests"] - before[r]["adapter_requests"] for r in after)
    hits = sum(after[r]["affinity_hits"] - before[r]["affinity_hits"] for r in after)
    spread = {r: after[r]["adapter_requests"] - before[r]["adapter_requests"] for r in after}
    report(
        f"Ray Serve affinity after warm-up: {hits}/{requests} adapter requests landed on a "
        f"replica already holding the adapter ({hits / requests:.0%}); per replica {spread}"
    )
    assert requests == len(PROMPTS) * len(ADAPTERS)
    assert hits / requests >= 0.9
    assert all(count > 0 for count in spread.values()), "Ray put every adapter on one replica"
    # /metrics: each replica's figures, and the engine's summed over them
    resident = sum(len(r["resident_adapters"]) for r in after.values())
    expected = [
        f'loraplex_replica_affinity_hits_total{{replica="{replica}"}} '
        f"{float(figures['affinity_hits'])}"
        for replica, figures in after.items()
    ] + [f"loraplex_resident_adapters {float(resident)}"]
    assert_metrics_show(cluster, expected)

    # the same requests on the single-process server give the same text
    single = start_server(tiny_llama, tmp_path / "single", **SHARED)
    try:
        single_tenant = single.tenant("single")
        for name in ADAPTERS:
            single.register(name, adapter_dirs[name], single_tenant)
        single_key = single.key(single_tenant)
        for (name, prompt), text in outputs.items():
            assert complete(single, single_key, name, prompt) == text, (name, prompt)
    finally:
        single.stop()


def test_registered_adapters_reach_every_replica_and_deleted_ones_leave_them(
    cluster, tenant, adapter_dirs
):
    tenant_id, key = tenant
    adapter = cluster.register("late", adapter_dirs["late"], tenant_id)
    complete(cluster, key, "late", PROMPTS[1])  # servable at once
    cluster.admin_ok("POST", f"/adapters/{adapter['id']}/pin")  # pinned: on every replica
    # a replica acts within one registry poll (0.25 s); what it holds shows in its next report
    # (every 0.5 s), read by the ingress every 0.5 s: seen here within 2 s
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        holding = holding_replicas(cluster, adapter["id"])
        if len(holding) == 2:
            break
        time.sleep(0.1)
    assert len(holding) == 2, "the pin did not reach both replicas"

    # both replicas serve it (Ray routes it to either: both hold it)
    before = settled(cluster)
    texts = asyncio.run(concurrent_completions(cluster, key, ["late"] * 16, PROMPTS[1]))
    assert len(set(texts)) == 1
    after = reports_counting(cluster, adapter_requests(before) + 16)
    served = {r: after[r]["adapter_requests"] - before[r]["adapter_requests"] for r in after}
    assert all(count > 0 for count in served.values()), served

    # deleted: refused within a second by both ingress replicas (at once by the one that
    # deleted it), and gone from both engine replicas
    cluster.admin_ok("DELETE", f"/adapters/{adapter['id']}")
    time.sleep(1.0)
    deadline = time.monotonic() + 2.0  # one poll, then the reports (as above)
    while time.monotonic() < deadline:
        holding = holding_replicas(cluster, adapter["id"])
        if not holding:
            break
        time.sleep(0.1)
    assert not holding, "a replica still holds the deleted adapter"
    for _ in range(4):  # whichever ingress replica answers
        with pytest.raises(openai.NotFoundError):
            complete(cluster, key, "late", PROMPTS[1])


async def concurrent_completions(server, key, models, prompt, concurrency=4) -> list[str]:
    client = openai.AsyncOpenAI(base_url=server.api, api_key=key, max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def one(model):
        async with gate:
            reply = await client.completions.create(
                model=model, prompt=prompt, max_tokens=8, temperature=0
            )
            return reply.choices[0].text

    try:
        return await asyncio.gather(*(one(m) for m in models))
    finally:
        await client.close()


def test_limits_and_revocations_hold_across_ingress_replicas(cluster):
    tenant_id = cluster.tenant("ray-limits")
    key = cluster.key(tenant_id, requests_per_minute=5)
    statuses = []
    for _ in range(10):  # Ray's proxy spreads these over both ingress replicas
        reply = httpx.post(
            f"{cluster.api}/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={"model": "llama", "prompt": "hi", "max_tokens": 2},
            timeout=60,
        )
        statuses.append(reply.status_code)
    assert statuses.count(200) == 5 and statuses.count(429) == 5, statuses

    other = cluster.key(tenant_id)
    complete(cluster, other, "llama", "hi", 2)
    key_id = cluster.admin_ok("GET", f"/tenants/{tenant_id}/keys")["data"][-1]["id"]
    cluster.admin_ok("DELETE", f"/keys/{key_id}")
    time.sleep(1.0)
    for _ in range(6):
        with pytest.raises(openai.AuthenticationError):
            complete(cluster, other, "llama", "hi", 2)


async def stream(
    client: httpx.AsyncClient, url: str, key: str, model: str, i: int, under_way: set | None = None
) -> dict:
    """One streamed chat completion -> its status, events and how it ended; `i` joins
    `under_way` once its first event has arrived."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"story {i}"}],
        "max_tokens": 400,  # long enough to be under way whatever the CPU
        "stream": True,
        "ignore_eos": True,
    }
    events = []
    async with client.stream(
        "POST", url, json=body, headers={"Authorization": f"Bearer {key}"}
    ) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if under_way is not None:
                    under_way.add(i)
        status = reply.status_code
    errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
    tokens = sum(
        1
        for e in events
        if e.startswith("{")
        and "error" not in e
        and json.loads(e)["choices"]
        and json.loads(e)["choices"][0]["delta"].get("content")
    )
    return {"status": status, "done": events[-1:] == ["[DONE]"], "errors": errors, "tokens": tokens}


def test_a_replica_killed_mid_run_fails_only_its_streams_and_is_replaced(cluster, tenant, report):
    tenant_id, key = tenant
    usage_before = usage_requests(cluster, tenant_id)
    replicas_before = set(by_replica(cluster))
    url = f"{cluster.api}/chat/completions"
    killed_at = 0.0
    under_way: set[int] = set()

    async def run() -> tuple[list[dict], list[dict]]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(60)) as client:
            running = [
                asyncio.create_task(stream(client, url, key, ADAPTERS[i % 6], i, under_way))
                for i in range(8)
            ]
            # every stream under way (a fixed pause ran past the fast); one that ended without
            # output fails below rather than holding the kill back
            while len(under_way) < 8 and not any(task.done() for task in running):
                await asyncio.sleep(0.01)
            nonlocal killed_at
            os.kill(replica_pids()[0], signal.SIGKILL)
            killed_at = time.monotonic()
            later = [
                asyncio.create_task(stream(client, url, key, ADAPTERS[i % 6], i))
                for i in range(8, 16)
            ]
            return await asyncio.gather(*running), await asyncio.gather(*later)

    started = time.monotonic()
    first, second = asyncio.run(asyncio.wait_for(run(), 120))  # nobody hangs
    elapsed = time.monotonic() - started
    for result in first + second:
        assert result["status"] == 200 and result["done"], result
    cut = [r for r in first if r["errors"]]
    assert cut, "no stream was running on the killed replica"
    for result in cut:  # an OpenAI-shaped error event, after some output
        assert result["errors"][0]["type"] == "server_error" and result["errors"][0]["message"]
    for result in [r for r in first if not r["errors"]] + second:
        assert result["tokens"] > 0 and not result["errors"], result

    # Ray replaces the replica (a new one reports, the dead one's report lapses); both serve
    deadline = time.monotonic() + 90
    while (replicas := set(by_replica(cluster))) == replicas_before or len(replicas) != 2:
        assert time.monotonic() < deadline, replicas
        time.sleep(0.2)
    recovered = time.monotonic() - killed_at
    assert len(replica_pids()) == 2
    complete(cluster, key, ADAPTERS[0], PROMPTS[0])
    report(
        f"Ray Serve, one engine replica killed mid-run: {len(cut)} of 8 running streams ended "
        f"with an error event, the other {8 - len(cut)} and 8 sent after the kill completed "
        f"({elapsed:.1f} s in all); 2 replicas reporting again {recovered:.1f} s after the kill"
    )
    # one usage row per call, however many replicas a call tried
    assert usage_requests(cluster, tenant_id, usage_before + 17) == usage_before + 17


def replica_pids() -> list[int]:
    found = subprocess.run(["pgrep", "-f", REPLICA_PROCESS], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def usage_requests(server, tenant_id: str, expected: int | None = None) -> int:
    """The tenant's usage rows so far; waits for `expected` (rows are flushed in the
    background), and a little longer, so that a row written twice would show."""
    if expected is None:
        time.sleep(1.5)  # rows of calls just made are written
    deadline = time.monotonic() + 10
    while True:
        totals = server.admin_ok("GET", "/usage", params={"tenant_id": tenant_id})["totals"]
        count = totals[0]["requests"] if totals else 0
        if expected is None or count >= expected or time.monotonic() > deadline:
            if expected is not None:
                time.sleep(1.0)
                totals = server.admin_ok("GET", "/usage", params={"tenant_id": tenant_id})
                count = totals["totals"][0]["requests"]
            return count
        time.sleep(0.2)
