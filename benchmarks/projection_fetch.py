"""What fetching the next LoRA call's adapter rows costs the native bfloat16 projection, in one run.

    python benchmarks/projection_fetch.py [--against OTHER_BUILD.so]

A decode step's projection of 32 rows (SmolLM2's q,k,v: 576 -> 960, 30 layers of distinct
weights, as the engine runs them) brings into cache, while it computes, the rows the LoRA call
after it reads: for 32 distinct rank-16 q,v adapters, 32 x 2 x (16 A rows + 16 B^T rows), 1.9 MB
a layer. Timed three ways, alternated, best of 20 passes over the 30 layers:

* none: no fetch (a base-only step);
* hot: the same ranges every layer, so they are in cache: the cost of walking them alone;
* cold: a fresh 1.9 MB a layer from a 300 MB buffer, as in a real step.

Prints each time a projection and hot / none, cold / none. With `--against`, the same for another
build of the kernels (`gcc -O3 -march=native -fopenmp -shared -fPIC -std=c11 kernels/cpu/*.c
-lm`, say of an earlier commit), side by side in the same run. Needs a CPU with AVX512-BF16 and
no AMX (with AMX the projection takes no fetch: see linear_fetches_bf16 in cpu/linear.c).
"""

from __future__ import annotations

import argparse
import ctypes
import timeit

import torch

LAYERS, ROWS, IN, OUT, RANK = 30, 32, 576, 960, 16
MODULES = ((576, 576), (576, 192))  # q and v: (A row width, B^T row width)


def ranges(cpu_lora, first: int) -> tuple:
    """The fetch ranges of one layer's q,v LoRA call, rows laid out one after the other from
    address `first`; and the address after them."""
    at, nbytes = [], []
    for _ in range(ROWS):
        for a_width, b_width in MODULES:
            for width in [a_width] * RANK + [b_width] * RANK:
                at.append(first)
                nbytes.append(width * 2)
                first += width * 2
    return cpu_lora.Fetch(torch.tensor(at), torch.tensor(nbytes)), first


def timings(projection, x, weights, cold, hot, rounds: int = 3) -> dict[str, float]:
    """Seconds a projection, by fetch kind: the best of 20 passes, over `rounds` alternations."""
    fetches = {"none": [None] * LAYERS, "hot": [hot] * LAYERS, "cold": cold}
    best = dict.fromkeys(fetches, float("inf"))
    for _ in range(rounds):
        for kind, per_layer in fetches.items():

            def run(per_layer=per_layer) -> None:
                for w, fetch in zip(weights, per_layer, strict=True):
                    projection(x, w, OUT, None, fetch)

            seconds = min(timeit.repeat(run, number=1, repeat=20)) / LAYERS
            best[kind] = min(best[kind], seconds)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", help="another build of the kernels' library")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from loraplex.kernels import cpu_lora

    builds = {"this build": cpu_lora.library()}
    if args.against:
        builds[args.against] = ctypes.CDLL(args.against)
    projections = {name: cpu_lora.CpuLinearBf16(lib) for name, lib in builds.items()}
    if not all(p.supports(torch.bfloat16) and p.fetches for p in projections.values()):
        raise SystemExit("the fetching bfloat16 projection needs AVX512-BF16 and no AMX")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, IN, generator=generator).to(torch.bfloat16)
    dense = [torch.randn(OUT, IN, generator=generator).to(torch.bfloat16) for _ in range(LAYERS)]
    buffer = torch.zeros(300 * 2**20 // 2, dtype=torch.bfloat16)
    cold, address = [], buffer.data_ptr()
    for _ in range(LAYERS):
        fetch, address = ranges(cpu_lora, address)
        cold.append(fetch)
    hot, _ = ranges(cpu_lora, buffer.data_ptr())
    print(
        f"{ROWS} rows x {IN} -> {OUT}, {LAYERS} layers; fetching {cold[0].count} ranges, "
        f"{sum(cold[0].bytes.tolist()) / 2**20:.2f} MiB a layer; best of 20 passes"
    )
    for name, projection in projections.items():
        weights = [projection.pack(w) for w in dense]
        t = timings(projection, x, weights, cold, hot)
        print(
            f"{name:24s} none {t['none'] * 1e6:6.1f} us, hot {t['hot'] * 1e6:6.1f} us "
            f"({t['hot'] / t['none']:.2f}x), cold {t['cold'] * 1e6:6.1f} us "
            f"({t['cold'] / t['none']:.2f}x)"
        )


if __name__ == "__main__":
    main()
