"""Ray Serve against the single-process server, side by side in one run.

    python benchmarks/ray_scaling.py     # ~8 min: SmolLM2 with its demo adapters, a tiny model

Three servers, started one after another on this machine, each set up alike (a tenant, the demo
adapters `ahoy` and `uppercase`, a key) and measured by the same client in this process, once on
SmolLM2 (throughput) and once on a tiny random model built on the spot (latency, so that the
engine's own time does not hide the routing's):

  single   `loraplex serve`: one process, the engine on 2 threads
  ray-1    `loraplex serve --ray`: Ray's HTTP proxy, 1 ingress replica, 1 engine replica
           (2 threads)
  ray-2    the same with 2 engine replicas of 1 thread each

1. Routing overhead per request (tiny model): 64 short chat requests (4 new tokens) one after
   another; median end-to-end latency of each server, and what the Ray path adds to the single
   process's (proxy -> ingress -> engine replica and back, instead of one process).
2. Throughput (SmolLM2): 48 streaming chat requests at once over the base model and the two
   adapters, 64 new tokens each (ignore_eos); generated tokens per second.

On a 2-core machine two replicas share the same two cores that one replica or the single
process use, so ray-2 cannot beat ray-1 here: the figure shows what the extra processes cost,
not what a second machine would add (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "demo" / "adapters"
sys.path.insert(0, str(ROOT))  # the tiny model and the servers come from the tests' helpers
from tests.platform.servers import Server, start_server  # noqa: E402

QUESTION = "Name one animal that lives in the sea."


def set_up(server: Server, adapters: list[Path]) -> tuple[str, list[str]]:
    """A tenant with the adapters -> (its key, the models to ask)."""
    tenant = server.tenant("bench")
    names = [server.register(path.name, path, tenant)["name"] for path in adapters]
    key = server.key(tenant)
    base = httpx.get(f"{server.api}/models", headers=auth(key)).json()["data"][0]["id"]
    return key, [base, *names]


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def body(model: str, tokens: int, stream: bool) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def latency(url: str, key: str, model: str, count: int) -> float:
    """Median seconds of `count` short requests, one at a time."""
    seconds = []
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(count + 2):
            started = time.perf_counter()
            reply = await client.post(
                f"{url}/v1/chat/completions", json=body(model, 4, False), headers=auth(key)
            )
            reply.raise_for_status()
            if i >= 2:  # the first two warm the path up
                seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


async def throughput(url: str, key: str, models: list[str], count: int, tokens: int) -> float:
    """Generated tokens per second of `count` streaming requests at once."""

    async def one(client: httpx.AsyncClient, model: str) -> int:
        chunks = 0
        payload = body(model, tokens, True)
        async with client.stream(
            "POST", f"{url}/v1/chat/completions", json=payload, headers=auth(key)
        ) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if line.startswith("data: {") and '"content":"' in line:
                    chunks += 1
        return chunks

    limits = httpx.Limits(max_connections=count + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one(client, models[0])  # warm-up
        started = time.perf_counter()
        await asyncio.gather(*(one(client, models[i % len(models)]) for i in range(count)))
        seconds = time.perf_counter() - started
    return count * tokens / seconds


def throughput_of(name: str, server: Server, args) -> float:
    key, models = set_up(server, sorted(p.parent for p in DEMO.glob("*/adapter_config.json")))
    tok_s = asyncio.run(throughput(server.url, key, models, args.concurrency, args.tokens))
    print(f"{name:8s} SmolLM2 throughput {tok_s:7.1f} tok/s", flush=True)
    return tok_s


def latency_of(name: str, server: Server, args) -> float:
    key, models = set_up(server, [])
    seconds = asyncio.run(latency(server.url, key, models[0], args.latency_requests))
    print(f"{name:8s} tiny-model latency {seconds * 1000:6.1f} ms", flush=True)
    return seconds


CONFIGS = [
    ("single", False, {"engine__num_threads": 2}),
    ("ray-1", True, {"engine__num_threads": 2, "ray__engine_replicas": 1, "ray__engine_cpus": 1}),
    ("ray-2", True, {"engine__num_threads": 1, "ray__engine_replicas": 2}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from tests.factories import build_tiny_model, build_tiny_tokenizer

    tok_s, seconds = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_model(
            Path(tmp) / "tiny", "llama", build_tiny_tokenizer(Path(tmp) / "tokenizer")
        )
        for model, measure, figures in (
            ("default", throughput_of, tok_s),
            (tiny, latency_of, seconds),
        ):
            for name, ray, settings in CONFIGS:
                data = Path(tmp) / f"{name}-{measure.__name__}"
                server = start_server(
                    model,
                    data,
                    extra_args=("--ray",) if ray else (),
                    engine__dtype="auto",
                    engine__memory_budget="2GiB",
                    log_requests="false",
                    **settings,
                )
                try:
                    figures[name] = measure(name, server, args)
                finally:
                    server.stop()
    print()
    for name in ("ray-1", "ray-2"):
        extra = (seconds[name] - seconds["single"]) * 1000
        print(
            f"{name}: routing overhead {extra:+.1f} ms a request "
            f"({seconds[name] / seconds['single']:.2f}x the single process's latency), "
            f"throughput {tok_s[name] / tok_s['single']:.2f}x single"
        )
    ratio = tok_s["ray-2"] / tok_s["ray-1"]
    print(f"2 replicas / 1 replica throughput: {ratio:.2f}x (the same 2 cores: flat expected)")


if __name__ == "__main__":
    main()
