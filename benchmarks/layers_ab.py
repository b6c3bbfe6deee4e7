"""Two builds of the CPU kernels' decoder layers compared in one process, decode step by step.

    python benchmarks/layers_ab.py --against REV [--dtype bfloat16|float32] [--rounds 100]
                                   [--adapters N --modules qv|all] [--define NAME ...]
                                   [--undefine NAME ...]

kernel_ab.py swaps a build's LoRA calls alone; this swaps the native call that runs every
decoder layer of a decode step (cpu/layers.c: the projections, norms, rotary embedding,
attention and LoRA calls of its build), for changes to any of them. Builds the kernels' C
sources as they are at git revision REV into a library of its own, then runs 32 sequences
decoding together (SmolLM2, 64-token prompts, greedy, EOS ignored), on the base model or, with
--adapters N, on N random rank-16 adapters in turn: each round takes one step with each build,
their order alternating, and it prints each build's median step and the median of the paired
differences. Everything outside the layers (the embedding, the LM head, sampling, the
scheduler) is the working tree's in both, and so are the structures the call takes
(cpu_lora.DecoderLayer, DecoderStep, LayerLoRA): REV must take the same ones.

--define NAME builds REV with the macro NAME defined too, beside this machine's flags
(cpu_lora.build_flags): with REV the working tree's own commit, the two builds differ by that
macro alone, e.g. `--against HEAD --dtype float32 --define F32_FETCH_NEXT` measures the float32
attention's fetch of the next sequence on a CPU that does not take it. --undefine NAME leaves a
macro of this machine's flags out of REV's build: `--against HEAD --dtype float32 --undefine
F32_TALL_TILE --undefine F32_FETCH_NEXT` measures both against neither on an Intel Xeon.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
from pathlib import Path

import torch
from engine_throughput import make_prompts
from kernel_ab import add_macro_options, against, alternate, build_against
from lora_floor import ALL, QV, add_decoding, load_random_adapters


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", required=True, help="git revision of the other build")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=0, help="0: the base model alone")
    parser.add_argument("--modules", choices=("qv", "all"), default="qv")
    add_macro_options(parser)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from loraplex import LLM
    from loraplex.engine.default_model import resolve_model
    from loraplex.engine.fetch_placement import ROUNDS
    from loraplex.kernels import cpu_lora

    n = args.sequences
    with tempfile.TemporaryDirectory() as tmp:
        library, label = build_against(args, Path(tmp))
        other = cpu_lora.CpuDecoderLayers(library)
        llm = LLM(model=str(resolve_model("default")), dtype=args.dtype)
        engine = llm.engine
        modules = QV if args.modules == "qv" else ALL
        loras = load_random_adapters(llm, modules, args.adapters, Path(tmp))
        # past the prefills and the model's first timing of how rows are fetched (3 ways at most)
        warmup = 3 * ROUNDS + 20
        add_decoding(
            engine, make_prompts(llm.tokenizer, n, 64), loras, warmup + 2 * args.rounds + 8
        )
        for _ in range(warmup):
            engine.step()
        model = engine.runner.model
        if model._decoder is None:
            raise SystemExit(f"this CPU runs {args.dtype} decode steps layer by layer")
        builds = {"working tree": model._decoder, label: other}

        def step_with(build):
            model._decoder = build
            engine.step()

        runs = {name: functools.partial(step_with, build) for name, build in builds.items()}
        times = alternate(args.rounds, runs)
        model._decoder = builds["working tree"]
        context = sum(seq.num_tokens for seq in engine.scheduler.running)

    median = statistics.median
    on = f"{args.adapters} adapters ({args.modules})" if args.adapters else "the base model"
    print(
        f"{args.dtype}, {n} sequences on {on}, {args.rounds} rounds; "
        f"{context} tokens in the KV cache at the end"
    )
    width = max(map(len, times))
    for name in times:
        print(f"  step, {name:{width}s} {median(times[name]) * 1e3:7.2f} ms (median)")
    print(f"  {against(times['working tree'], times[label], label, 'ms', 'step')}")


if __name__ == "__main__":
    main()
