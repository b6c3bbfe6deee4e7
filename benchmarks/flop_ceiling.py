"""side_by_side.py's workload against this CPU's float32 arithmetic, with loraplex and PEFT in
one run: how much of the machine's peak a throughput target asks for.

    python benchmarks/flop_ceiling.py [--rounds 2]

Measures the peak rate of float32 fused multiply-adds here: a C loop of independent FMAs in the
build's widest vectors (AVX-512, AVX2 or scalar), built as the kernels are
(cpu_lora.compile_command), on one thread and on --threads. Counts the workload's arithmetic:
SmolLM2, 32 requests of 64 prompt and 64 new tokens, the projections and attention scores
(engine_throughput.model_flops) and the rank-16 LoRA products of 32 all-module adapters, two
FLOPs a multiply-add. That count at the peak rate is the ceiling no float32 engine passes on this
machine. Then runs loraplex float32 on the workload (the median of --rounds runs, as
side_by_side.py runs it) and PEFT switching adapter per request, and prints each against the
ceiling, and the share of the peak that 30x PEFT's throughput would take.

float32 is what `dtype="auto"` serves on CPUs without native bfloat16 (AVX2 or AVX-512 without
BF16): there this ceiling bounds every ratio of side_by_side.py. Where bfloat16 is native, its
products run faster than this peak, and the figures here say nothing about them.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

import torch
from engine_throughput import model_flops
from kernel_ab import compile_scratch
from multi_lora_throughput import run_peft_switching
from side_by_side import ALL_MODULES, random_adapters, run_loraplex, workload

# Sums in registers, each updated by one FMA an iteration: enough independent chains to keep
# every FMA unit busy through the instruction's latency (2 units x 4-5 cycles on current cores).
PROBE = r"""
#include <omp.h>
#include <math.h>
#include <stdint.h>
#define CHAINS 12
#if defined(__AVX512F__)
#include <immintrin.h>
typedef __m512 Vec;
#define LANES 16
#define SET(v) _mm512_set1_ps(v)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define FIRST(v) _mm512_cvtss_f32(v)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 Vec;
#define LANES 8
#define SET(v) _mm256_set1_ps(v)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define FIRST(v) _mm256_cvtss_f32(v)
#else
typedef float Vec;
#define LANES 1
#define SET(v) (v)
#define FMA(a, b, c) fmaf(a, b, c)
#define FIRST(v) (v)
#endif

/* FLOP/s of `iters` iterations of CHAINS vector FMAs on each of `threads` threads */
double fma_peak(int64_t iters, int threads) {
    float kept = 0.0f;
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : kept)
    {
        Vec sum[CHAINS];
#pragma GCC unroll 16
        for (int c = 0; c < CHAINS; c++) sum[c] = SET(0.001f * c);
        const Vec scale = SET(0.999999f), add = SET(1e-7f);
        for (int64_t i = 0; i < iters; i++) {
#pragma GCC unroll 16
            for (int c = 0; c < CHAINS; c++) sum[c] = FMA(sum[c], scale, add);
        }
#pragma GCC unroll 16
        for (int c = 0; c < CHAINS; c++) kept += FIRST(sum[c]);
    }
    const double seconds = omp_get_wtime() - start;
    volatile float sink = kept; /* the sums are used, so the loop stays */
    (void)sink;
    return 2.0 * LANES * CHAINS * (double)iters * threads / seconds;
}
"""


def fma_peak(threads: int, folder: Path, tries: int = 5) -> float:
    """The best of `tries` runs of the probe on `threads` threads, FLOP/s."""
    target = folder / "fma_peak.so"  # built once a folder
    built = target.exists()
    lib = ctypes.CDLL(str(target)) if built else compile_scratch(folder, "fma_peak", PROBE)
    lib.fma_peak.argtypes = [ctypes.c_int64, ctypes.c_int]
    lib.fma_peak.restype = ctypes.c_double
    lib.fma_peak(10_000_000, threads)  # clocks up
    return max(lib.fma_peak(100_000_000, threads) for _ in range(tries))


def lora_flops(config, tokens: int, rank: int, modules) -> float:
    """The shrink and expand of rank-`rank` adapters on `modules`, `tokens` tokens."""
    from loraplex.engine.adapters.peft_format import module_shape

    sides = sum(sum(module_shape(config, module)) for module in modules)
    return 2.0 * rank * sides * config.num_layers * tokens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--peft-requests", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="timed loraplex runs (median)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model_dir, config, sets = workload(args)
    batch = sets["rounds"][0]["adapters"]
    # every position but each request's last token goes through the model
    positions = len(batch) * (args.prompt_tokens + args.new_tokens - 1)
    base = model_flops(config, batch, args.new_tokens)
    modules = tuple(ALL_MODULES.split(","))
    lora = lora_flops(config, positions, args.rank, modules)
    generated = args.requests * args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        one, peak = fma_peak(1, Path(tmp)), fma_peak(args.threads, Path(tmp))
        dirs, loras = random_adapters(Path(tmp), config, args.requests, args.rank, modules)
        ours = run_loraplex(model_dir, "float32", sets, loras, args.new_tokens)
        peft = run_peft_switching(
            model_dir, dirs[: args.peft_requests], batch[: args.peft_requests], args.new_tokens
        )

    flops = base + lora
    ceiling = generated / (flops / peak)  # the adapters' workload
    print(
        f"float32 FMA peak: {one / 1e9:.1f} GFLOP/s on 1 thread, {peak / 1e9:.1f} GFLOP/s on "
        f"{args.threads}"
    )
    print(
        f"workload: {args.requests} requests x ({args.prompt_tokens} prompt + {args.new_tokens} "
        f"new tokens) on {args.requests} all-module rank-{args.rank} adapters: "
        f"{flops / 1e9:.0f} GFLOP ({base / 1e9:.0f} base, {lora / 1e9:.0f} LoRA); "
        f"at the peak {flops / peak:.2f} s, a ceiling of {ceiling:.0f} tok/s "
        f"({generated / (base / peak):.0f} tok/s on the base model alone)"
    )
    for name, tok_s, work in (
        ("loraplex float32, base only", ours["base"], base),
        ("loraplex float32, 32 adapters", ours["adapters"], flops),
    ):
        rate = tok_s / generated * work  # FLOP/s achieved over the whole run
        print(
            f"{name:30s} {tok_s:6.1f} tok/s: {rate / 1e9:5.1f} GFLOP/s, {rate / peak:5.1%} of "
            "the peak"
        )
    print(
        f"{'PEFT float32, switching':30s} {peft:6.1f} tok/s; 30x PEFT = {30 * peft:.0f} tok/s, "
        f"{30 * peft / ceiling:.1%} of the ceiling; the ceiling is {ceiling / peft:.1f}x PEFT"
    )


if __name__ == "__main__":
    main()
