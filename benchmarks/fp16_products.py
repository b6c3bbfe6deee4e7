"""What AVX512-FP16's arithmetic could give bfloat16 projections on Intel's Xeons without AMX.

    python benchmarks/fp16_products.py [--chunks 16,32,64]

Where the hypervisor offers AVX512-BF16 and AVX512-FP16 but no AMX (family 6, model 207), the
engine's bfloat16 products go through float32 FMAs (cpu_lora.dpbf16_half_rate, the FMA build),
so side_by_side.py's throughput there is bounded by the float32 FMA peak (flop_ceiling.py).
This measures, in one run:

- the peak rate of float32 FMAs (flop_ceiling.fma_peak), of float16 FMAs and of vdpbf16ps on 1
  and 2 threads (C loops of independent chains, built as the kernels are);
- a decode step's products of 32 rows on the model's first layer (q, gate and up, down), W in
  L2, through two scratch tiles: W's bfloat16 widened to float32 and 4 rows by 96 columns of
  float32 FMAs over all of k, as the FMA build does; and W and x as float16 (each scaled by a
  power of two, W's per matrix and x's per row, so that their largest element lies in [8, 16):
  a chunk's sum of up to 255 products cannot overflow), 8 rows by 96 columns of float16 FMAs
  whose sums are widened into float32 every `chunk` inputs;
- each tile's error against the products in float64, as the root mean square over the
  outputs relative to theirs, beside what rounding the outputs to bfloat16 (as the engine
  does) adds to the float32 tile's.

A scratch measurement of the idea, not the engine's code: the tiles fetch nothing and take no
LoRA. x is Gaussian with every 97th input 20 times larger (outlier channels).
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

import torch
from kernel_ab import compile_scratch

PROBE = r"""
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#define CHAINS 12
#define COLS 96

/* FLOP/s of `iters` iterations of CHAINS independent instructions on `threads`: float16 FMAs
 * (32 lanes), or with `dpbf16` vdpbf16ps (16 lanes of pairs); the float32 FMAs' loop is
 * flop_ceiling.py's */
double peak(int dpbf16, int64_t iters, int threads) {
    float kept = 0.0f;
    const double start = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : kept)
    {
        if (!dpbf16) {
            __m512h s[CHAINS];
            for (int c = 0; c < CHAINS; c++) s[c] = _mm512_set1_ph((_Float16)(0.001f * c));
            const __m512h a = _mm512_set1_ph((_Float16)1.0f), b = _mm512_set1_ph((_Float16)0.0f);
            for (int64_t i = 0; i < iters; i++)
#pragma GCC unroll 16
                for (int c = 0; c < CHAINS; c++) s[c] = _mm512_fmadd_ph(s[c], a, b);
            for (int c = 0; c < CHAINS; c++) kept += (float)_mm512_reduce_add_ph(s[c]);
        } else {
            __m512 s[CHAINS];
            for (int c = 0; c < CHAINS; c++) s[c] = _mm512_set1_ps(0.001f * c);
            const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);
            for (int64_t i = 0; i < iters; i++)
#pragma GCC unroll 16
                for (int c = 0; c < CHAINS; c++) s[c] = _mm512_dpbf16_ps(s[c], a, a);
            for (int c = 0; c < CHAINS; c++) kept += _mm512_cvtss_f32(s[c]);
        }
    }
    const double seconds = omp_get_wtime() - start;
    volatile float sink = kept;
    (void)sink;
    const double lanes = dpbf16 ? 16 : 32, flops = dpbf16 ? 4 : 2;
    return flops * lanes * CHAINS * (double)iters * threads / seconds;
}

