"""Multi-adapter decode steps against the memory-bandwidth floor, measured side by side in one run.

    python benchmarks/lora_floor.py [--dtype float32|bfloat16|auto]

A decode step of 32 sequences has to read every distinct adapter's weights once at least, so its
extra time over a base-only step cannot go below (adapter bytes read) / (memory bandwidth). This
prints, for 32 sequences decoding together (64 prompt tokens each, then steady decode steps):

* the box's read bandwidth (a sum over a 1 GiB tensor, larger than any cache, all threads);
* the step time on the base model alone, and with 32 distinct rank-16 adapters on q,v and on all
  seven projections; the adapter bytes each step reads; the floor they imply; the extra step time
  over base as a multiple of that floor (target <= 1.25x for all-module) and the q,v batch's
  throughput against base (target >= 0.95x);
* the same batches with the CPU LoRA path's two strategies forced: *gathered* (every decode token's
  adapter rows copied into one buffer, applied with one batched matmul) and *grouped* (each adapter
  applied in place, once for all its tokens), on 32 adapters x 1 token and 8 adapters x 4 tokens.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from engine_throughput import make_prompts

QV = ("q_proj", "v_proj")
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def read_bandwidth(gib: float = 1.0, runs: int = 5) -> float:
    """Bytes/s of a streaming read (torch sum over a tensor no cache holds), best of `runs`."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    x.sum()
    best = min(_timed(x.sum) for _ in range(runs))
    return x.numel() * 4 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_step_seconds(engine, prompts, loras, steps: int) -> float:
    """Median time of `steps` decode steps once every sequence is past its prefill."""
    from loraplex import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(engine.make_request(prompt, params, lora=lora))
    started: set[str] = set()
    while len(started) < len(prompts):
        started |= {delta.request_id for delta in engine.step()}
    times = [_timed(engine.step) for _ in range(steps)]
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def adapter_bytes(engine) -> int:
    """Bytes of the weights of every resident adapter, at the pool's dtype."""
    total = 0
    for resident in engine.adapters.resident.values():
        for chunks in (*resident.a_chunks.values(), *resident.b_chunks.values()):
            total += sum(c.numel() * c.element_size() for c in chunks)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import loraplex.engine.adapters.lora_batch as lora_batch
    from loraplex import LLM, LoRARequest
    from loraplex.engine.adapters.peft_format import random_peft_adapter
    from loraplex.engine.default_model import resolve_model

    bandwidth = read_bandwidth()
    model_dir = resolve_model(args.model)
    n = args.sequences

    def engine_with(modules, count, tmp) -> tuple:
        llm = LLM(model=str(model_dir), dtype=args.dtype, max_num_batched_tokens=256)
        config = llm.engine.model_config
        loras = []
        for i in range(count):
            folder = Path(tmp) / f"{len(modules)}-{i}"
            path = random_peft_adapter(folder, config, args.rank, modules, seed=i)
            loras.append(LoRARequest(f"a{i}", str(path)))
            llm.engine.load_adapter(loras[-1])
        return llm, loras

    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        llm, _ = engine_with(QV, 0, tmp)
        prompts = make_prompts(llm.tokenizer, n, 64)
        decode_step_seconds(llm.engine, prompts[:4], None, 4)  # warm up
        results["base"] = decode_step_seconds(llm.engine, prompts, None, args.steps)
        dtype = llm.engine.config.dtype
        del llm
        floors = {}
        for name, modules in (("q,v", QV), ("all", ALL)):
            llm, loras = engine_with(modules, n, tmp)
            decode_step_seconds(llm.engine, prompts[:4], loras[:4], 4)
            floors[name] = adapter_bytes(llm.engine)
            results[name] = decode_step_seconds(llm.engine, prompts, loras, args.steps)
            default = lora_batch.GROUP_MIN_TOKENS
            try:
                for strategy, min_run in (("gathered", n + 1), ("grouped", 1)):
                    lora_batch.GROUP_MIN_TOKENS = min_run
                    for per in (1, 4):
                        key = f"{name} {strategy} {n // per}x{per}"
                        results[key] = decode_step_seconds(
                            llm.engine, prompts, loras[: n // per], args.steps
                        )
            finally:
                lora_batch.GROUP_MIN_TOKENS = default
            del llm

    base = results["base"]
    print(
        f"model {model_dir.name}, {dtype}, {args.threads} threads; {n} sequences decoding "
        f"together; median of {args.steps} steps; rank {args.rank} adapters"
    )
    print(f"read bandwidth of this box: {bandwidth / 1e9:.1f} GB/s")
    print(f"base-only decode step: {base * 1e3:.2f} ms ({n / base:.0f} tok/s)")
    for name in ("q,v", "all"):
        step, size = results[name], floors[name]
        floor = size / bandwidth
        extra = step - base
        print(
            f"{n} adapters on {name:3s}: step {step * 1e3:6.2f} ms ({n / step:4.0f} tok/s, "
            f"{base / step:.2f}x base); adapter bytes per step {size / 2**20:6.1f} MiB; "
            f"floor {floor * 1e3:5.2f} ms; extra over base {extra * 1e3:6.2f} ms = "
            f"{extra / floor:.2f}x floor"
        )
    print("targets: q,v throughput >= 0.95x base; all-module extra <= 1.25x floor")
    print("strategies (step ms; adapters x tokens per adapter):")
    for key, value in results.items():
        if " " in key and key.split()[1] in ("gathered", "grouped"):
            print(f"  {key:22s} {value * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
