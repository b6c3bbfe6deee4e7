"""Prefix caching, on against off, measured side by side in one run.

    python benchmarks/prefix_cache.py [--dtype auto|float32|bfloat16]

Workload: 8 tenants, each with its own adapter (rank 16 on q,v) and its own 512-token system
prompt; each tenant's client sends 8 requests one after another (64 in all), each a short user
turn after the system prompt, 32 new tokens, greedy. The 8 clients run at once, through
AsyncEngine. Prints time to first token (p50, p90) and throughput with the cache on and off, and
their ratios, and whether both runs' outputs are equal (they must be in float32; in bfloat16 a
batch of another shape may round differently and flip a near-tie).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

TENANTS = 8
REQUESTS_PER_TENANT = 8
SYSTEM_TOKENS = 512
NEW_TOKENS = 32
WORDS = (
    "harbour tide ferry ticket cargo crane pier anchor rope lantern gull storm chart compass "
    "keeper beacon channel hull deck mast sail oar net dock quay berth buoy current reef"
).split()


def system_prompt(tokenizer, rng: random.Random) -> list[int]:
    ids: list[int] = []
    while len(ids) < SYSTEM_TOKENS:
        ids += tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(64)))
    return ids[:SYSTEM_TOKENS]


async def run(config, jobs) -> dict:
    from loraplex.engine.api import AsyncEngine, SamplingParams

    engine = AsyncEngine(config)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ttfts: list[float] = []
    outputs: dict[tuple[int, int], list[int]] = {}

    async def one(key, prompt, lora) -> None:
        started = time.perf_counter()
        tokens: list[int] = []
        async for delta in engine.generate(prompt, params, lora=lora):
            if not tokens and delta.outputs and delta.outputs[0].token_ids:
                ttfts.append(time.perf_counter() - started)
            for out in delta.outputs:
                tokens += out.token_ids
        outputs[key] = tokens

    async def client(tenant: int) -> None:
        for i, (prompt, lora) in enumerate(jobs[tenant]):
            await one((tenant, i), prompt, lora)

    await client(0)  # warm-up: first load of an adapter, first step
    ttfts.clear()
    started = time.perf_counter()
    await asyncio.gather(*(client(t) for t in range(TENANTS)))
    seconds = time.perf_counter() - started
    hits = engine.stats().num_prefix_hit_tokens
    engine.shutdown()
    generated = sum(len(v) for k, v in outputs.items())
    return {"ttfts": ttfts, "tok_s": generated / seconds, "outputs": outputs, "hits": hits}


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    from loraplex.engine.adapters.peft_format import random_peft_adapter
    from loraplex.engine.api import EngineConfig, LoRARequest
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.default_model import resolve_model
    from loraplex.engine.tokenizer import TokenizerWrapper

    model_dir = resolve_model(args.model)
    tokenizer = TokenizerWrapper(model_dir)
    rng = random.Random(0)
    config = ModelConfig.from_dir(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for tenant in range(TENANTS):
            path = random_peft_adapter(Path(tmp) / f"t{tenant}", config, 16, seed=tenant)
            lora = LoRARequest(f"tenant-{tenant}", str(path))
            system = system_prompt(tokenizer, rng)
            turns = [
                tokenizer.encode(f" Question {i}: where is the {rng.choice(WORDS)}?")
                for i in range(REQUESTS_PER_TENANT)
            ]
            jobs.append([(system + turn, lora) for turn in turns])
        results = {}
        for caching in (True, False):
            engine_config = EngineConfig(
                model=str(model_dir),
                dtype=args.dtype,
                memory_budget="2GiB",
                enable_prefix_caching=caching,
            )
            results[caching] = asyncio.run(run(engine_config, jobs))

    on, off = results[True], results[False]
    same = on["outputs"] == off["outputs"]
    print(
        f"model {model_dir.name}, {EngineConfig(dtype=args.dtype).dtype}, {TENANTS} tenants x "
        f"{REQUESTS_PER_TENANT} requests, {SYSTEM_TOKENS}-token system prompts, {NEW_TOKENS} "
        "new tokens, one adapter per tenant"
    )
    print("                 TTFT p50    TTFT p90    tok/s   prefix hits (tokens)")
    for name, r in (("cache on ", on), ("cache off", off)):
        p50, p90 = percentile(r["ttfts"], 50) * 1000, percentile(r["ttfts"], 90) * 1000
        print(f"  {name}     {p50:7.1f} ms  {p90:7.1f} ms  {r['tok_s']:7.1f}   {r['hits']}")
    ttft_gain = percentile(off["ttfts"], 50) / percentile(on["ttfts"], 50)
    speedup = on["tok_s"] / off["tok_s"]
    print(f"  TTFT p50 off/on: {ttft_gain:.2f}x   throughput on/off: {speedup:.2f}x")
    print(f"  outputs equal with and without the cache: {same}")


if __name__ == "__main__":
    main()
