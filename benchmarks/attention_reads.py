"""Where a decode attention call's time goes: its arithmetic, its reads, or waiting between them.

    python benchmarks/attention_reads.py [--dtype float32|bfloat16] [--tokens 64,128,256]
                                         [--rounds 200]

One layer's decode attention of 32 sequences (SmolLM2's heads: 9 query heads on 3 kv heads of
64), their KV pages scattered through a cache held in 2 MiB pages as the engine's pool is, as
attention_ab.py times it, four ways alternated round by round in one process:

- the call with its keys and values from memory (a 64 MiB read before it, as in a decode
  step, where 30 layers' caches and weights pass between two calls on one layer);
- the call right after the same call (what of its rows the caches kept);
- the call with every sequence on the first one's pages: the same arithmetic on rows in cache,
  so what it costs without memory (its fetches differ: with one page table the kernel fetches no
  next sequence, each pass fetching its own rows instead);
- the same pages as the first way reads (each sequence's, the threads taking half of them each,
  in order, where the kernel hands sequences out as its threads come free) read by plain loads
  from memory: what the box gives this pattern of reads.

Where the call from memory takes about the sum of its arithmetic and the plain read, the two do
not overlap; at the larger of the two they would overlap fully.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

HEADS, KV_HEADS, DIM, PAGE_SIZE, SEQUENCES = 9, 3, 64, 16, 32

READ = r"""
#include <stdint.h>

/* Reads ranges [at[i], at[i] + bytes[i]) by plain loads, the threads taking them in order,
 * half each; returns a sum of what was read, so that nothing is left out. */
uint64_t read_ranges(const int64_t *at, const int64_t *bytes, int64_t n, int threads) {
    uint64_t total = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (int64_t i = 0; i < n; i++) {
        const uint64_t *p = (const uint64_t *)at[i];
        for (int64_t w = 0; w < bytes[i] / 8; w++) total += p[w];
    }
    return total;
}
"""


def load_reader(folder: Path) -> ctypes.CDLL:
    from loraplex.kernels import cpu_lora

    source, target = folder / "read_ranges.c", folder / "read_ranges.so"
    source.write_text(READ)
    subprocess.run(
        cpu_lora.compile_command(cpu_lora._compiler(), [source], target, cpu_lora.FLAGS),
        check=True,
    )
    lib = ctypes.CDLL(str(target))
    lib.read_ranges.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
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

    from loraplex.engine.device import zeros_in_huge_pages
    from loraplex.kernels import cpu_lora

    kernel = cpu_lora.CpuAttentionKernel(cpu_lora.library())
    dtype, n = getattr(torch, args.dtype), SEQUENCES
    other = torch.ones(64 * 2**20 // 4)  # read before a call: the caches hold none of kv
    with tempfile.TemporaryDirectory() as tmp:
        reader = load_reader(Path(tmp))
        for tokens in (int(t) for t in args.tokens.split(",")):
            generator = torch.Generator().manual_seed(0)
            pages_each = -(-tokens // PAGE_SIZE)
            shape = (n * pages_each, PAGE_SIZE, 2, KV_HEADS, DIM)
            kv = zeros_in_huge_pages(shape, dtype, "cpu")
            kv.copy_(torch.randn(shape, generator=generator))
            tables = torch.randperm(n * pages_each, generator=generator).view(n, pages_each)
            tables = tables.contiguous()
            one_sequence = tables[:1].expand(n, pages_each).contiguous()
            lens = torch.full((n,), tokens)
            q = torch.randn(n, HEADS, DIM, generator=generator).to(dtype)
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
            ways = {  # name: (untimed before, timed)
                "from memory": (other.sum, functools.partial(decode, tables=tables)),
                "right after a call": (
                    functools.partial(decode, tables=tables),
                    functools.partial(decode, tables=tables),
                ),
                "rows in cache": (
                    functools.partial(decode, tables=one_sequence),
                    functools.partial(decode, tables=one_sequence),
                ),
                "plain read": (other.sum, read),
            }
            times = alternate_ways(args.rounds, ways)
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


def alternate_ways(
    rounds: int, ways: dict[str, tuple[Callable[[], object], Callable[[], object]]]
) -> dict[str, list[float]]:
    """The seconds of each way's timed call, its untimed one just before it, the ways' order
    turning by one each round."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            before, timed = ways[name]
            before()
            started = time.perf_counter()
            timed()
            times[name].append(time.perf_counter() - started)
    return times


if __name__ == "__main__":
    main()
