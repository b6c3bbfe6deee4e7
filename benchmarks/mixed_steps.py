"""Steps with a prompt chunk beside decode tokens, as a server under steady arrivals runs them.

    python benchmarks/mixed_steps.py [--dtype auto] [--rounds 6] [--steps 120]
                                     [--against REV [--define NAME ...] [--undefine NAME ...]]

A request arrives every step (a 64-token prompt, 32 new tokens, greedy, EOS ignored), each on
the next of 32 distinct rank-16 adapters. Once the first have started, every step holds one
prompt beside about 31 decode tokens: more rows than a decode step (NATIVE_LINEAR_MAX_ROWS).

Where the native projection takes such steps and fetches, it brings the step's LoRA rows into
cache while it computes, as in a decode step. That is bfloat16 on Zen 4 and 5 and in the FMA
build, and float32 on Zen 2 and 5. Without the fetch, the decode tokens' rows come from memory
during the LoRA call, one adapter's after another's.

For 32 q,v adapters and for 32 all-module ones, this times runs of `--steps` such steps each
way: with that fetch (`fetching`, the engine's) and with fetches in decode-sized steps alone
(`decode only`, as before). It also times the base model alone on the same arrivals. The
runs are alternated in one process, each on prompts of its own.

With `--against REV` it also times the kernels' C sources as they are at git revision REV
(kernel_ab.py builds them), with the fetch; the step's decoder layers then run one by one in
every way (not in one native call), so that the builds' LoRA calls swap from Python.
--define NAME[=VALUE] builds REV with that macro too, --undefine NAME leaves one of this
machine's flags out (kernel_ab.build_at): `--against HEAD --define BF16_SHARE_BLOCK=8` times
another split of a bfloat16 call's tokens against the engine's (F32_SHARE_BLOCK in float32;
cpu/lora.c).

It prints each way's median time and the median of the rounds' ratios against the engine's
way. For q,v it also prints throughput against the base model under these arrivals.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from engine_throughput import make_prompts
from kernel_ab import LoRACalls, add_macro_options, build_against
from lora_floor import ALL, QV, load_random_adapters

PROMPT_TOKENS = 64
NEW_TOKENS = 32


def arrivals(engine, prompts, loras, steps: int) -> float:
    """Seconds of `steps` steps, one new request added before each (request i on
    loras[i mod len(loras)], the base model where there are none); the requests left are then
    run to their end, untimed."""
    from loraplex import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    started = time.perf_counter()
    for i in range(steps):
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(engine.make_request(prompts[i], params, lora=lora))
        engine.step()
    seconds = time.perf_counter() - started
    while engine.has_unfinished():
        engine.step()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--against", help="git revision of the kernels to time beside")
    add_macro_options(parser)
    args = parser.parse_args()
    if (args.define or args.undefine) and not args.against:
        parser.error("--define and --undefine are for --against REV's build")
    torch.set_num_threads(args.threads)

    from loraplex import LLM
    from loraplex.engine.default_model import resolve_model
    from loraplex.engine.device import Linear
    from loraplex.kernels import cpu_lora

    model_dir = resolve_model(args.model)
    fetching = Linear.fetches_rows
    ways = {"fetching": fetching, "decode only": Linear.fetches_decode_rows}
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        other, label = build_against(args, Path(tmp)) if args.against else (None, None)
        for name, modules in (("q,v", QV), ("all-module", ALL)):
            llm = LLM(model=str(model_dir), dtype=args.dtype, max_num_batched_tokens=256)
            engine, folder = llm.engine, Path(tmp) / name
            loras = load_random_adapters(llm, modules, 32, folder)
            kinds = [*ways, "base"] if name == "q,v" else list(ways)
            builds = {}
            if other is not None:
                engine.runner.model.fuse_layers = False  # the LoRA calls from Python
                torch_dtype = engine.config.torch_dtype
                builds = {
                    "fetching": LoRACalls.of_library(cpu_lora.library(), torch_dtype),
                    label: LoRACalls.of_library(other, torch_dtype),
                }
                kinds.insert(2, label)
            count = args.steps * (len(kinds) * args.rounds + 1)
            prompts = make_prompts(llm.tokenizer, count, PROMPT_TOKENS)
            batches = iter(prompts[i : i + args.steps] for i in range(0, count, args.steps))
            arrivals(engine, next(batches), loras, args.steps)  # warm up
            figures: dict[str, list[float]] = {kind: [] for kind in kinds}
            try:
                for r in range(args.rounds):
                    for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                        Linear.fetches_rows = ways.get(kind, fetching)
                        if builds:  # the run's kernels: REV's, else the working tree's
                            builds.get(kind, builds["fetching"]).use_for(torch_dtype)
                        on = None if kind == "base" else loras
                        figures[kind].append(arrivals(engine, next(batches), on, args.steps))
            finally:
                Linear.fetches_rows = fetching
                if builds:
                    builds["fetching"].use_for(torch_dtype)
            dtype = engine.config.dtype
            # whether a step of one prompt beside 31 decode tokens fetches at all here
            fetches = engine.runner.model.layers[0].qkv.fetches_rows(PROMPT_TOKENS + 31)
            results[name] = figures
            del llm, engine  # one model at a time

    print(
        f"model {model_dir.name}, {dtype}, {args.threads} threads; a {PROMPT_TOKENS}-token "
        f"request arriving every step ({NEW_TOKENS} new tokens each) on 32 distinct rank-16 "
        f"adapters; {args.steps} steps a run, {args.rounds} rounds, medians"
    )
    if not fetches:
        print("(the native projection does not fetch in such steps on this CPU and dtype)")
    width = max(len(kind) for figures in results.values() for kind in figures)
    for name, figures in results.items():
        engine_way = figures["fetching"]
        for kind, seconds in figures.items():
            ratios = [s / e for s, e in zip(seconds, engine_way, strict=True)]
            print(
                f"{name:10s} {kind:{width}s} {statistics.median(seconds):7.2f} s "
                f"({args.steps / statistics.median(seconds):5.1f} steps/s); time against "
                f"fetching {statistics.median(ratios):.3f}x; runs "
                + " ".join(f"{s:.2f}" for s in seconds)
            )
        if "base" in figures:
            ratios = [b / f for b, f in zip(figures["base"], engine_way, strict=True)]
            print(
                f"{name} adapters against the base model, throughput: "
                f"{statistics.median(ratios):.3f}x (target >= 0.95x for decoding; these steps "
                f"also carry a prompt chunk each)"
            )


if __name__ == "__main__":
    main()
