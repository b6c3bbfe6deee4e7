"""What the HTTP platform costs on top of the engine, measured side by side in one run.

    python benchmarks/api_overhead.py     # SmolLM2: 64 short requests; 32 streams, 32 adapters

The server (uvicorn + the FastAPI app, SQLite registry) runs in this process on the engine it
starts; "direct" drives that same engine through AsyncEngine with the same prompts and parameters,
so the difference is the platform alone: HTTP, auth, limits, model resolution, JSON and SSE.

1. Latency: 64 short chat requests, one at a time, from a client in a separate process
   (non-streaming, httpx), then the same requests direct (chat template + AsyncEngine.generate).
   The platform's overhead is measured exactly, per request: the server's time for it (from its
   arrival at the ASGI app to the last byte of the reply) minus the time the same request spent
   inside AsyncEngine.generate. So it holds HTTP parsing, auth, limits, model resolution, the
   chat template and the JSON reply, and none of the engine's run-to-run noise. Also prints
   both end-to-end latencies.
2. Throughput: 32 concurrent streaming clients, each on its own adapter (32 rank-16 adapters),
   64 new tokens each, through HTTP (the clients run in a separate process) and direct; prints
   tokens/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import uvloop

QUESTION = "Name one animal that lives in the sea."
SHORT_TOKENS = 4  # new tokens of each latency request


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the clients (a separate process) --------------------------------------------------------


def chat_body(model: str, new_tokens: int, stream: bool) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def sequential_client(url: str, key: str, model: str, count: int) -> dict:
    """`count` short chat requests one after another on one keep-alive connection -> each
    one's latency as seen here. A bare socket client, each request written at once, so that the
    server's time holds none of a client library's pauses between headers and body."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(chat_body(model, SHORT_TOKENS, stream=False)).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    request = head.encode() + body
    reader, writer = await asyncio.open_connection(host, int(port))
    seconds = []
    for _ in range(count):
        started = time.perf_counter()
        writer.write(request)
        status = await reader.readline()
        length = 0
        while (line := await reader.readline()) != b"\r\n":
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        reply = await reader.readexactly(length)
        seconds.append(time.perf_counter() - started)
        assert b" 200 " in status, reply
    writer.close()
    return {"seconds": seconds}


async def stream_clients(url: str, key: str, models: list[str], new_tokens: int) -> dict:
    """One streaming chat request per model, all at once -> tokens and seconds."""
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=len(models) + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as c:

        async def one(model: str) -> int:
            body = chat_body(model, new_tokens, stream=True)
            tokens = 0
            async with c.stream("POST", "/v1/chat/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith('data: {"id"') and '"usage":{' in line:
                        tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            return tokens

        started = time.perf_counter()
        counts = await asyncio.gather(*(one(m) for m in models))
        return {"tokens": sum(counts), "seconds": time.perf_counter() - started}


def run_client(*args: str) -> dict:
    """Run clients in a separate process at the lowest CPU priority: real clients sit on other
    machines, so these should take no CPU from the server they measure (on 2 cores, a client
    woken by the reply would otherwise preempt the server in mid-send)."""
    command = [sys.executable, __file__, "--client", *args]
    done = subprocess.run(
        command, capture_output=True, text=True, check=True, preexec_fn=lambda: os.nice(19)
    )
    return json.loads(done.stdout)


# -- the measurements ------------------------------------------------------------------------


class ServerClock:
    """ASGI middleware: each HTTP request's time inside the server."""

    def __init__(self, app) -> None:
        self.app = app
        self.times: list[float] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()

        async def timed_send(message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self.times.append(time.perf_counter() - started)

        await self.app(scope, receive, timed_send)


class EngineClock:
    """Wraps an AsyncEngine's generate: each request's time inside it."""

    def __init__(self, engine) -> None:
        self.times: list[float] = []
        generate = engine.generate

        async def timed(*args, **kwargs):
            started = time.perf_counter()
            async for delta in generate(*args, **kwargs):
                yield delta
            self.times.append(time.perf_counter() - started)

        engine.generate = timed


async def latency(platform, clock: ServerClock, url: str, key: str, count: int) -> dict:
    from loraplex.engine.api import SamplingParams

    engine = platform.engine
    inside = EngineClock(engine)
    warm_up = 4
    client = await asyncio.to_thread(
        run_client, "sequential", url, key, platform.base_model, str(count + warm_up)
    )
    del engine.generate  # the engine's own method again
    server = clock.times[-count:]
    times = {
        "client": client["seconds"][warm_up:],
        "server": server,
        "overhead": [s - e for s, e in zip(server, inside.times[-count:], strict=True)],
        "template": [],
        "direct": [],
    }
    messages = [{"role": "user", "content": QUESTION}]
    params = SamplingParams(temperature=0.0, max_tokens=SHORT_TOKENS, ignore_eos=True)
    for i in range(count + warm_up):
        started = time.perf_counter()
        ids = engine.encode_chat(messages)
        template = time.perf_counter() - started
        async for _ in engine.generate(ids, params):
            pass
        if i >= warm_up:
            times["template"].append(template)
            times["direct"].append(time.perf_counter() - started)
    return times


async def direct_streams(platform, loras, new_tokens: int) -> dict:
    from loraplex.engine.api import SamplingParams

    engine = platform.engine
    ids = engine.encode_chat([{"role": "user", "content": QUESTION}])
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    async def one(lora) -> int:
        tokens = 0
        async for delta in engine.generate(ids, params, lora=lora):
            tokens += len(delta.outputs[0].token_ids)
        return tokens

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(lora) for lora in loras))
    return {"tokens": sum(counts), "seconds": time.perf_counter() - started}


