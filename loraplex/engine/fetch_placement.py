"""Where a decode step brings a layer's q,k,v LoRA rows into cache, chosen by timing steps here.

Where the native projection fetches all its call's rows (bfloat16 on AVX512-BF16 without AMX,
float32 on Zen 2, 4 and 5; Zen 3 and Intel's fetch the A rows alone), a layer's q,k,v adapter rows
can be fetched by the q,k,v projection itself or, where the layer before's gate_up has no LoRA call
of its own (q,v adapters), by that gate_up (`CausalLM._next_qkv_rows`). Which is faster depends on
the CPU and the dtype (in float32 on Zen 4 the rows fetched during the gate_up were no longer in
cache when read: 5.3 against 3.9 ms a step of 30 layers, scratch). On 32 q,v adapters in bfloat16,
in extra step time over base, alternated rounds in one process:

* 2-core Zen 5: gate_up ahead lower by about 0.1 ms in each of 12 rounds while the projection
  made its LoRA call after it; since it makes the shrinks between its own items (lora.c, the
  two passes), its own fetch is the lower, 1.33 against 1.60 and 1.30 against 1.72 ms;
* 2-core Zen 4: the projection's own fetch lower, 1.52 against 1.85 ms (7 of 8 rounds), 2.04
  against 2.52 and 2.09 against 2.29 ms in two other runs. Its projections take about twice as
  long (512-bit dot products in two halves), with bandwidth to spare.

So the model times it: consecutive steps that could fetch ahead and have as many tokens are
paired, one step of a pair each way (which goes first alternates), and after `pairs` pairs the
way with the lower median of the pairs' differences is kept for the next `keep` such steps; then
it is measured again, as a shared host's bandwidth changes. A fetch changes no result, only the
time a step takes.
"""

from __future__ import annotations

import math
import statistics

PAIRS = 64  # pairs of steps a measurement takes
KEEP = 4096  # steps that fetch as measured before the next measurement


class FetchPlacement:
    def __init__(self, pairs: int = PAIRS, keep: int = KEEP) -> None:
        self.pairs, self.keep = pairs, keep
        self.ahead = True  # until measured: the choice on the machine it was first tuned on
        self._kept: float = 0  # steps left to fetch as measured (inf: for good, fix)
        self._differences: list[float] = []  # seconds of the ahead step minus the other's
        self._first: tuple[bool, int, float] | None = None  # the pair's first step so far

    def fix(self, ahead: bool) -> None:
        """Fetch one way from now on, never measuring again (benchmarks that compare other
        things under one placement)."""
        self.ahead, self._kept = ahead, math.inf

    def choose(self) -> bool:
        """Whether the next step that could fetch ahead does so (`record` its time after)."""
        if self._kept:
            return self.ahead
        if self._first is None:
            return len(self._differences) % 2 == 0
        return not self._first[0]

    def record(self, ahead: bool, tokens: int, seconds: float) -> None:
        """A step that could fetch ahead: whether it did, its tokens and the seconds it took."""
        if self._kept:
            self._kept -= 1
            return
        first, self._first = self._first, None
        if first is None or first[1] != tokens or first[0] == ahead:
            self._first = (ahead, tokens, seconds)  # a pair starts here
            return
        ahead_seconds, other_seconds = (first[2], seconds) if first[0] else (seconds, first[2])
        self._differences.append(ahead_seconds - other_seconds)
        if len(self._differences) == self.pairs:
            self.ahead = statistics.median(self._differences) <= 0
            self._differences.clear()
            self._kept = self.keep
