"""A greedy step's pick in one pass over the logits as the model gives them, against the float32
copy, a pass to find the rows that are not finite and the argmax, alternated in one process.

    python benchmarks/greedy_pick.py [--dtype auto|bfloat16|float32] [--rounds 6]

Workload: SmolLM2 on the base model, 32 sequences decoding together (64-token prompts, greedy,
EOS ignored). The engine's way (Sampler.greedy: cpu/ops.c's argmax, reading bfloat16 logits
widened, with each row's finiteness from the same pass) and the way before it (Sampler.greedy
off: the logits copied to float32, a sum a row for finiteness, then the argmax) take turns step
by step, then whole runs of 32 requests of 64 new tokens take turns, `--rounds` pairs, each run
on prompts of its own. Prints the medians and the paired differences and ratios. Both ways pick
the same tokens (tests/kernels: the pass's picks are the float32 argmax's).

First, the same two ways timed alone on 32 rows of random logits of SmolLM2's vocabulary, read
from L3 (a 64 MiB read between calls), in this machine's build of the kernels and in the build
for x86-64-v3 (AVX2 without AVX-512, the path of Zen 2 and 3), float32 and bfloat16.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from engine_throughput import make_prompts
from kernel_ab import build_at
from lora_floor import add_decoding

SEQUENCES, PROMPT_TOKENS, NEW_TOKENS = 32, 64, 64
VOCAB = 49152  # SmolLM2's


def alone(rounds: int = 100) -> None:
    """The two ways on their own, alternated, in this machine's build and the x86-64-v3 one."""
    from loraplex.kernels import cpu_lora

    flush = torch.ones(16 * 2**20)  # 64 MiB, more than the caches that are the process's own
    with tempfile.TemporaryDirectory() as tmp:
        for march in ("native", "x86-64-v3"):
            (Path(tmp) / march).mkdir()
            argmax = cpu_lora.CpuArgmax(build_at(None, Path(tmp) / march, march=march))
            for dtype in (torch.float32, torch.bfloat16):
                logits = (torch.randn(SEQUENCES, VOCAB) * 4).to(dtype)
                times = _alone_times(argmax, logits, flush, rounds)
                listed = ", ".join(f"{n} {statistics.median(t) * 1e3:.3f} ms" for n, t in times)
                print(f"alone, {march} build, {str(dtype).removeprefix('torch.')}: {listed}")


def _alone_times(argmax, logits: torch.Tensor, flush: torch.Tensor, rounds: int) -> list:
    """[(way, its seconds a call)] for the pass and the float32 copy on `logits`."""

    def copy():
        widened = logits.float()
        bool(torch.isfinite(widened.sum(dim=-1)).all())
        return argmax(widened)

    ways = {"one pass": lambda: argmax.greedy(logits), "float32 copy": copy}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(rounds):
        for name in list(ways) if i % 2 == 0 else list(ways)[::-1]:
            flush.sum()  # the logits out of the cores' caches, as after an LM head
            begun = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - begun)
    return list(times.items())


def paired_steps(llm, batch, names: list[str], use, pairs: int) -> dict[str, list[float]]:
    """The times of `pairs` pairs of decode steps of `batch` decoding together (greedy, EOS
    ignored), use(name) before each step of way `name`, the order alternated; then the batch run
    to its end (with the first way)."""
    engine = llm.engine
    add_decoding(engine, batch, [], 2 * pairs + 24)
    started: set[str] = set()
    while len(started) < len(batch):
        started |= {delta.request_id for delta in engine.step()}
    steps: dict[str, list[float]] = {name: [] for name in names}
    for i in range(pairs):
        for name in names if i % 2 == 0 else names[::-1]:
            use(name)
            begun = time.perf_counter()
            engine.step()
            steps[name].append(time.perf_counter() - begun)
    use(names[0])
    while engine.has_unfinished():
        engine.step()
    return steps


def paired_runs(llm, batches, names: list[str], use) -> dict[str, list[float]]:
    """Output tokens/s of whole runs (NEW_TOKENS each, greedy, EOS ignored), one batch of
    `batches` a run, the ways in turn (use(name) before each), the order alternated."""
    from loraplex import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    runs: dict[str, list[float]] = {name: [] for name in names}
    fresh = iter(batches)
    for i in range(len(batches) // len(names)):
        for name in names if i % 2 == 0 else names[::-1]:
            use(name)
            batch = next(fresh)
            begun = time.perf_counter()
            llm.generate(batch, params)
            runs[name].append(len(batch) * NEW_TOKENS / (time.perf_counter() - begun))
    use(names[0])
    return runs


def print_pairs(
    steps: dict[str, list[float]], runs: dict[str, list[float]], sequences: int = SEQUENCES
) -> None:
    """The two ways' decode steps and whole runs (of `sequences` requests): medians, paired
    differences and ratios."""
    ours, theirs = steps
    differences = [a - b for a, b in zip(steps[ours], steps[theirs], strict=True)]
    print(
        f"decode step: {ours} {statistics.median(steps[ours]) * 1e3:.2f} ms, {theirs} "
        f"{statistics.median(steps[theirs]) * 1e3:.2f} ms, difference "
        f"{statistics.median(differences) * 1e3:+.3f} ms (median of {len(differences)} pairs)"
    )
    ratios = [a / b for a, b in zip(runs[ours], runs[theirs], strict=True)]
    pairs = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(runs[ours], runs[theirs], strict=True))
    print(f"whole runs, tok/s {ours}/{theirs} pair by pair: {pairs}")
    print(
        f"whole runs ({sequences} x {PROMPT_TOKENS} + {NEW_TOKENS} tokens): {ours} "
        f"{statistics.median(runs[ours]):.1f} tok/s, {theirs} {statistics.median(runs[theirs]):.1f}"
        f" tok/s, {statistics.median(ratios):.3f}x (median of {len(ratios)} pairs)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--steps", type=int, default=60, help="pairs of decode steps")
    parser.add_argument("--rounds", type=int, default=6, help="pairs of whole runs")
    args = parser.parse_args()
    torch.set_num_threads(2)
    alone()

    import os

    # the LM head's screen (Zen 3, float32) picks greedy steps without the logits this pass reads
    os.environ.setdefault("LORAPLEX_SCREEN", "0")
    from loraplex import LLM
    from loraplex.engine.sampler import Sampler

    llm = LLM(model="default", dtype=args.dtype)
    one_pass = Sampler.greedy
    ways = {"one pass": one_pass, "float32 copy": lambda *args, **kwargs: None}

    def use(name: str) -> None:
        Sampler.greedy = ways[name]

    prompts = make_prompts(llm.tokenizer, SEQUENCES * (1 + 2 * args.rounds), PROMPT_TOKENS)
    batches = [prompts[i : i + SEQUENCES] for i in range(0, len(prompts), SEQUENCES)]
    steps = paired_steps(llm, batches[0], list(ways), use, args.steps)
    runs = paired_runs(llm, batches[1:], list(ways), use)
    dtype = str(llm.engine.config.torch_dtype).removeprefix("torch.")
    print(f"model SmolLM2, {dtype}, 2 threads, base model, {SEQUENCES} sequences, greedy")
    print_pairs(steps, runs)


if __name__ == "__main__":
    main()
