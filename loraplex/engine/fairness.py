"""Who goes first when sequences compete for the machine: the scheduler's one replaceable policy.

The scheduler owns the mechanics (token budget, pages, preemption); a policy only orders. It
answers four questions: in which order waiting sequences are admitted, which running sequence
goes when memory is short, which running sequence a waiting one may displace, and what to charge
once tokens are computed. Two policies:

- `FirstComeFirstServed`: arrival order, the newest preempted first; no tiers (vLLM's default).
- `FairShare` (the default): each request carries an opaque fairness key (the platform passes
  the tenant), a weight and a tier. Within a tier, waiting sequences go in the order of a virtual
  token counter per key (VTC, Sheng et al., arXiv 2401.00588): prompt tokens computed count 1,
  output tokens 2, divided by the key's weight, the smallest counter first. A key that comes back
  after idling starts at the smallest counter of the keys with work, so idling banks no credit
  (and on a tie it goes first when it runs fewer sequences than its share). Each key with work
  is entitled to a share of the sequence slots in proportion to its weight: the first sequence
  in line, when its key is below its share and no slot or no room is left, displaces the newest
  sequence of the key furthest above its share, never taking that key below its share (so two
  keys cannot take a slot back and forth). The interactive tier is served before the batch
  tier, batch sequences are the first preempted, and an interactive sequence first in line
  displaces running batch ones. A lone key gets the whole machine: nothing holds capacity back.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from loraplex.engine.sequence import Sequence

PROMPT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0  # as in the VTC paper: an output token costs a step; a prompt token less
MAX_IDLE_COUNTERS = 10_000  # counters of keys with no work, kept to remember recent heavy use


class Tier(enum.IntEnum):
    """Lower is served first."""

    INTERACTIVE = 0
    BATCH = 1


@dataclass(frozen=True)
class Fairness:
    """Whom a request is served for. The engine knows no tenants: `key` is opaque."""

    key: str = ""
    weight: float = 1.0
    tier: Tier = Tier.INTERACTIVE

    def __post_init__(self) -> None:
        if not isinstance(self.key, str):
            raise TypeError("fairness key must be a string")
        if not (isinstance(self.weight, int | float) and 0.0 < self.weight <= 1000.0):
            raise ValueError(f"fairness weight must be in (0, 1000], got {self.weight!r}")
        if not isinstance(self.tier, Tier):
            raise TypeError(f"tier must be a Tier, got {self.tier!r}")


DEFAULT_FAIRNESS = Fairness()


class SchedulingPolicy(Protocol):
    def tiers(self, seqs: list[Sequence]) -> list[int]:
        """The tiers to schedule, in order, among these sequences."""

    def tier(self, seq: Sequence) -> int: ...

    def joined(self, seq: Sequence) -> None:
        """`seq` arrived (not a preempted one coming back)."""

    def left(self, seq: Sequence) -> None:
        """`seq` finished or was aborted."""

    def charge(self, seq: Sequence, num_prompt: int, num_output: int) -> None:
        """Tokens of `seq` computed for the first time this step."""

    def admission_order(self, waiting: list[Sequence], running: list[Sequence]) -> list[Sequence]:
        """`waiting` (preempted ones first, then in arrival order) in the order to admit them."""

    def victim(self, candidates: list[Sequence], running: list[Sequence]) -> Sequence:
        """The sequence to preempt, among `candidates` (running ones not yet scheduled this step,
        in admission order), when memory is short."""

    def displace(self, seq: Sequence, running: list[Sequence]) -> Sequence | None:
        """A running sequence that waiting `seq` may take the place of, or None."""


class FirstComeFirstServed:
    def tiers(self, seqs: list[Sequence]) -> list[int]:
        return [0]

    def tier(self, seq: Sequence) -> int:
        return 0

    def joined(self, seq: Sequence) -> None:
        pass

    def left(self, seq: Sequence) -> None:
        pass

    def charge(self, seq: Sequence, num_prompt: int, num_output: int) -> None:
        pass

    def admission_order(self, waiting: list[Sequence], running: list[Sequence]) -> list[Sequence]:
        return waiting

    def victim(self, candidates: list[Sequence], running: list[Sequence]) -> Sequence:
        return candidates[-1]

    def displace(self, seq: Sequence, running: list[Sequence]) -> Sequence | None:
        return None


class FairShare:
    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.counters: dict[tuple[int, str], float] = {}
        self._live: Counter[tuple[int, str]] = Counter()  # sequences waiting or running, by key
        self._weights: dict[tuple[int, str], float] = {}

    @staticmethod
    def _key(seq: Sequence) -> tuple[int, str]:
        return (int(seq.fairness.tier), seq.fairness.key)

    def tiers(self, seqs: list[Sequence]) -> list[int]:
        return sorted({int(seq.fairness.tier) for seq in seqs})

    def tier(self, seq: Sequence) -> int:
        return int(seq.fairness.tier)

    # -- counters ---------------------------------------------------------------------------

    def joined(self, seq: Sequence) -> None:
        key = self._key(seq)
        self._weights[key] = seq.fairness.weight
        if self._live[key] == 0:
            busy = [
                self.counters.get(k, 0.0) for k, n in self._live.items() if n and k[0] == key[0]
            ]
            if busy:  # coming back after idling: no credit banked
                self.counters[key] = max(self.counters.get(key, 0.0), min(busy))
            self._forget_idle()
        self._live[key] += 1

    def left(self, seq: Sequence) -> None:
        key = self._key(seq)
        self._live[key] -= 1
        if self._live[key] <= 0:
            del self._live[key]

    def charge(self, seq: Sequence, num_prompt: int, num_output: int) -> None:
        key = self._key(seq)
        cost = num_prompt * PROMPT_TOKEN_COST + num_output * OUTPUT_TOKEN_COST
        self.counters[key] = self.counters.get(key, 0.0) + cost / seq.fairness.weight

    def _forget_idle(self) -> None:
        if len(self.counters) <= len(self._live) + MAX_IDLE_COUNTERS:
            return
        floor = min((self.counters.get(k, 0.0) for k in self._live), default=0.0)
        # an idle key at or below the floor would be lifted to it on return: nothing to remember
        self.counters = {k: c for k, c in self.counters.items() if k in self._live or c > floor}

    # -- shares -----------------------------------------------------------------------------

    def _shares(self, tier: int) -> dict[tuple[int, str], float]:
        keys = [k for k, n in self._live.items() if n and k[0] == tier]
        total = sum(self._weights.get(k, 1.0) for k in keys)
        return {k: self.max_num_seqs * self._weights.get(k, 1.0) / total for k in keys}

    def _running_by_key(self, running: list[Sequence]) -> Counter[tuple[int, str]]:
        return Counter(self._key(seq) for seq in running)

    def _below_share(self, key, shares, running_by_key) -> bool:
        """One more running sequence would keep `key` within its share."""
        return running_by_key[key] + 1 <= shares.get(key, 0.0) + 1e-9

    def admission_order(self, waiting: list[Sequence], running: list[Sequence]) -> list[Sequence]:
        running_by_key = self._running_by_key(running)
        shares = {tier: self._shares(tier) for tier in self.tiers(waiting)}
        tags: dict[tuple[int, str], float] = {}
        ranked = []
        for position, seq in enumerate(waiting):
            key = self._key(seq)
            tag = tags.get(key, self.counters.get(key, 0.0))
            below = self._below_share(key, shares[key[0]], running_by_key)
            ranked.append((key[0], tag, not below, position))
            # the sequences behind it in its key's queue wait for it to be charged
            tokens = max(seq.num_tokens - seq.num_computed_tokens, 1)
            tags[key] = tag + tokens * PROMPT_TOKEN_COST / seq.fairness.weight
        ranked.sort()
        return [waiting[position] for *_, position in ranked]

    def _most_over_share(self, seqs: list[Sequence], running: list[Sequence], tier: int):
        """Among `seqs` of `tier`, the newest of the key furthest above its share, if any key is
        at least one sequence above it (so that it stays at or above its share without it)."""
        shares = self._shares(tier)
        running_by_key = self._running_by_key(running)
        best, best_excess = None, 0.0
        for seq in seqs:  # in admission order: a later one of the same key is newer
            key = self._key(seq)
            if key[0] != tier:
                continue
            excess = running_by_key[key] - shares.get(key, 0.0)
            if excess >= 1.0 - 1e-9 and (best is None or excess >= best_excess):
                best, best_excess = seq, excess
        return best

    def victim(self, candidates: list[Sequence], running: list[Sequence]) -> Sequence:
        lowest = max(self.tier(seq) for seq in candidates)
        if lowest > min(self.tier(seq) for seq in candidates):
            return [seq for seq in candidates if self.tier(seq) == lowest][-1]
        return self._most_over_share(candidates, running, lowest) or candidates[-1]

    def displace(self, seq: Sequence, running: list[Sequence]) -> Sequence | None:
        tier = self.tier(seq)
        lower = [other for other in running if self.tier(other) > tier]
        if lower:
            return lower[-1]
        key = self._key(seq)
        if not self._below_share(key, self._shares(tier), self._running_by_key(running)):
            return None
        return self._most_over_share(running, running, tier)


def make_policy(name: str, max_num_seqs: int) -> SchedulingPolicy:
    if name == "fcfs":
        return FirstComeFirstServed()
    return FairShare(max_num_seqs)
