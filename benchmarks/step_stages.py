"""Where a decode step's time goes, stage by stage of the native decoder layers, in one run.

    python benchmarks/step_stages.py [--dtype auto|bfloat16|float32] [--modules qv|all]

Builds the working tree's kernels with LAYER_STAGE_TIMERS (cpu/layers.c: a clock around each
stage of every layer, compiled out of the engine's build) and runs the engine on that build: 32
sequences decoding together (64-token prompts) on 32 distinct rank-16 adapters, each step with
LoRA paired with the same batch with LoRA skipped (lora_floor.LoRASwitch), each first in turn,
after a batch of its own has taken the engine past its first timing of how a step fetches its
LoRA rows (fetch_placement.py), so that every step with adapters fetches the way it kept (it
stops where the engine is still timing them).
Prints, for each stage summed over the layers, the median time of a base step and of a step
with adapters and the median of the pairs' differences; for the projections and the attention,
what a base step reads there (weights, the KV cache) and at what rate; the step's time outside
the layers' native call (the embedding, the LM head, sampling and the engine's Python); and the
box's read bandwidth.

A stage that reads below the box's bandwidth has memory to spare, where an adapter's rows could
be fetched while it runs; one near it has none. On a 2-core Xeon with AMX, the projections read
at 17-22 GB/s of the box's 25.7 and the attention at 16 (docs/performance.md). Each stage's
median is its own: they need not add up to the step's.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path

import torch
from engine_throughput import make_prompts
from kernel_ab import build_at
from lora_floor import (
    ALL,
    QV,
    BandwidthProbe,
    LoRASwitch,
    add_decoding,
    decode_steps,
    load_random_adapters,
    rows_fetched,
    still_timing,
)

STAGES = (
    "q,k,v", "rotary write", "attention", "o", "post-attention norm", "gate_up", "SiLU", "down",
    "next input norm",
)  # fmt: skip


def stage_reads(config, dtype: torch.dtype, context: float) -> dict[int, float]:
    """Bytes a base step reads in the stages that stream (index into STAGES -> bytes): the
    projections' weights over every layer, and the KV cache of `context` tokens."""
    from loraplex.engine.kv_cache import kv_page_numel

    c, size = config, dtype.itemsize
    per_layer = {
        0: c.hidden_size * (c.q_size + 2 * c.kv_size),
        3: c.q_size * c.hidden_size,
        5: 2 * c.hidden_size * c.intermediate_size,
        7: c.intermediate_size * c.hidden_size,
    }
    reads = {stage: c.num_layers * n * size for stage, n in per_layer.items()}
    reads[2] = context * kv_page_numel(c, 1) * size  # a page of one token: every layer's K and V
    return reads


class NativeTime:
    """Wraps the layers' native call to add up its wall time."""

    def __init__(self) -> None:
        from loraplex.kernels import cpu_lora

        self.call, self.seconds = cpu_lora.CpuDecoderLayers.__call__, 0.0
        timer = self

        def timed(kernel, *args, **kwargs):
            started = time.perf_counter()
            try:
                return timer.call(kernel, *args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - started

        cpu_lora.CpuDecoderLayers.__call__ = timed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--modules", choices=("qv", "all"), default="qv")
    parser.add_argument("--steps", type=int, default=40, help="pairs of steps")
    parser.add_argument("--sequences", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from loraplex import LLM
    from loraplex.engine.default_model import resolve_model
    from loraplex.engine.fetch_placement import ROUNDS
    from loraplex.kernels import cpu_lora

    n, modules = args.sequences, QV if args.modules == "qv" else ALL
    with tempfile.TemporaryDirectory() as tmp:
        timed = build_at(None, Path(tmp), defines=("LAYER_STAGE_TIMERS",))
        cpu_lora.library = lambda: timed  # every kernel the engine loads comes from this build
        if timed.layer_stages() != len(STAGES):
            raise SystemExit(f"cpu/layers.c times {timed.layer_stages()} stages, not {len(STAGES)}")
        timed.layer_stage_timers.restype = ctypes.POINTER(ctypes.c_int64 * len(STAGES))
        stages = timed.layer_stage_timers().contents
        probe = BandwidthProbe()
        model = resolve_model("default")
        llm = LLM(model=str(model), dtype=args.dtype)
        engine, config = llm.engine, llm.engine.model_config
        loras = load_random_adapters(llm, modules, n, Path(tmp))
        switch, native = LoRASwitch(), NativeTime()
        prompts = make_prompts(llm.tokenizer, 2 * n, 64)  # a batch to warm up, then the steps'
        # past the engine's first timing of how rows are fetched (3 ways at most, a step each a
        # round), as lora_floor.py warms up: until then the steps with adapters would take its
        # ways in turn
        decode_steps(engine, prompts[:n], loras, 3 * ROUNDS + 3, switch)
        add_decoding(engine, prompts[n:], loras, 2 * args.steps + 24)
        for _ in range(20):  # past the prefills
            engine.step()
        lm = engine.runner.model
        if still_timing(lm):
            raise SystemExit("the engine is still timing how its steps fetch rows: warm up longer")
        samples: dict[bool, list[list[float]]] = {True: [], False: []}
        context = []
        for i in range(args.steps):
            context.append(sum(seq.num_tokens for seq in engine.scheduler.running))
            for on in (True, False) if i % 2 == 0 else (False, True):
                switch.on, native.seconds = on, 0.0
                ctypes.memset(stages, 0, ctypes.sizeof(stages))
                started = time.perf_counter()
                engine.step()
                step = time.perf_counter() - started
                samples[on].append([ns / 1e9 for ns in stages] + [step - native.seconds, step])
        switch.on = True
        fetched = rows_fetched(lm, n)
        while engine.has_unfinished():
            engine.step()
        bandwidth = probe.read(3)
        dtype = engine.config.torch_dtype

    reads = stage_reads(config, dtype, statistics.median(context))
    print(
        f"model {model.name}, {str(dtype).removeprefix('torch.')}, 2 threads; {n} sequences "
        f"decoding on {n} distinct rank-16 adapters on {args.modules}; medians of {args.steps} "
        f"pairs of steps; box's read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    print(f"{'stage (all layers)':24s} {'base':>9s} {'adapters':>9s} {'extra':>9s}  base reads")
    names = [*STAGES, "outside the layers' call", "the step"]
    for i, name in enumerate(names):
        base = statistics.median(s[i] for s in samples[False])
        with_lora = statistics.median(s[i] for s in samples[True])
        pairs = zip(samples[True], samples[False], strict=True)
        extra = statistics.median(a[i] - b[i] for a, b in pairs)
        line = f"{name:24s} {base * 1e3:6.2f} ms {with_lora * 1e3:6.2f} ms {extra * 1e3:+6.2f} ms"
        if i in reads:
            line += f"  {reads[i] / 2**20:6.1f} MiB at {reads[i] / base / 1e9:5.1f} GB/s"
        print(line)
    print(fetched)


if __name__ == "__main__":
    main()
