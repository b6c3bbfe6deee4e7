"""Prompt chunks through oneDNN's projection against the native one's, whole runs.

    python benchmarks/prompt_chunks.py [--dtype float32|bfloat16] [--rounds 3] [--new-tokens 64]

Decides from whole runs whether a CPU's native projection should take batches of every size: in
float32 (kernels/cpu/linear_f32.c) cpu_lora.CpuLinearF32.any_rows, as on Zen 2 and 5; in
bfloat16 (kernels/cpu/linear.c) cpu_lora.CpuLinearBf16.any_rows, as with AMX, in the FMA build
and on Zen 4 and 5. prompt_projection.py [--dtype float32] times the projections alone, without what
changes with them in a step: a chunk's LoRA calls, made in the native projection's own call, and
what the decode tokens beside it find in cache. Two engines (SmolLM2, `--dtype`, 256 tokens a
step), one giving prompt chunks to oneDNN (and keeping its copy of the weights), the other to
the native projection, run side_by_side.py's workload in turn: 32 requests of 64 prompt tokens,
greedy, EOS ignored, on the base model and on 32 distinct rank-16 all-module adapters (request i
on adapter i),

* the prompts alone (one new token each: the prefill, 8 chunks),
* and whole runs (`--new-tokens` each).

Every timed run has prompts of its own, the same for both engines (each engine's prefix cache
would otherwise skip a repeated prompt's prefill), and which engine goes first alternates from
round to round. Prints each engine's median time, the native engine's time as a multiple of the
oneDNN one's per pair, whether both gave the same tokens (in bfloat16 the two products round
differently, and a near-tie may flip), and the bytes of weights each keeps.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import torch
from engine_throughput import make_prompts
from side_by_side import ALL_MODULES, random_adapters

REQUESTS, PROMPT_TOKENS = 32, 64


def weight_bytes(model) -> int:
    """Bytes of the projections' weights the model keeps, every copy (Linear)."""
    linears = [model.lm_head] + [p for layer in model.layers for p in layer.projections]
    return sum(
        t.numel() * t.element_size()  # oneDNN's copy (_packed) is opaque: no storage to ask
        for linear in linears
        for t in (linear.weight, linear._packed, linear.native_packed)
        if t is not None
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from loraplex import LLM, SamplingParams
    from loraplex.engine.config import ModelConfig
    from loraplex.engine.default_model import resolve_model
    from loraplex.engine.tokenizer import TokenizerWrapper
    from loraplex.kernels import cpu_lora

    lib, dtype = cpu_lora.library(), getattr(torch, args.dtype)
    kernel_type, loader_name = {
        torch.float32: (cpu_lora.CpuLinearF32, "load_linear_f32"),
        torch.bfloat16: (cpu_lora.CpuLinearBf16, "load_linear"),
    }[dtype]
    if lib is None or not kernel_type(lib).supports(dtype):
        raise SystemExit(f"the engine takes no native {args.dtype} projection on this CPU")
    model_dir = resolve_model("default")
    # (run, new tokens a request, base model or adapters), each timed on a batch of its own
    runs = list(
        itertools.product([("prefill", 1), ("whole", args.new_tokens)], ("base", "adapters"))
    )
    count = REQUESTS * (1 + args.rounds * len(runs))
    prompts = make_prompts(TokenizerWrapper(model_dir), count, PROMPT_TOKENS)
    batches = iter([prompts[i : i + REQUESTS] for i in range(0, count, REQUESTS)])
    warmup = next(batches)

    def engine(any_rows: bool) -> LLM:
        kernel = kernel_type(lib)  # as the engine takes it here, but any_rows
        kernel.any_rows = any_rows
        loader = getattr(cpu_lora, loader_name)
        setattr(cpu_lora, loader_name, lambda: kernel)
        try:
            return LLM(model=str(model_dir), dtype=args.dtype, max_num_batched_tokens=256)
        finally:
            setattr(cpu_lora, loader_name, loader)

    def timed(llm: LLM, batch, new_tokens: int, loras) -> tuple[float, list]:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        started = time.perf_counter()
        results = llm.generate(batch, params, adapters=loras)
        return time.perf_counter() - started, [r.outputs[0].token_ids for r in results]

    with tempfile.TemporaryDirectory() as tmp:
        config = ModelConfig.from_dir(model_dir)
        _, loras = random_adapters(Path(tmp), config, REQUESTS, 16, ALL_MODULES.split(","))
        engines = {"oneDNN": engine(False), "native": engine(True)}
        for llm in engines.values():
            for lora in loras:
                llm.engine.load_adapter(lora)  # disk -> host -> pool before timing
            timed(llm, warmup[:2], 4, loras[:2])
        times = {(name, run): [] for name in engines for run in runs}
        same = True
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for run in runs:
                (_, new_tokens), kind = run
                batch, tokens = next(batches), {}
                for name in order:
                    on = loras if kind == "adapters" else None
                    seconds, tokens[name] = timed(engines[name], batch, new_tokens, on)
                    times[(name, run)].append(seconds)
                same &= tokens["oneDNN"] == tokens["native"]

        print(
            f"SmolLM2, {args.dtype}, {args.threads} threads, 256 tokens a step; {REQUESTS} "
            f"requests of {PROMPT_TOKENS} prompt tokens; medians of {args.rounds} rounds, engines "
            "alternated"
        )
        for run in runs:
            (what, new_tokens), kind = run
            onednn, native = times[("oneDNN", run)], times[("native", run)]
            pairs = ", ".join(f"{n / o:.3f}" for o, n in zip(onednn, native, strict=True))
            print(
                f"{what} ({new_tokens} new), {kind}: oneDNN's chunks "
                f"{statistics.median(onednn) * 1e3:8.1f} ms, native "
                f"{statistics.median(native) * 1e3:8.1f} ms; native / oneDNN time {pairs}"
            )
        print(f"the same tokens from both: {same}")
        for name, llm in engines.items():
            print(f"{name}: weights kept {weight_bytes(llm.engine.model) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
