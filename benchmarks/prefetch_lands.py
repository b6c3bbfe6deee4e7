"""Whether a software prefetch brings its lines into cache on this CPU, as a plain read does.

    python benchmarks/prefetch_lands.py [--mib 0.5] [--wait-us 0,100] [--rounds 41] [--pace 8]
                                        [--threads 1]

The engine hides LoRA rows' reads behind a projection's arithmetic with prefetch hints (a line
each, `prefetcht1`; cpu/linear.h). This asks the CPU what such a hint leaves in cache. On one
core (or on `--threads` cores at once, each with its own buffers, as the engine's threads hint
together), a range smaller than L2 (`--mib`), cold (64 MiB of another buffer read before each way),
is brought in one of these ways, then after `--wait-us` of spinning its lines are read once each
in a shuffled order (a load a line, so that the hardware prefetchers cannot guess them):

- nothing: the read finds every line in memory;
- `prefetcht0`, `prefetcht1` (the engine's hint), `prefetcht2`, `prefetchnta`: a hint a line;
- `prefetcht1` over the whole range twice, and four times: where hints are dropped, a hint
  given again may land;
- `prefetcht1` paced: a hint a line, each after `--pace` steps of a chain of dependent
  multiplies and adds, as the engine's hints come between a projection's arithmetic rather than in
  one burst (the hints' rate, per line and in GB/s, is printed beside it, and the time a line
  of the same work takes without the hints: where the two are level, the work sets the rate;
  where the hints take longer, the core waited to give them);
- a plain read of the range, in order (where the hardware's stream prefetchers run ahead);
- a read of the range in the shuffled order (demand loads alone): every line in cache.

It prints each way's median read time and the share of the way from nothing to the shuffled
read that it covered: 100% where a way's lines are found as the demand loads' are, 0% where it
leaves nothing in cache.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import tempfile
from pathlib import Path

from kernel_ab import compile_scratch

WAYS = (
    "nothing", "prefetcht0", "prefetcht1", "prefetcht2", "prefetchnta", "prefetcht1 x2",
    "prefetcht1 x4", "prefetcht1 paced", "plain read", "shuffled read",
)  # fmt: skip
PACED = WAYS.index("prefetcht1 paced")

PROBE = r"""
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define WAYS 10 /* the ways, in the docstring's order (WAYS in Python) */
#define PACED 7  /* the paced way (PACED in Python) */

/* The paced way's work between two hints: `pace` steps of a multiply and an add, each on the
 * last's value; the empty asm keeps every step (else the compiler drops the whole chain, whose
 * result nothing it must keep uses) */
static inline float paced_work(float chain, int pace) {
    for (int s = 0; s < pace; s++) {
        chain = chain * 0.999999f + 1e-7f;
        __asm__ volatile("" : "+x"(chain));
    }
    return chain;
}

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

/* On `threads` cores at once, each with buffers of its own and in step with the others at each
 * phase: times[(t * WAYS + w) * rounds + r], thread t's read in round r after way w,
 * issued[t * rounds + r] its time to issue the paced hints, alone[t * rounds + r] its time for
 * the same work without them; -> a checksum */
