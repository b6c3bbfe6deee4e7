"""Two builds of the CPU decode attention compared in one process, call by call.

    python benchmarks/attention_ab.py --against REV [--march native|x86-64-v3|x86-64-v4]
                                      [--dtype bfloat16|float32] [--tokens 300] [--rounds 200]
                                      [--define NAME ...] [--undefine NAME ...]

Builds the kernels' C sources of the working tree and of git revision REV, each into a library
of its own, for this machine or for another x86-64 target (x86-64-v3: the build for CPUs without
AVX-512, run here), and times one layer's decode attention of 32 sequences of --tokens tokens
each (SmolLM2's heads: 9 query heads on 3 kv heads of 64), their KV pages scattered through a
cache held in 2 MiB pages as the engine's pool is (engine/device.py), with a 64 MiB read before
each call so that the keys come from memory as a decode step's do. The builds alternate call by
call; it prints each one's median and the median of the paired differences, and whether the two
gave the same bits. --define NAME builds REV with the macro NAME defined too, --undefine NAME
without that macro of this machine's flags (as layers_ab.py).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
from pathlib import Path

import torch
from kernel_ab import add_macro_options, against, alternate, build_at, other_label

HEADS, KV_HEADS, DIM, PAGE_SIZE = 9, 3, 64, 16


def scattered_decode(
    n: int, tokens: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode attention call's arguments (q, kv, tables, lens) for n sequences of `tokens`
    tokens, SmolLM2's heads, their pages in random order through a cache held in 2 MiB pages as
    the engine's page pool is; the same values for the same arguments."""
    from loraplex.engine.device import zeros_in_huge_pages

    generator = torch.Generator().manual_seed(0)
    pages_each = -(-tokens // PAGE_SIZE)
    shape = (n * pages_each, PAGE_SIZE, 2, KV_HEADS, DIM)
    kv = zeros_in_huge_pages(shape, dtype, "cpu")
    kv.copy_(torch.randn(shape, generator=generator))
    tables = torch.randperm(n * pages_each, generator=generator).view(n, pages_each).contiguous()
    lens = torch.full((n,), tokens)
    q = torch.randn(n, HEADS, DIM, generator=generator).to(dtype)
    return q, kv, tables, lens


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", required=True, help="git revision of the other build")
    parser.add_argument("--march", default="native")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=200)
    add_macro_options(parser)
    args = parser.parse_args()
    torch.set_num_threads(2)

    from loraplex.kernels import cpu_lora

    n, dtype = args.sequences, getattr(torch, args.dtype)
    q, kv, tables, lens = scattered_decode(n, args.tokens, dtype)
    scale = DIM**-0.5
    other = torch.ones(64 * 2**20 // 4)  # read before each call: the caches hold none of kv
    with tempfile.TemporaryDirectory() as tmp:
        builds = {}
        label = other_label(args.against, args.define, args.undefine)
        for name, revision, defines, undefines in (
            ("working tree", None, (), ()),
            (label, args.against, tuple(args.define), tuple(args.undefine)),
        ):
            folder = Path(tmp) / ("this" if revision is None else "other")
            folder.mkdir()
            library = build_at(revision, folder, args.march, defines, undefines)
            builds[name] = cpu_lora.CpuAttentionKernel(library)
        outputs = {}

        def decode_with(name):
            outputs[name] = builds[name].decode(q, kv, tables, lens, scale)

        runs = {name: functools.partial(decode_with, name) for name in builds}
        times = alternate(args.rounds, runs, before=other.sum)

    median = statistics.median
    print(
        f"{args.dtype}, -march={args.march}, {n} sequences of {args.tokens} tokens, "
        f"{HEADS} heads on {KV_HEADS} kv heads of {DIM}, {args.rounds} rounds"
    )
    width = max(map(len, times))
    for name in times:
        print(f"  {name:{width}s} {median(times[name]) * 1e6:8.1f} us a call (median)")
    line = against(times["working tree"], times[label], label, "us", "call")
    same = torch.equal(outputs["working tree"], outputs[label])
    print(f"  {line}; the same bits: {same}")


if __name__ == "__main__":
    main()
