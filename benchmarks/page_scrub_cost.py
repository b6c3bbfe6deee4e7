"""What wiping freed pages costs, measured side by side in one run.

    python benchmarks/page_scrub_cost.py        # SmolLM2, 32 requests, 64 prompt + 64 new tokens

The page pool zeroes every page it takes back, so that stale or non-finite values never reach
the next owner. This runs the same offline batch with the wipe and without it (the benchmark
swaps the pool's `free` for one that skips the wipe), in a roomy pool and in a tight one that
preempts often (more pages freed per token), alternating runs and keeping each side's best.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from loraplex import LLM, SamplingParams
from loraplex.engine.pool import PagePool


@contextlib.contextmanager
def without_wipe():
    wiping_free = PagePool.free

    def free(self, pages):
        self._free.extend(reversed(pages))

    PagePool.free = free
    try:
        yield
    finally:
        PagePool.free = wiping_free


def prompts_for(llm: LLM, count: int, length: int) -> list[list[int]]:
    text = " ".join(f"Line {i}: the lighthouse keeper counted the ships at sea." for i in range(40))
    ids = llm.tokenizer.encode(text)
    return [ids[i : i + length] for i in range(count)]


def tokens_per_second(llm: LLM, prompts, new_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    preempted = llm.engine.num_preemptions
    start = time.perf_counter()
    llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return len(prompts) * new_tokens / seconds, llm.engine.num_preemptions - preempted


def page_wipe_seconds(pool: PagePool, runs: int = 200) -> float:
    pages = pool.allocate(1)
    start = time.perf_counter()
    for _ in range(runs):
        pool.free(pages)
        pages = pool.allocate(1)
    pool.free(pages)
    return (time.perf_counter() - start) / runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    pools = {"roomy pool (2 GiB)": {}, "tight pool (24 pages)": {"num_pages": 24}}
    for name, options in pools.items():
        llm = LLM(model=args.model, **options)
        prompts = prompts_for(llm, args.requests, 64)
        tokens_per_second(llm, prompts[:2], 4)  # warm up
        best = {"wipe": 0.0, "no wipe": 0.0}
        preemptions = 0
        for _ in range(args.rounds):
            rate, preemptions = tokens_per_second(llm, prompts, args.new_tokens)
            best["wipe"] = max(best["wipe"], rate)
            with without_wipe():
                best["no wipe"] = max(
                    best["no wipe"], tokens_per_second(llm, prompts, args.new_tokens)[0]
                )
        wipe_us = page_wipe_seconds(llm.engine.pool) * 1e6
        print(
            f"{name}: {best['wipe']:.1f} tok/s with the wipe, {best['no wipe']:.1f} without "
            f"-> {best['wipe'] / best['no wipe']:.3f}x; {preemptions} preemptions per run; "
            f"one page ({llm.engine.pool.page_bytes / 2**20:.2f} MiB) wiped in {wipe_us:.0f} us"
        )


if __name__ == "__main__":
    main()