/* the float32 tile: rows r .. r + 4 of x [m, k] by block b of wf ([k][COLS] a block) */
static void f32_tile(const float *x, const float *wf, float *y, int64_t k, int64_t n, int64_t b,
                     int64_t r) {
    __m512 acc[4][6];
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 6; c++) acc[i][c] = _mm512_setzero_ps();
    const float *w = wf + b * k * COLS;
    for (int64_t p = 0; p < k; p++) {
        __m512 xv[4];
        for (int i = 0; i < 4; i++) xv[i] = _mm512_set1_ps(x[(r + i) * k + p]);
        for (int c = 0; c < 6; c++) {
            const __m512 wv = _mm512_load_ps(w + p * COLS + c * 16);
            for (int i = 0; i < 4; i++) acc[i][c] = _mm512_fmadd_ps(xv[i], wv, acc[i][c]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 6; c++)
            _mm512_storeu_ps(y + (r + i) * n + b * COLS + c * 16, acc[i][c]);
}

/* the float16 tile: rows r .. r + 8 of xh [m, k] (row i scaled by 1 / xs[i]) by block b of wh
 * (scaled by 1 / ws), float16 sums over `chunk` inputs, widened into float32 between chunks */
static void f16_tile(const _Float16 *xh, const float *xs, const _Float16 *wh, float ws,
                     float *y, int64_t k, int64_t n, int64_t b, int64_t r, int64_t chunk) {
    float sums[8][COLS] __attribute__((aligned(64)));
    memset(sums, 0, sizeof sums);
    const _Float16 *w = wh + b * k * COLS;
    for (int64_t p0 = 0; p0 < k; p0 += chunk) {
        __m512h acc[8][3];
        for (int i = 0; i < 8; i++)
            for (int c = 0; c < 3; c++) acc[i][c] = _mm512_setzero_ph();
        for (int64_t p = p0; p < p0 + chunk && p < k; p++) {
            __m512h wv[3];
            for (int c = 0; c < 3; c++) wv[c] = _mm512_load_ph(w + p * COLS + c * 32);
            for (int i = 0; i < 8; i++) {
                const __m512h xv = _mm512_set1_ph(xh[(r + i) * k + p]);
                for (int c = 0; c < 3; c++) acc[i][c] = _mm512_fmadd_ph(xv, wv[c], acc[i][c]);
            }
        }
        for (int i = 0; i < 8; i++)
            for (int c = 0; c < 3; c++) {
                const __m512i a = _mm512_castph_si512(acc[i][c]);
                const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(a));
                const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(a, 1));
                float *s = sums[i] + c * 32;
                _mm512_store_ps(s, _mm512_add_ps(_mm512_load_ps(s), lo));
                _mm512_store_ps(s + 16, _mm512_add_ps(_mm512_load_ps(s + 16), hi));
            }
    }
    for (int i = 0; i < 8; i++) {
        const __m512 scale = _mm512_set1_ps(xs[r + i] * ws);
        for (int c = 0; c < 6; c++)
            _mm512_storeu_ps(y + (r + i) * n + b * COLS + c * 16,
                             _mm512_mul_ps(_mm512_load_ps(sums[i] + c * 16), scale));
    }
}

/* the power of two that brings a largest element `largest` into [8, 16) */
static float scale_of(float largest) {
    int e;
    frexpf(largest, &e);
    return ldexpf(1.0f, e - 4);
}

/* x [m, k] (m a multiple of 8), w [n, k] (n a multiple of 96) -> y32 and y16 [m, n], each
 * tile's; their best times of `reps` on `threads` in seconds (out[0], out[1]) */
