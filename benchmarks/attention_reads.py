"""Where a decode attention call's time goes: its arithmetic, its reads, or waiting between them.

    python benchmarks/attention_reads.py [--dtype float32|bfloat16] [--tokens 64,128,256]
                                         [--rounds 200]

One layer's decode attention of 32 sequences (SmolLM2's heads: 9 query heads on 3 kv heads of
64), their KV pages scattered through a cache held in 2 MiB pages as the engine's pool is, as
attention_ab.py times it, five ways alternated round by round in one process:

- the call with its keys and values from memory (a 64 MiB read before it, as in a decode
  step, where 30 layers' caches and weights pass between two calls on one layer);
- the call right after the same call (what of its rows the caches kept);
- the call with every sequence on the first one's pages: the same arithmetic on rows in cache,
  so what it costs without memory (its fetches differ: with one page table the kernel fetches no
  next sequence, each pass fetching its own rows instead);
- the same pages as the first way reads (each sequence's, the threads taking half of them each,
  in order, where the kernel hands sequences out as its threads come free) read by plain loads
  from memory: what the box gives this pattern of reads;
- the same pages brought into L2 by prefetches alone (`prefetcht1`, a line each, as the kernel
  fetches): how fast the hint brings them in with nothing else to do (the call returns once
  its last prefetch is issued, a few lines' wait short of their arrival).

Where the call from memory takes about the sum of its arithmetic and the plain read, the two do
not overlap; at the larger of the two they would overlap fully.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import tempfile
from pathlib import Path

import torch
from attention_ab import DIM, KV_HEADS, PAGE_SIZE, scattered_decode
from kernel_ab import alternate, compile_scratch

SEQUENCES = 32

READ = r"""
#include <stdint.h>

/* Reads ranges [at[i], at[i] + bytes[i]) by plain loads, the threads taking them in order,
 * half each; returns a sum of what was read, so that nothing is left out. With `hint`, only
 * prefetches them into L2, a line each, and returns 0. */
uint64_t read_ranges(const int64_t *at, const int64_t *bytes, int64_t n, int threads, int hint) {
    uint64_t total = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < n; i++) {
        const char *p = (const char *)at[i];
        if (hint)
            for (int64_t off = 0; off < bytes[i]; off += 64) __builtin_prefetch(p + off, 0, 2);
        else
            for (int64_t w = 0; w < bytes[i] / 8; w++) total += ((const uint64_t *)p)[w];
    }
    return total;
}
"""


def load_reader(folder: Path) -> ctypes.CDLL:
    lib = compile_scratch(folder, "read_ranges", READ)
    lib.read_ranges.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int
    ]  # fmt: skip
    lib.read_ranges.restype = ctypes.c_uint64
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    parser.add_argument("--tokens", default="64,128,256")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from loraplex.kernels import cpu_lora

    kernel = cpu_lora.CpuAttentionKernel(cpu_lora.library())
    dtype, n = getattr(torch, args.dtype), SEQUENCES
    other = torch.ones(64 * 2**20 // 4)  # read before a call: the caches hold none of kv
    with tempfile.TemporaryDirectory() as tmp:
        reader = load_reader(Path(tmp))
        for tokens in (int(t) for t in args.tokens.split(",")):
            q, kv, tables, lens = scattered_decode(n, tokens, dtype)
            pages_each = tables.shape[1]
            one_sequence = tables[:1].expand(n, pages_each).contiguous()
            row_bytes = 2 * KV_HEADS * DIM * kv.element_size()
            page_bytes = kv.stride(0) * kv.element_size()
            at = (kv.data_ptr() + tables.flatten() * page_bytes).contiguous()
            last = tokens - (pages_each - 1) * PAGE_SIZE  # rows on a sequence's last page
            rows = torch.full((n, pages_each), PAGE_SIZE)
            rows[:, -1] = last
            spans = (rows * row_bytes).flatten().contiguous()
            decode = functools.partial(kernel.decode, q, kv, lens=lens, scale=DIM**-0.5)
            read = functools.partial(
                reader.read_ranges, at.data_ptr(), spans.data_ptr(), at.numel(), 2
            )
            runs = {
                "from memory": functools.partial(decode, tables=tables),
                "right after a call": functools.partial(decode, tables=tables),
                "rows in cache": functools.partial(decode, tables=one_sequence),
                "plain read": functools.partial(read, 0),
                "prefetched": functools.partial(read, 1),
            }
            before = {  # untimed, just before each: what its caches hold
                "from memory": other.sum,
                "right after a call": runs["right after a call"],
                "rows in cache": runs["rows in cache"],
                "plain read": other.sum,
                "prefetched": other.sum,
            }
            times = alternate(args.rounds, runs, before)
            median = {name: statistics.median(values) for name, values in times.items()}
            total = n * tokens * row_bytes
            print(
                f"{args.dtype}, {n} sequences of {tokens} tokens ({total / 1e6:.1f} MB of keys "
                f"and values), {args.rounds} rounds, medians:"
            )
            for name, seconds in median.items():
                rate = f" ({total / seconds / 1e9:.1f} GB/s)" if name != "rows in cache" else ""
                print(f"  {name:20s} {seconds * 1e6:8.1f} us{rate}")
            arithmetic, plain = median["rows in cache"], median["plain read"]
            cold = median["from memory"]
            print(
                f"  from memory / (rows in cache + plain read) {cold / (arithmetic + plain):.2f}x, "
                f"/ the larger of the two {cold / max(arithmetic, plain):.2f}x"
            )


if __name__ == "__main__":
    main()
