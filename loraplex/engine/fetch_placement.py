"""How a decode step brings its LoRA rows into cache, chosen by timing steps here.

Where the native projection fetches (bfloat16 on AVX512-BF16 without AMX; float32 on AMD's and on
Intel's with AVX512-FP16), a step may take one of these ways (`Ways`), as its batch allows:

* AHEAD: where the layer before's gate_up has no LoRA call of its own (q,v adapters), that
  gate_up fetches a layer's q,k,v adapter rows (`CausalLM._next_qkv_rows`), the q,k,v
  projection none;
* ALL: each projection fetches all of its own LoRA call's rows (A and B);
* SHRINKS: each projection making its LoRA call in its own native call fetches that call's A rows
  alone, the expands reading the B rows from memory (float32 alone: cpu/linear_f32.c).

Which is faster depends on the CPU, the dtype, the host and the batch's modules. On 32 q,v adapters
in bfloat16, extra step time over base, alternated rounds in one process: on a 2-core Zen 5, ALL
1.33 against AHEAD 1.60 ms and 1.30 against 1.72 ms; on a 2-core Zen 4, ALL 1.52 against 1.85 ms,
2.04 against 2.52; in float32 on Zen 4 the rows AHEAD fetched were no longer in cache when read
(5.3 against 3.9 ms a step of 30 layers). In float32 (benchmarks/projection_ab.py, medians of
30-40 rounds): on a slower Zen 3 host SHRINKS 8.66 and 7.36 against ALL 11.20 and 11.45 ms on q,v,
30.49 and 32.78 against 42.89 and 36.15 ms all-module, where a faster one had them level on q,v
and SHRINKS 3.8 ms higher all-module; on Zen 2 SHRINKS lower on q,v (5.93 against 6.92 ms, 6.55
against 8.42) and higher all-module (28.3 against 25.9 ms); on Zen 5 the same split by 0.4-0.6 ms.
On a fourth Zen 3 host, steps of every way one after another as while serving (scratch, 60
rounds): level on q,v, AHEAD 2 ms behind; all-module SHRINKS 7.7 ms lower (docs/performance.md,
"Zen 3, the fetch timed").

So the model times them, apart for each set of ways and of projections with LoRA a batch has
(`key`): consecutive steps with as many tokens make a round, each way taking one step of it
(which goes first turns round by round); after `rounds` rounds the way whose steps took the least
against their rounds' mean, by the median over the rounds, is kept for the next `keep` such steps,
and then they are measured again, as a shared host's bandwidth changes. A fetch changes no result,
only the time a step takes.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable

AHEAD, ALL, SHRINKS = "ahead", "all", "shrinks"
Ways = tuple[str, ...]  # the ways a step can fetch, the one taken until measured first

ROUNDS = 64  # rounds of steps a measurement takes
KEEP = 4096  # steps that fetch as measured before the next measurement


class FetchPlacement:
    """The way each step fetches, timed apart for each key (the batch's ways and modules)."""

    def __init__(self, rounds: int = ROUNDS, keep: int = KEEP) -> None:
        self.rounds, self.keep = rounds, keep
        self.fixed: str | None = None
        self._timers: dict[Hashable, _WayTimer] = {}

    def fix(self, way: str) -> None:
        """Fetch `way` from now on wherever a step can, else its first way, never measuring
        (benchmarks and tests that compare other things under one way)."""
        self.fixed = way

    def choose(self, key: Hashable, ways: Ways) -> str:
        """The way the next step of `ways` (under `key`) fetches; `record` its time after."""
        if self.fixed is None and len(ways) > 1:
            return self._timer(key, ways).choose()
        return self.chosen(key, ways)

    def chosen(self, key: Hashable, ways: Ways) -> str:
        """The way kept under `key` (the fixed one where a step can take it), or taken until
        measured."""
        if self.fixed is not None:
            return self.fixed if self.fixed in ways else ways[0]
        timer = self._timers.get(key)
        return timer.chosen if timer is not None else ways[0]

    def measuring(self, key: Hashable, ways: Ways) -> bool:
        """Whether the next steps of `ways` under `key` take the ways in turn to time them (none
        kept yet, or the kept way's steps run out), not the one way kept."""
        if self.fixed is not None or len(ways) < 2:
            return False
        timer = self._timers.get(key)
        return timer is None or timer.kept == 0

    def record(self, key: Hashable, ways: Ways, way: str, tokens: int, seconds: float) -> None:
        """A step of `ways` under `key`: the way it took, its tokens and the seconds it took."""
        if self.fixed is None and len(ways) > 1:
            self._timer(key, ways).record(way, tokens, seconds)

    def _timer(self, key: Hashable, ways: Ways) -> _WayTimer:
        timer = self._timers.get(key)
        if timer is None:
            timer = self._timers[key] = _WayTimer(ways, self.rounds, self.keep)
        return timer


class _WayTimer:
    """One key's measurement (FetchPlacement)."""

    def __init__(self, ways: Ways, rounds: int, keep: int) -> None:
        self.ways, self.rounds, self.keep = ways, rounds, keep
        self.chosen = ways[0]
        self.kept = 0  # steps left to fetch as measured
        self._round: list[tuple[str, float]] = []  # the round's steps so far: way, seconds
        self._tokens = 0  # the round's steps' tokens
        self._done = 0  # rounds of this measurement
        self._spread: dict[str, list[float]] = {way: [] for way in ways}  # against rounds' means

    def choose(self) -> str:
        if self.kept:
            return self.chosen
        taken = {way for way, _ in self._round}
        turn = self._done % len(self.ways)
        order = self.ways[turn:] + self.ways[:turn]
        return next(way for way in order if way not in taken)

    def record(self, way: str, tokens: int, seconds: float) -> None:
        if self.kept:
            self.kept -= 1
            return
        if tokens != self._tokens or any(way == taken for taken, _ in self._round):
            self._round.clear()  # a round starts here
        self._tokens = tokens
        self._round.append((way, seconds))
        if len(self._round) < len(self.ways):
            return
        mean = statistics.fmean(s for _, s in self._round)
        for taken, s in self._round:
            self._spread[taken].append(s - mean)
        self._round.clear()
        self._done += 1
        if self._done == self.rounds:
            self.chosen = min(self.ways, key=lambda w: statistics.median(self._spread[w]))
            for spread in self._spread.values():
                spread.clear()
            self._done, self.kept = 0, self.keep
