"""How fast this box reads a decode step's adapter rows where they lie, against one contiguous read.

    python benchmarks/row_reads.py [--modules qv|all] [--rounds 3] [--window-us 150]

lora_floor.py's floor is the step's adapter bytes over the box's streaming read bandwidth (one
long contiguous range). A step reads no such range: each token's rows of a layer are one block
of the pool (an adapter's rows of one layer lie together, A and B^T of each module), 61,440 bytes
for SmolLM2's q,v at rank 16 in bfloat16 and 325,632 for all seven projections, and the 32
tokens' blocks lie anywhere in the pool. This reads the same bytes, 30 layers of 32 such blocks
at random 4 KiB-aligned places of a 1 GiB buffer, none overlapping, two threads each taking
half a layer's blocks (one parallel region a layer, as the LoRA calls), after reading 256 MiB
elsewhere to empty the caches; best of 5 each way, rounds alternated:

* front to back: each block read in order, one stream;
* with the next block: the same, and the thread's next block prefetched alongside at the same
  pace, into L1 (the LoRA kernels' way) or into L2;
* 16 rows at once: a block taken as 1,152-byte rows, 16 advancing together (the order of the
  bfloat16 expand), the next block prefetched alongside;
* one contiguous range of as many bytes, in one parallel region (what the floor assumes).

The gap between the last and the best of the others is what reading the rows in place costs on
this box over the floor, whatever the kernels compute.

Then whether a layer's rows can be brought into cache a layer ahead, while memory is less busy:
30 layers of a bfloat16 decode step's shape, each its q,k,v weights (SmolLM2's 1,105,920 bytes),
its rows (the LoRA call), an attention window (its share of the KV, 32 sequences of 96 tokens,
read while it computes for at least --window-us) and its o, gate_up and down weights (5,971,968
bytes), every layer's weights, KV and rows distinct memory, two threads each taking half of
every stage; best of 5 each way, rounds alternated, as a step's time over the same layers
without rows:

* rows read cold (the LoRA call after the q,k,v projection, as on a CPU whose projection takes no
  fetch);
* rows fetched a layer ahead: the next layer's rows brought into L2 during the attention window,
  spread over it, and read at the same place; they cross the layer's o, gate_up and down and the
  next one's q,k,v weights on the way;
* rows fetched just before use: the window fetches the layer's own rows and the call reads them
  right after it, which no step's order allows (its LoRA call comes before its attention), as
  the bound of what a fetch in the window could give.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

from kernel_ab import compile_scratch

HIDDEN, KV, INTERMEDIATE, RANK, LAYERS, TOKENS = 576, 192, 1536, 16, 30, 32
# (A row width, B^T row width) of each module, SmolLM2-135M
MODULES = {
    "qv": [(HIDDEN, HIDDEN), (HIDDEN, KV)],
    "all": [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN)]
    + [(HIDDEN, INTERMEDIATE)] * 2
    + [(INTERMEDIATE, HIDDEN)],
}
QKV_BYTES = HIDDEN * (HIDDEN + 2 * KV) * 2  # a layer's bfloat16 weights, q,k,v first
LAYER_BYTES = QKV_BYTES + (HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE) * 2
KV_BYTES = TOKENS * 96 * 2 * KV * 2  # a layer's keys and values, 32 sequences of 96 tokens
AHEAD = [
    "no rows",
    "rows read cold",
    "rows fetched a layer ahead",
    "rows fetched just before use",
]
PATTERNS = [
    "front to back",
    "with the next block, into L1",
    "with the next block, into L2",
    "16 rows at once",
    "one contiguous range",
]

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* the sum of a block's floats (every 64-byte line read once), in the pattern's order */
static float read_block(const char *b, const char *next, int64_t bytes, int pattern) {
    __m512 acc = _mm512_setzero_ps();
    if (pattern < 3) {
        for (int64_t o = 0; o + 64 <= bytes; o += 64) {
            if (next != NULL && pattern == 1) __builtin_prefetch(next + o, 0, 3);
            if (next != NULL && pattern == 2) __builtin_prefetch(next + o, 0, 2);
            acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float *)(b + o)));
        }
    } else {
        const int64_t row = 1152, rows = bytes / row;
        for (int64_t j0 = 0; j0 < rows; j0 += 16)
            for (int64_t o = 0; o < row; o += 64)
                for (int64_t j = j0; j < j0 + 16 && j < rows; j++) {
                    if (next != NULL) __builtin_prefetch(next + j * row + o, 0, 3);
                    acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float *)(b + j * row + o)));
                }
    }
    return _mm512_reduce_add_ps(acc);
}

static volatile float sink;

/* seconds to read blocks at[layer][token] of `bytes` each (pattern < 4), or as many bytes from
 * `pool` on (pattern 4), after reading `evict` bytes from `away` */
double read_rows(const char *pool, const int64_t *at, int64_t layers, int64_t tokens,
                 int64_t bytes, int pattern, const char *away, int64_t evict) {
    float s = 0;
#pragma omp parallel for reduction(+ : s) num_threads(2)
    for (int64_t o = 0; o < evict; o += 64) s += away[o];
    sink = s;
    const double start = now();
    if (pattern == 4) {
        const int64_t total = layers * tokens * bytes;
#pragma omp parallel for reduction(+ : s) num_threads(2)
        for (int64_t o = 0; o < total; o += 64) s += _mm512_reduce_add_ps(
            _mm512_loadu_ps((const float *)(pool + o)));
        sink = s;
        return now() - start;
    }
    for (int64_t l = 0; l < layers; l++) {
#pragma omp parallel num_threads(2)
        {
            const int64_t th = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t first = tokens * th / nt, last = tokens * (th + 1) / nt;
            float a = 0;
            for (int64_t t = first; t < last; t++) {
                const char *next = t + 1 < last ? pool + at[l * tokens + t + 1] : NULL;
                a += read_block(pool + at[l * tokens + t], pattern == 0 ? NULL : next, bytes,
                                pattern);
            }
            sink = a;
        }
    }
    return now() - start;
}

/* threads' halves of n bytes from p read, W's lines fetched into L2 and L1 ahead as the
 * projections fetch theirs */
static float stream_half(const char *p, int64_t n, int64_t th) {
    const int64_t first = n / 128 * 64 * th, last = th == 0 ? n / 128 * 64 : n / 64 * 64;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t o = first; o < last; o += 64) {
        __builtin_prefetch(p + o + 2048, 0, 2);
        __builtin_prefetch(p + o + 256, 0, 3);
        acc = _mm512_add_ps(acc, _mm512_loadu_ps((const float *)(p + o)));
    }
    return _mm512_reduce_add_ps(acc);
}

/* the thread's half of a layer's blocks read (after a fetch: from cache) */
static float read_half(const char *pool, const int64_t *at, int64_t tokens, int64_t bytes,
                       int64_t th) {
    float s = 0;
    for (int64_t t = tokens * th / 2; t < tokens * (th + 1) / 2; t++)
        s += read_block(pool + at[t], NULL, bytes, 0);
    return s;
}

/* The attention window: the thread's half of kv_bytes read with arithmetic on each line, for
 * at least window seconds; with `fetch`, the thread's half of those blocks brought into L2,
 * spread over the window */
static float window_half(const char *kv, int64_t kv_bytes, double window, const char *pool,
                         const int64_t *fetch, int64_t tokens, int64_t bytes, int64_t th) {
    const double start = now();
    const int64_t first = kv_bytes / 128 * 64 * th, last = first + kv_bytes / 128 * 64;
    const int64_t lines = fetch != NULL ? tokens / 2 * ((bytes + 63) / 64) : 0;
    int64_t issued = 0, t = tokens * th / 2, offset = 0, o = first;
    __m512 acc = _mm512_set1_ps(1.0f), scale = _mm512_set1_ps(0.999f);
    for (;;) {
        const double elapsed = now() - start;
        if (elapsed >= window && o >= last && issued >= lines) break;
        for (int i = 0; i < 64; i++) {
            if (o < last) {
                __builtin_prefetch(kv + o + 1024, 0, 2);
                acc = _mm512_fmadd_ps(acc, scale, _mm512_loadu_ps((const float *)(kv + o)));
                o += 64;
            }
            for (int k = 0; k < 8; k++) acc = _mm512_fmadd_ps(acc, scale, scale);
        }
        const int64_t due = elapsed >= window ? lines : (int64_t)(lines * (elapsed / window));
        for (; issued < due; issued++) {
            __builtin_prefetch(pool + fetch[t] + offset, 0, 2);
            if ((offset += 64) >= bytes) offset = 0, t++;
        }
    }
    return _mm512_reduce_add_ps(acc);
}

/* Seconds for `layers` layers of: weights[0 .. qkv) streamed, the layer's blocks read (mode 1:
 * cold; mode 2: fetched in the window before; mode 3: fetched in this layer's window and read
 * after it), the attention window, weights[qkv .. layer_bytes) streamed; mode 0: no blocks.
 * Each layer's weights, KV and blocks its own. */
double layers_ahead(const char *pool, const int64_t *at, int64_t layers, int64_t tokens,
                    int64_t bytes, const char *weights, int64_t qkv, int64_t layer_bytes,
                    const char *kv, int64_t kv_bytes, double window, int mode, const char *away,
                    int64_t evict) {
    float s = 0;
#pragma omp parallel for reduction(+ : s) num_threads(2)
    for (int64_t o = 0; o < evict; o += 64) s += away[o];
    sink = s;
    const double start = now();
#pragma omp parallel num_threads(2) reduction(+ : s)
    {
        const int64_t th = omp_get_thread_num();
        for (int64_t l = 0; l < layers; l++) {
            const char *w = weights + l * layer_bytes;
            const int64_t *mine = at + l * tokens, *next = l + 1 < layers ? mine + tokens : NULL;
            s += stream_half(w, qkv, th);
#pragma omp barrier
            if (mode == 1 || mode == 2) s += read_half(pool, mine, tokens, bytes, th);
#pragma omp barrier
            const int64_t *fetch = mode == 2 ? next : mode == 3 ? mine : NULL;
            s += window_half(kv + l * kv_bytes, kv_bytes, window, pool, fetch, tokens, bytes, th);
            if (mode == 3) s += read_half(pool, mine, tokens, bytes, th);
#pragma omp barrier
            s += stream_half(w + qkv, layer_bytes - qkv, th);
#pragma omp barrier
        }
    }
    sink = s;
    return now() - start;
}
"""