void compare(const float *x, const float *w, int64_t m, int64_t k, int64_t n, int64_t chunk,
             int reps, int threads, float *y32, float *y16, double *out) {
    const int64_t blocks = n / COLS;
    float *wf = aligned_alloc(64, sizeof(float) * n * k);
    _Float16 *wh = aligned_alloc(64, sizeof(_Float16) * n * k);
    _Float16 *xh = malloc(sizeof(_Float16) * m * k);
    float *xs = malloc(sizeof(float) * m), wmax = 0.0f;
    for (int64_t i = 0; i < n * k; i++) wmax = fmaxf(wmax, fabsf(w[i]));
    const float ws = scale_of(wmax);
    for (int64_t j = 0; j < n; j++)
        for (int64_t p = 0; p < k; p++) {
            const int64_t at = (j / COLS) * k * COLS + p * COLS + j % COLS;
            wf[at] = w[j * k + p];
            wh[at] = (_Float16)(w[j * k + p] / ws);
        }
    for (int64_t i = 0; i < m; i++) {
        float largest = 0.0f;
        for (int64_t p = 0; p < k; p++) largest = fmaxf(largest, fabsf(x[i * k + p]));
        xs[i] = scale_of(largest);
        for (int64_t p = 0; p < k; p++) xh[i * k + p] = (_Float16)(x[i * k + p] / xs[i]);
    }
    out[0] = out[1] = 1e30;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = omp_get_wtime();
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t r = 0; r < m; r += 4) f32_tile(x, wf, y32, k, n, b, r);
        double t1 = omp_get_wtime();
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t r = 0; r < m; r += 8) f16_tile(xh, xs, wh, ws, y16, k, n, b, r, chunk);
        double t2 = omp_get_wtime();
        out[0] = fmin(out[0], t1 - t0);
        out[1] = fmin(out[1], t2 - t1);
    }
    free(wf), free(wh), free(xh), free(xs);
}
"""


def load(folder: Path) -> ctypes.CDLL:
    lib = compile_scratch(folder, "fp16_products", PROBE)  # -march=native: AVX512-FP16
    lib.peak.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    lib.peak.restype = ctypes.c_double
    lib.compare.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2
    lib.compare.argtypes += [ctypes.c_void_p] * 3
    return lib


def first_layer(model_dir: Path) -> dict[str, torch.Tensor]:
    """The model's first layer's q, gate and up (fused, as the engine loads them) and down
    weights, bfloat16 values as float32."""
    from loraplex.engine.checkpoint import load_weights
    from loraplex.engine.config import ModelConfig

    config = ModelConfig.from_dir(model_dir)
    layer = load_weights(model_dir, config, torch.bfloat16, "cpu").layers[0]
    products = {"q": layer.qkv[: config.q_size], "gate_up": layer.gate_up, "down": layer.down}
    return {name: w.float().contiguous() for name, w in products.items()}


def rms_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    """The root mean square of y - reference, relative to reference's."""
    return float((y.double() - reference).norm() / reference.norm())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--chunks", default="16,32,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    if args.rows <= 0 or args.rows % 8 != 0:
        parser.error("--rows must be a positive multiple of 8 (the float16 tile's rows)")
    chunks = [int(chunk) for chunk in args.chunks.split(",")]
    if not all(0 < chunk <= 255 for chunk in chunks):
        parser.error("--chunks must lie in 1..255: a longer float16 sum could overflow")
    from flop_ceiling import fma_peak

    from loraplex.engine.default_model import resolve_model
    from loraplex.kernels import cpu_lora

    if not {"avx512_fp16", "avx512_bf16"} <= cpu_lora.cpu_flags():
        raise SystemExit("this CPU offers no AVX512-FP16 or no AVX512-BF16: nothing to measure")
    with tempfile.TemporaryDirectory() as tmp:
        lib = load(Path(tmp))
        for threads in (1, args.threads):
            f32 = fma_peak(threads, Path(tmp))  # clocks up too
            f16, dp = (max(lib.peak(dp, 20_000_000, threads) for _ in range(3)) for dp in (0, 1))
            print(
                f"peak on {threads} thread(s): float32 FMA {f32 / 1e9:.1f} GFLOP/s, float16 "
                f"FMA {f16 / 1e9:.1f} ({f16 / f32:.2f}x), vdpbf16ps {dp / 1e9:.1f} "
                f"({dp / f32:.2f}x)"
            )
        generator = torch.Generator().manual_seed(0)
        for name, w in first_layer(resolve_model(args.model)).items():
            n, k = w.shape
            if n % 96 != 0:
                print(f"{name}: {n} outputs, not a multiple of the tiles' 96 columns: left out")
                continue
            x = torch.randn(args.rows, k, generator=generator)
            x[:, ::97] *= 20
            x = x.to(torch.bfloat16).float().contiguous()
            reference = x.double() @ w.double().T
            y32, y16 = torch.empty(args.rows, n), torch.empty(args.rows, n)
            for chunk in chunks:
                out = (ctypes.c_double * 2)()
                lib.compare(
                    x.data_ptr(), w.data_ptr(), args.rows, k, n, chunk, args.reps, args.threads,
                    y32.data_ptr(), y16.data_ptr(), out,
                )  # fmt: skip
                flop = 2.0 * args.rows * k * n
                rounded = y32.to(torch.bfloat16)  # as the engine rounds its outputs
                print(
                    f"{name:8s} {args.rows} x {k} -> {n}, chunk {chunk:3d}: float32 tile "
                    f"{flop / out[0] / 1e9:6.1f} GFLOP/s, float16 tile {flop / out[1] / 1e9:6.1f} "
                    f"({out[0] / out[1]:.2f}x); rms error: float32 "
                    f"{rms_error(y32, reference):.1e}, float16 {rms_error(y16, reference):.1e}, "
                    f"bfloat16 outputs {rms_error(rounded, reference):.1e}"
                )


if __name__ == "__main__":
    main()
