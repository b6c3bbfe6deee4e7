"""The noisy neighbour at the engine's real capacity on SmolLM2: fair shares against first come,
first served, side by side in one run.

    python benchmarks/fair_scheduling.py [--dtype auto|float32|bfloat16] [--slots 32]

Tenant a keeps twice the engine's sequence slots outstanding (64 prompt + 64 new tokens each);
tenant b sends requests one after another (64 prompt + 16 new tokens, half a second apart), all
through AsyncEngine in real time. Printed for each policy: b's time to first token (p50, p99,
mean) and the total throughput while b was sending; and b's TTFT on an idle engine for scale.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from loraplex.engine.api import AsyncEngine, EngineConfig, Fairness, SamplingParams

A_PARAMS = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
B_PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def prompt(seed: int) -> list[int]:
    return [100 + (seed * 131 + i * 17) % 20000 for i in range(64)]


async def b_requests(engine: AsyncEngine, count: int, pause: float) -> list[float]:
    waits = []
    for i in range(count):
        started = time.perf_counter()
        first = None
        async for _ in engine.generate(prompt(10_000 + i), B_PARAMS, fairness=Fairness("b")):
            first = first or time.perf_counter()
        waits.append(first - started)
        await asyncio.sleep(pause)
    return waits


async def noisy(engine: AsyncEngine, slots: int, count: int, pause: float):
    tokens = 0
    stop = asyncio.Event()

    async def tenant_a(worker: int) -> None:
        nonlocal tokens
        n = 0
        while not stop.is_set():
            n += 1
            stream = engine.generate(prompt(worker * 1000 + n), A_PARAMS, fairness=Fairness("a"))
            async for delta in stream:
                tokens += len(delta.outputs[0].token_ids)
                if stop.is_set():
                    break

    workers = [asyncio.create_task(tenant_a(w)) for w in range(2 * slots)]
    await asyncio.sleep(10.0)  # a's flood reaches its steady state
    start_tokens, started = tokens, time.perf_counter()
    waits = await b_requests(engine, count, pause)
    elapsed = time.perf_counter() - started
    # b's tokens are few (16 a request): counted with a's in the throughput
    total = tokens - start_tokens + count * B_PARAMS.max_tokens
    stop.set()
    await asyncio.gather(*workers, return_exceptions=True)
    return waits, total / elapsed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def line(name: str, waits: list[float], throughput: float | None = None) -> str:
    text = (
        f"{name:<24} b TTFT p50 {percentile(waits, 0.5) * 1e3:8.1f} ms  p99 "
        f"{percentile(waits, 0.99) * 1e3:8.1f} ms  mean {statistics.mean(waits) * 1e3:8.1f} ms"
    )
    if throughput is not None:
        text += f"   total {throughput:6.1f} tok/s"
    return text


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    results, dtype = {}, ""
    for policy in ("fair", "fcfs"):
        engine = AsyncEngine(
            EngineConfig(dtype=args.dtype, max_num_seqs=args.slots, scheduling_policy=policy)
        )
        dtype = engine.model_info().dtype
        try:
            if policy == "fair":
                await b_requests(engine, 2, 0.0)  # warm-up
                results["idle"] = (await b_requests(engine, args.requests, 0.2), None)
            results[policy] = await noisy(engine, args.slots, args.requests, 0.5)
        finally:
            await engine.aclose()
    print(
        f"SmolLM2 {dtype}, {args.slots} sequence slots; tenant a keeps {2 * args.slots} "
        f"requests outstanding (64 + 64 tokens), tenant b sends {args.requests} (64 + 16 "
        "tokens) one after another"
    )
    print(line("b alone (idle engine)", results["idle"][0]))
    print(line("fair share (default)", *results["fair"]))
    print(line("first come, first served", *results["fcfs"]))
    fair, fcfs, idle = (statistics.mean(results[k][0]) for k in ("fair", "fcfs", "idle"))
    print(
        f"b's mean TTFT: fair {fair / idle:.2f}x idle, fcfs {fcfs / idle:.1f}x idle; "
        f"throughput fair / fcfs {results['fair'][1] / results['fcfs'][1]:.2f}x"
    )


if __name__ == "__main__":
    asyncio.run(main())
