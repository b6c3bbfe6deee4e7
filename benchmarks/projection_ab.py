"""float32 decode steps with oneDNN's projections against the native one's, in one process.

    python benchmarks/projection_ab.py [--modules qv|all] [--rounds 30]

Decides whether a CPU should take the native float32 projection (kernels/cpu/linear_f32.c,
cpu_lora.CpuLinearF32) for decode steps, and which adapter rows it should fetch meanwhile, from
whole steps rather than the projections alone (prompt_projection.py --dtype float32): the lm_head,
the LoRA calls and the fetches change with it. Two engines (SmolLM2, float32), each with 32
sequences decoding together on 32 distinct rank-16 adapters (64-token prompts): one keeps
oneDNN's projections (LORAPLEX_ONEDNN_LINEAR=1), with the LoRA calls after them; the other takes
the native projection on whatever CPU this is, its LoRA call made in the projection's own native
call, in turn:

* own: fetching nothing;
* fetching: fetching all that call's rows meanwhile (the fetch placement's ALL way, fixed);
* shrinks: fetching only its A rows (its SHRINKS way, fixed).

Each round takes, for every way, a step with LoRA and the same batch with LoRA skipped (its base
step) on the native engine and on the oneDNN one, the engines' order alternating, and prints the
medians: step, base step, extra over base (median of the pairs' differences) and base/step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch
from engine_throughput import make_prompts
from lora_floor import ALL, QV, LoRASwitch, add_decoding, load_random_adapters, step_pair

# each way: whether the native projection fetches, and the way fixed (fetch_placement.py)
WAYS = {"own": (False, "all"), "fetching": (True, "all"), "shrinks": (True, "shrinks")}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modules", choices=("qv", "all"), default="qv")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from loraplex import LLM
    from loraplex.engine.default_model import resolve_model
    from loraplex.kernels import cpu_lora

    lib = cpu_lora.library()
    if lib is None or not lib.linear_native_f32():
        raise SystemExit("the native float32 projection does not build here (it needs AVX-512)")
    model_dir, modules = resolve_model("default"), QV if args.modules == "qv" else ALL
    switch = LoRASwitch()

    def decoding_engine(tmp: str, name: str) -> LLM:
        llm = LLM(model=str(model_dir), dtype="float32", max_num_batched_tokens=256)
        engine, loras = llm.engine, load_random_adapters(llm, modules, 32, Path(tmp) / name)
        add_decoding(engine, make_prompts(llm.tokenizer, 32, 64), loras, 16 * args.rounds + 200)
        for _ in range(40):  # past the prefills
            engine.step()
        return llm

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["LORAPLEX_ONEDNN_LINEAR"] = "1"
        try:
            onednn = decoding_engine(tmp, "onednn")
        finally:
            del os.environ["LORAPLEX_ONEDNN_LINEAR"]
        native_kernel = cpu_lora.CpuLinearF32(lib, any_cpu=True)
        cpu_lora.load_linear_f32 = lambda: native_kernel  # the native engine's, on any CPU
        native = decoding_engine(tmp, "native")

        pairs: dict[str, list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            for way, (fetches, fixed) in WAYS.items():
                native_kernel.fetches = native_kernel.fetches_shrinks = fetches
                model = native.engine.runner.model
                model._steps = None  # the projections' steps decided anew
                model.fetch_placement.fix(fixed)
                turns = ((native, f"native, {way}"), (onednn, "oneDNN"))
                for llm, key in turns if r % 2 == 0 else reversed(turns):
                    pairs.setdefault(key, []).append(step_pair(llm.engine, switch))

    print(
        f"SmolLM2 float32, {args.threads} threads, 32 sequences on 32 rank-16 {args.modules} "
        f"adapters; medians of {args.rounds} rounds (oneDNN: {len(WAYS)} pairs a round)"
    )
    for key, steps in sorted(pairs.items()):
        step = statistics.median(on for on, _ in steps)
        base = statistics.median(off for _, off in steps)
        extra = statistics.median(on - off for on, off in steps)
        print(
            f"  {key:18s} step {step * 1e3:7.2f} ms  base {base * 1e3:7.2f} ms  "
            f"extra {extra * 1e3:6.2f} ms  base/step {base / step:.3f}"
        )


if __name__ == "__main__":
    main()
