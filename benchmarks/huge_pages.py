"""The page pool in 2 MiB pages against 4 KiB pages, side by side in one run.

    python benchmarks/huge_pages.py [--dtype float32|bfloat16|auto]

Two engines in one process, alike but for how their page pool is backed: 4 KiB pages (what
`torch.zeros` gets on Linux, whose transparent huge pages most distributions give only to memory
that asks) and 2 MiB pages (the pool as the engine now allocates it, device.zeros_in_huge_pages).
Each decodes 32 sequences (64 prompt tokens) with 32 distinct rank-16 adapters on all seven
projections, then the same with no adapter; their decode steps alternate (one of each engine in
turn), so the machine's drift falls on both alike. Decode reads keys, values and adapter rows at
scattered places of the pool, where every 4 KiB page costs a TLB miss.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from engine_throughput import make_prompts
from lora_floor import ALL


def huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as rollup:
        return int(rollup.read().split("AnonHugePages:")[1].split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import loraplex.engine.pool as pool_module
    from loraplex import LLM, LoRARequest, SamplingParams
    from loraplex.engine.adapters.peft_format import random_peft_adapter
    from loraplex.engine.default_model import resolve_model

    model_dir = resolve_model(args.model)
    n = args.sequences
    engines, loras = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("4 KiB", "2 MiB"):
            allocate = pool_module.zeros_in_huge_pages
            if name == "4 KiB":
                pool_module.zeros_in_huge_pages = lambda shape, dtype, device: torch.zeros(
                    shape, dtype=dtype, device=device
                )
            before = huge_kib()
            try:
                llm = LLM(model=str(model_dir), dtype=args.dtype, max_num_batched_tokens=256)
            finally:
                pool_module.zeros_in_huge_pages = allocate
            pool = llm.engine.pool.data
            print(
                f"{name} engine: pool {pool.numel() * pool.element_size() / 2**20:.0f} MiB, "
                f"{(huge_kib() - before) / 1024:.0f} MiB of it in huge pages"
            )
            engines[name] = llm
        config = engines["4 KiB"].engine.model_config
        for i in range(n):
            path = random_peft_adapter(Path(tmp) / f"a{i}", config, 16, ALL, seed=i)
            loras.append(LoRARequest(f"a{i}", str(path)))
        prompts = make_prompts(engines["4 KiB"].tokenizer, n, 64)
        dtype = engines["4 KiB"].engine.config.dtype
        results = {}
        for case, with_loras in (("32 adapters", True), ("base only", False)):
            times = {name: [] for name in engines}
            params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
            for llm in engines.values():
                for i, prompt in enumerate(prompts):
                    lora = loras[i] if with_loras else None
                    llm.engine.add_request(llm.engine.make_request(prompt, params, lora=lora))
            for llm in engines.values():  # prefills, out of the timing
                started: set[str] = set()
                while len(started) < n:
                    started |= {delta.request_id for delta in llm.engine.step()}
            for step in range(args.steps):
                order = list(engines) if step % 2 else list(engines)[::-1]
                for name in order:
                    started = time.perf_counter()
                    engines[name].engine.step()
                    times[name].append(time.perf_counter() - started)
            for llm in engines.values():
                while llm.engine.has_unfinished():
                    llm.engine.step()
            results[case] = {name: statistics.median(t) for name, t in times.items()}

    print(
        f"\nmodel {model_dir.name}, {dtype}, {args.threads} threads, {n} sequences decoding; "
        f"median decode step over {args.steps} alternated steps"
    )
    for case, medians in results.items():
        small, huge = medians["4 KiB"], medians["2 MiB"]
        print(
            f"{case:12s} 4 KiB pages {small * 1e3:7.2f} ms   2 MiB pages {huge * 1e3:7.2f} ms   "
            f"speed-up {small / huge:.3f}x"
        )


if __name__ == "__main__":
    main()