def build(folder: Path) -> ctypes.CDLL:
    lib = compile_scratch(folder, "row_reads", SOURCE)
    lib.read_rows.restype = ctypes.c_double
    lib.read_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3
    lib.read_rows.argtypes += [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64]
    lib.layers_ahead.restype = ctypes.c_double
    lib.layers_ahead.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3
    lib.layers_ahead.argtypes += [ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
    lib.layers_ahead.argtypes += [ctypes.c_int64, ctypes.c_double, ctypes.c_int]
    lib.layers_ahead.argtypes += [ctypes.c_void_p, ctypes.c_int64]
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modules", choices=sorted(MODULES), default="qv")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window-us", type=float, default=150.0)
    args = parser.parse_args()

    import torch

    block = sum((a + b) * RANK for a, b in MODULES[args.modules]) * 2  # bytes, bfloat16
    pool = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    away = torch.ones(1 << 26, dtype=torch.float32)  # 256 MiB
    gen = torch.Generator().manual_seed(0)
    slot = (block + 4095) // 4096 * 4096  # places that do not overlap, one a block
    chosen = torch.randperm(pool.numel() * 4 // slot, generator=gen)[: LAYERS * TOKENS]
    at = (chosen * slot).view(LAYERS, TOKENS).contiguous()
    total = LAYERS * TOKENS * block
    best = {name: float("inf") for name in PATTERNS}
    ahead = {name: float("inf") for name in AHEAD}
    weights = torch.ones(LAYERS * LAYER_BYTES // 4, dtype=torch.float32)
    kv = torch.ones(LAYERS * KV_BYTES // 4, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        for _ in range(args.rounds):
            for mode, name in enumerate(AHEAD):
                for _ in range(5):
                    seconds = lib.layers_ahead(
                        pool.data_ptr(), at.data_ptr(), LAYERS, TOKENS, block,
                        weights.data_ptr(), QKV_BYTES, LAYER_BYTES, kv.data_ptr(), KV_BYTES,
                        args.window_us * 1e-6, mode, away.data_ptr(), away.numel() * 4,
                    )  # fmt: skip
                    ahead[name] = min(ahead[name], seconds)
            for pattern, name in enumerate(PATTERNS):
                for _ in range(5):
                    seconds = lib.read_rows(
                        pool.data_ptr(), at.data_ptr(), LAYERS, TOKENS, block, pattern,
                        away.data_ptr(), away.numel() * 4,
                    )  # fmt: skip
                    best[name] = min(best[name], seconds)
    print(
        f"{args.modules}: {LAYERS} layers x {TOKENS} blocks of {block:,} bytes "
        f"({total / 2**20:.1f} MiB), 2 threads, best of {5 * args.rounds}"
    )
    contiguous = best[PATTERNS[-1]]
    for name in PATTERNS:
        seconds = best[name]
        print(
            f"  {name:30s} {seconds * 1e3:7.2f} ms  {total / seconds / 1e9:6.1f} GB/s  "
            f"{seconds / contiguous:5.2f}x the contiguous read"
        )
    base = ahead[AHEAD[0]]
    print(
        f"{LAYERS} layers of {LAYER_BYTES:,} bytes of weights, {KV_BYTES:,} of KV in an "
        f"attention window of at least {args.window_us:.0f} us, and the blocks: step "
        f"{base * 1e3:.2f} ms without them"
    )
    for name in AHEAD[1:]:
        extra = ahead[name] - base
        print(
            f"  {name:30s} {ahead[name] * 1e3:7.2f} ms  extra {extra * 1e3:5.2f} ms  "
            f"{extra / contiguous:5.2f}x the contiguous read of the blocks"
        )


if __name__ == "__main__":
    main()
