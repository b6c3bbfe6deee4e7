"""One bfloat16 LoRA call on its own: a decode step's q,v call with its rows in cache, in L3 or in
memory, in the kernel's two orders.

    python benchmarks/lora_call.py [--iters 20000]

The call of one layer of a decode step on 32 distinct rank-16 q,v adapters (SmolLM2: 576 inputs,
q 576 and v 192 outputs; 61,440 bytes of rows a token), each token a run of its own, so a block
of one (cpu/lora.c), on 2 threads in one parallel region kept for all the calls, a barrier after
each, as the fused projection's threads meet. Rows:

* in cache: every token reads one adapter's rows (60 KiB, in L1/L2 after the first), each with
  a scale of its own, so that the kernel still takes it alone;
* in L3: 32 adapters' rows, 1.9 MiB, the same every call;
* in memory: 32 adapters' rows drawn afresh each call from 1 GiB.

and the kernel's two orders: the blocks' (the call after a projection that fetched its rows,
`rows_fetched`) and row by row (a call on its own). Prints microseconds a call, best of 5, and
what 30 layers of such calls cost a step. The arithmetic and the reads are what a decode step's
q,v extra is made of (docs/performance.md); the fetch during the projection is not in these.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
from pathlib import Path

from row_reads import HIDDEN, KV, LAYERS, RANK, TOKENS

SOURCE = r"""
#include <omp.h>
#include <time.h>
#include "@KERNELS@/lora.h"

enum { TOKENS = @TOKENS@, FIN = @HIDDEN@, R = @RANK@, KV = @KV@, N = FIN + 2 * KV };
static const int64_t FOUTS[2] = {FIN, KV}, COLS[2] = {0, FIN + KV}, MODS[2] = {0, 1};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* a_rows, b_rows [sets][2][TOKENS * R]: each set's pool offsets; the calls cycle through the
 * sets. -> seconds a call, over `iters` calls after `iters / 10` unmeasured ones. */
double time_calls(const uint16_t *pool, const int64_t *a_rows, const int64_t *b_rows,
                  int64_t sets, const uint16_t *x, uint16_t *y, int fetched, int64_t iters) {
    int64_t slots[TOKENS];
    float scales[TOKENS];
    for (int t = 0; t < TOKENS; t++) slots[t] = t, scales[t] = 0.5f + 0.01f * t;
    const int64_t stride = 2 * TOKENS * R, warm = iters / 10;
    double start = 0;
#pragma omp parallel num_threads(2)
    for (int64_t i = 0; i < warm + iters; i++) {
        const int64_t set = i % sets;
        LoRABinding b = {0, TOKENS, 2, MODS, COLS, FOUTS, pool, a_rows + set * stride,
                         b_rows + set * stride, TOKENS * R, slots, R, scales, 2};
        LoRACall call = {x, FIN, y, N, FIN, &b, fetched};
#pragma omp barrier
#pragma omp master
        if (i == warm) start = now();
        lora_thread_bf16(&call, omp_get_thread_num(), omp_get_num_threads());
#pragma omp barrier
    }
    return (now() - start) / iters;
}
"""


def build(folder: Path) -> ctypes.CDLL:
    from loraplex.kernels import cpu_lora

    source, target = folder / "lora_call.c", folder / "lora_call.so"
    values = {
        "KERNELS": cpu_lora.KERNELS,
        "TOKENS": TOKENS,
        "HIDDEN": HIDDEN,
        "RANK": RANK,
        "KV": KV,
    }
    text = SOURCE
    for name, value in values.items():
        text = text.replace(f"@{name}@", str(value))
    source.write_text(text)
    sources = [source, *cpu_lora.SOURCES]
    subprocess.run(cpu_lora.compile_command(cpu_lora._compiler(), sources, target), check=True)
    lib = ctypes.CDLL(str(target))
    lib.time_calls.restype = ctypes.c_double
    lib.time_calls.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_void_p] * 2
    lib.time_calls.argtypes += [ctypes.c_int, ctypes.c_int64]
    return lib


def row_tables(sets: int, distinct: int, span: int, gen) -> tuple:
    """(a_rows, b_rows) [sets, 2, TOKENS * RANK]: each set's tokens on `distinct` adapters whose
    rows lie one after the other at random places of `span` elements of the pool."""
    import torch

    r, fin, fouts = RANK, HIDDEN, (HIDDEN, KV)
    per_adapter = 2 * r * fin + r * sum(fouts)  # elements: A of q and v, then B^T of q and v
    places = torch.randperm(span // per_adapter, generator=gen)[: sets * distinct] * per_adapter
    places = places.view(sets, distinct)
    a = torch.empty(sets, 2, TOKENS, r, dtype=torch.long)
    b = torch.empty_like(a)
    j = torch.arange(r)
    for token in range(TOKENS):
        first = places[:, token % distinct, None]
        a[:, 0, token] = first + j * fin
        a[:, 1, token] = first + r * fin + j * fin
        b[:, 0, token] = first + 2 * r * fin + j * fouts[0]
        b[:, 1, token] = first + 2 * r * fin + r * fouts[0] + j * fouts[1]
    return a.flatten().contiguous(), b.flatten().contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=20000)
    args = parser.parse_args()

    import torch

    gen = torch.Generator().manual_seed(0)
    pool = (torch.rand(1 << 29, generator=gen) * 0.02).to(torch.bfloat16)  # 1 GiB
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
    y = torch.zeros(TOKENS, HIDDEN + 2 * KV, dtype=torch.bfloat16)
    cold_sets = 400  # 400 x 1.9 MiB of rows, every call's its own until the cycle comes round
    where = {
        "in cache": row_tables(1, 1, pool.numel(), gen),
        "in L3": row_tables(1, TOKENS, pool.numel(), gen),
        "in memory": row_tables(cold_sets, TOKENS, pool.numel(), gen),
    }
    orders = {"blocks' order (rows fetched)": 1, "row by row (a call on its own)": 0}
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        print(f"one q,v call: {TOKENS} tokens on distinct rank-{RANK} adapters, bf16, 2 threads")
        for order, fetched in orders.items():
            for name, (a_rows, b_rows) in where.items():
                sets = a_rows.numel() // (2 * TOKENS * RANK)
                pointers = (pool.data_ptr(), a_rows.data_ptr(), b_rows.data_ptr())
                io = (x.data_ptr(), y.data_ptr())
                best = min(
                    lib.time_calls(*pointers, sets, *io, fetched, args.iters) for _ in range(5)
                )
                print(
                    f"  {order:31s} rows {name:9s} {best * 1e6:6.1f} us a call, "
                    f"{best * LAYERS * 1e3:5.2f} ms over {LAYERS} layers"
                )


if __name__ == "__main__":
    main()