uint64_t probe(int64_t bytes, double wait_us, int rounds, int pace, int threads, double *times,
               double *issued, double *alone) {
    const int64_t lines = bytes / 64, slots = 32, other_bytes = (int64_t)64 << 20;
    int64_t *order = malloc(sizeof(int64_t) * lines); /* the read's order, every thread's */
    for (int64_t i = 0; i < lines; i++) order[i] = i * 64;
    srand(1);
    for (int64_t i = lines - 1; i > 0; i--) {
        const int64_t j = rand() % (i + 1), x = order[i];
        order[i] = order[j], order[j] = x;
    }
    uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int tid = omp_get_thread_num();
        float chain = 1.0f;
        char *region = aligned_alloc(1 << 21, (size_t)(slots * (bytes + 4096)));
        char *other = aligned_alloc(1 << 21, (size_t)other_bytes);
        memset(region, 1, (size_t)(slots * (bytes + 4096)));
        memset(other, 2, (size_t)other_bytes);
        uint64_t sum = 0;
        for (int r = 0; r < rounds; r++)
            for (int w = 0; w < WAYS; w++) {
                const char *b = region + ((r * WAYS + w) % slots) * (bytes + 4096);
                #pragma omp barrier
                for (int64_t i = 0; i < other_bytes; i += 64) sum += other[i];
                if (w == PACED) { /* its work without the hints; touches no memory */
                    const double start = now_us();
                    for (int64_t i = 0; i < bytes; i += 64) chain = paced_work(chain, pace);
                    alone[tid * rounds + r] = now_us() - start;
                }
                #pragma omp barrier
                const int passes = w == 5 ? 2 : w == 6 ? 4 : 1;
                const double issue = now_us();
                for (int pass = 0; pass < passes; pass++)
                    for (int64_t i = 0; i < bytes; i += 64) switch (w) {
                        case 1: __builtin_prefetch(b + i, 0, 3); break;
                        case 2: case 5: case 6: __builtin_prefetch(b + i, 0, 2); break;
                        case 3: __builtin_prefetch(b + i, 0, 1); break;
                        case 4: __builtin_prefetch(b + i, 0, 0); break;
                        case PACED:
                            chain = paced_work(chain, pace);
                            __builtin_prefetch(b + i, 0, 2);
                            break;
                        case 8: sum += *(volatile const char *)(b + i); break;
                        case 9: sum += *(volatile const char *)(b + order[i / 64]); break;
                    }
                if (w == PACED) issued[tid * rounds + r] = now_us() - issue;
                for (const double t = now_us(); now_us() - t < wait_us;) {}
                #pragma omp barrier
                const double t = now_us();
                for (int64_t i = 0; i < lines; i++) sum += *(volatile const char *)(b + order[i]);
                times[((int64_t)tid * WAYS + w) * rounds + r] = now_us() - t;
            }
        free(region), free(other);
        total += sum;
    }
    free(order);
    return total;
}
"""


def way_medians(times: list[float], rounds: int, threads: int) -> list[float]:
    """Each way's median read over every thread's rounds, from the probe's `times`."""
    medians = []
    for w in range(len(WAYS)):
        starts = [(t * len(WAYS) + w) * rounds for t in range(threads)]
        medians.append(statistics.median(x for a in starts for x in times[a : a + rounds]))
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=float, default=0.5)
    parser.add_argument("--wait-us", default="0,100")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--pace", type=int, default=8, help="multiply and add steps a hint")
    parser.add_argument("--threads", type=int, default=1, help="cores probing at once")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lib = compile_scratch(Path(tmp), "prefetch_probe", PROBE)  # loaded: the file may go
    lib.probe.argtypes = [
        ctypes.c_int64, ctypes.c_double, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ]  # fmt: skip
    lib.probe.restype = ctypes.c_uint64
    size = int(args.mib * 2**20) // 64 * 64
    rounds, threads = args.rounds, args.threads
    for wait in (float(w) for w in args.wait_us.split(",")):
        count = threads * len(WAYS) * rounds
        times = (ctypes.c_double * count)(*[math.nan] * count)  # NaN until a thread writes it
        issued = (ctypes.c_double * (threads * rounds))()
        alone = (ctypes.c_double * (threads * rounds))()
        lib.probe(size, wait, rounds, args.pace, threads, times, issued, alone)
        if any(math.isnan(t) for t in times):
            raise SystemExit(f"fewer than {threads} threads ran the probe")
        issue_us, work_us = statistics.median(issued), statistics.median(alone)
        medians = way_medians(list(times), rounds, threads)
        cold, warm = medians[0], medians[-1]
        cores = "one core" if threads == 1 else f"{threads} cores at once, each its own"
        print(f"{size / 2**20:.2f} MiB, {cores}, read in a shuffled order {wait:.0f} us after:")
        for w, (way, took) in enumerate(zip(WAYS, medians, strict=True)):
            covered = (cold - took) / (cold - warm) if cold > warm else float("nan")
            share = f"  {covered:6.0%} of the way" if 0 < w < len(WAYS) - 1 else ""
            if w == PACED:
                per_line, work = (us * 1e3 / (size // 64) for us in (issue_us, work_us))
                share += f"  (hints {per_line:.1f} ns a line, {size / issue_us / 1e3:.1f} GB/s;"
                share += f" the work alone {work:.1f} ns)"
            print(f"  {way:<16} {took:8.1f} us{share}")


if __name__ == "__main__":
    main()