def http_streams(url: str, key: str, models: list[str], new_tokens: int) -> dict:
    return run_client("streams", url, key, str(new_tokens), *models)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


async def main_async(args) -> None:
    import uvicorn

    from loraplex.engine.adapters.peft_format import random_peft_adapter
    from loraplex.engine.api import LoRARequest
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.default_model import resolve_model
    from loraplex.platform import registry
    from loraplex.platform.app import create_app
    from loraplex.platform.settings import load_settings

    workdir = Path(tempfile.mkdtemp(prefix="loraplex-bench-"))
    port = free_port()
    token = secrets.token_urlsafe(24)
    settings = load_settings(
        model=args.model, data_dir=workdir, port=port, max_waiting_requests=1024
    )
    app = create_app(settings, token)
    clock = ServerClock(app)
    server = uvicorn.Server(
        uvicorn.Config(clock, host="127.0.0.1", port=port, log_config=None, access_log=False)
    )
    serving = asyncio.create_task(server.serve())
    platform = app.state.platform
    while not platform.ready:
        await asyncio.sleep(0.1)
    url = f"http://127.0.0.1:{port}"
    tenant = await platform.db.run(lambda s: registry.create_tenant(s, "bench"))
    _, key = await platform.db.run(lambda s: registry.create_key(s, tenant.id, "bench"))

    times = await latency(platform, clock, url, key, args.requests)
    print(
        f"latency, {args.requests} short chat requests ({SHORT_TOKENS} new tokens), one at a time:"
    )
    without_template = [o - t for o, t in zip(times["overhead"], times["template"], strict=True)]
    for name, values in (
        ("platform overhead (server time outside AsyncEngine.generate)", times["overhead"]),
        ("  of which the chat template, which a direct caller pays too", times["template"]),
        ("  the rest: HTTP, auth, limits, resolution, JSON", without_template),
        ("HTTP, in the server", times["server"]),
        ("HTTP, as the client saw it", times["client"]),
        ("direct (chat template + AsyncEngine.generate)", times["direct"]),
    ):
        p50, p90 = percentile(values, 50) * 1000, percentile(values, 90) * 1000
        print(f"  {name}: p50 {p50:.2f} ms, p90 {p90:.2f} ms")

    config = ModelConfig.from_dir(resolve_model(args.model))
    headers = {"Authorization": f"Bearer {token}"}
    models, loras = [], []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as admin:
        for i in range(args.adapters):
            path = random_peft_adapter(workdir / "src" / f"a{i}", config, 16, seed=i)
            reply = await admin.post(
                "/admin/v1/adapters", json={"name": f"bench-{i}", "path": str(path)}
            )
            assert reply.status_code == 201, reply.text
            row = reply.json()
            models.append(row["name"])
            loras.append(LoRARequest(row["id"], str(workdir / "adapters" / row["content_hash"])))

    await direct_streams(platform, loras, 8)  # warm-up: loads every adapter into the pool
    best = {"http": 0.0, "direct": 0.0}
    for _ in range(args.rounds):
        http = await asyncio.to_thread(http_streams, url, key, models, args.new_tokens)
        direct = await direct_streams(platform, loras, args.new_tokens)
        best["http"] = max(best["http"], http["tokens"] / http["seconds"])
        best["direct"] = max(best["direct"], direct["tokens"] / direct["seconds"])
    print(
        f"throughput, {args.adapters} streaming clients over {args.adapters} rank-16 adapters, "
        f"{args.new_tokens} new tokens each (best of {args.rounds}):"
    )
    print(f"  HTTP    {best['http']:7.1f} tok/s")
    print(f"  direct  {best['direct']:7.1f} tok/s")
    print(f"  HTTP / direct: {best['http'] / best['direct']:.3f}x")
    server.should_exit = True
    await serving


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        mode, url, key, *rest = sys.argv[2:]
        if mode == "sequential":
            model, count = rest
            result = asyncio.run(sequential_client(url, key, model, int(count)))
        else:
            new_tokens, *models = rest
            result = asyncio.run(stream_clients(url, key, models, int(new_tokens)))
        print(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    uvloop.run(main_async(parser.parse_args()))  # the event loop uvicorn serves with


if __name__ == "__main__":
    main()
