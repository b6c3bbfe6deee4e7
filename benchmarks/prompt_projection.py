"""The native bfloat16 (or float32) projection against oneDNN's on batches of every size.

    python benchmarks/prompt_projection.py [ROWS ...] [--dtype bfloat16|float32]

SmolLM2's four projections of a layer (q,k,v 576 -> 960, o 576 -> 576, gate,up 576 -> 3072,
down 1536 -> 576) over 30 layers of distinct random weights, as a step runs them (weights from
memory), for batches of ROWS rows (default 32 33 64 100 128 256: a decode step's and prompt
chunks'): the native kernel (kernels/cpu/linear.c, W packed its way) and oneDNN's (W packed
its way), alternated, best of 7 passes each. Prints the time of each, its GFLOP/s and the native
time as a multiple of oneDNN's: where it is at or under 1 for every size, the native projection
takes every batch (cpu_lora.CpuLinearBf16.any_rows: with AMX, in the FMA build, on Zen 4 and 5)
and the model keeps no oneDNN copy of its weights. Needs a CPU with AMX or AVX512-BF16. With
--dtype float32, the float32 projection (kernels/cpu/linear_f32.c, any CPU with AVX-512 or AVX2
and FMA; the engine takes it for decode steps on AMD's and on Intel's with AVX-512, where it was
measured, and for every batch on Zen 2, where it was under 1 at every size, and on Zen 5, where
whole runs were level (prompt_chunks.py): cpu_lora.CpuLinearF32):
where it is under 1 at 32 rows on another CPU, that CPU may take it too; projection_ab.py then
compares whole steps.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of each projection
LAYERS = 30


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("rows", nargs="*", type=int, default=[32, 33, 64, 100, 128, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)

    from loraplex.kernels import cpu_lora

    lib = cpu_lora.library()
    if dtype == torch.float32:
        native = cpu_lora.CpuLinearF32(lib, any_cpu=True) if lib is not None else None
    else:
        native = cpu_lora.load_linear()
    if native is None or not native.supports(dtype):
        raise SystemExit(f"the native {args.dtype} projection does not run on this CPU")
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        weights = []
        for n, k in SHAPES:
            w = (torch.randn(n, k) * 0.05).to(dtype)
            onednn = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            weights.append((native.pack(w), onednn, n, k))
        layers.append(weights)

    def native_pass(xs) -> float:
        start = time.perf_counter()
        for weights in layers:
            for packed, _, n, k in weights:
                native(xs[k], packed, n, None)
        return time.perf_counter() - start

    def onednn_pass(xs) -> float:
        start = time.perf_counter()
        for weights in layers:
            for _, packed, _, k in weights:
                torch.ops.mkldnn._linear_pointwise(xs[k], packed, None, "none", [], "")
        return time.perf_counter() - start

    print(
        f"SmolLM2's projections, {args.dtype}, {LAYERS} layers of distinct weights, "
        f"{args.threads} threads; native build any_rows={native.any_rows}"
    )
    for m in args.rows:
        xs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in SHAPES}}
        flops = 2 * m * sum(n * k for n, k in SHAPES) * LAYERS
        mine, theirs = [], []
        for _ in range(7):
            mine.append(native_pass(xs))
            theirs.append(onednn_pass(xs))
        a, b = min(mine), min(theirs)
        print(
            f"  {m:4d} rows: native {a * 1e3:7.2f} ms ({flops / a / 1e9:5.0f} GFLOP/s)  "
            f"oneDNN {b * 1e3:7.2f} ms ({flops / b / 1e9:5.0f} GFLOP/s)  native / oneDNN time "
            f"{a / b:.2f}"
        )


if __name__ == "__main__":
    main()
