"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

Each step has a token budget. Running sequences go first, in arrival order, so decodes never wait
behind a long prompt: a prompt only gets what the budget has left (chunked prefill). Waiting
sequences are admitted first come, first served while budget, sequence slots and pages last.

Memory is one pool: a sequence's next pages of KV and, if its adapter is not resident, the
adapter's pages are counted together, and idle adapters (no running user, not pinned) are evicted
least recently used first before any sequence is preempted. When a running sequence still cannot
grow, the newest running sequence is preempted: its pages are freed and it is recomputed from its
tokens later (nothing is sampled twice).

When the head of the queue waits for room to load its adapter, requests behind it whose adapters
are already resident may go first (no load, no thrash), for at most MAX_BYPASS_STEPS steps; after
that nobody overtakes it until it runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from loraplex.engine.adapters.manager import AdapterManager, ResidentAdapter
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.sequence import Sequence, Status

MAX_BYPASS_STEPS = 16


@dataclass(frozen=True)
class Scheduled:
    """One sequence's share of a step: its next `num_new` tokens, with its resident adapter."""

    seq: Sequence
    num_new: int
    adapter: ResidentAdapter | None


@dataclass
class SchedulerOutput:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        adapters: AdapterManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
    ) -> None:
        self.kv = kv
        self.adapters = adapters
        self.pool = kv.pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:  # memory is short: admitting more would only thrash
            self._schedule_waiting(out, budget)
        return out

    # -- memory ----------------------------------------------------------------------------

    def _pages_needed(self, seq: Sequence, num_new: int) -> int:
        kv = self.kv.num_missing_pages(seq.block_table, seq.num_computed_tokens + num_new)
        return kv + (0 if seq.holds_adapter else self.adapters.pages_to_load(seq.adapter))

    def _fits(self, seq: Sequence, num_new: int) -> bool:
        available = self.pool.num_available + self.adapters.evictable_pages(keep=seq.adapter)
        return self._pages_needed(seq, num_new) <= available

    def _reserve(self, seq: Sequence, num_new: int) -> Scheduled:
        """Take the pages `seq` needs for `num_new` more tokens (it must fit)."""
        self.adapters.free_up(self._pages_needed(seq, num_new), keep=seq.adapter)
        adapter = None
        if seq.adapter is not None:
            if seq.holds_adapter:
                adapter = self.adapters.resident[seq.adapter.content_hash]
            else:
                adapter = self.adapters.acquire(seq.adapter)
                seq.holds_adapter = True
        self.kv.grow(seq.block_table, seq.num_computed_tokens + num_new)
        return Scheduled(seq, num_new, adapter)

    # -- running ---------------------------------------------------------------------------

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, num_new, out):
                break  # seq itself was preempted; it was the last running one
            out.scheduled.append(self._reserve(seq, num_new))
            budget -= num_new
            i += 1
        return budget

    def _make_room(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until `seq` fits; False if `seq` went."""
        while not self._fits(seq, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.kv.release(seq)
        if seq.holds_adapter:
            self.adapters.release(seq.adapter)
            seq.holds_adapter = False

    # -- waiting ---------------------------------------------------------------------------

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[index]
            self.kv.attach(seq)  # its longest cached prefix, if any, is computed already
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            overtaking = index > 0
            if self._fits(seq, num_new) and not (overtaking and self._needs_load(seq)):
                del self.waiting[index]
                self._admit(seq, num_new, out)
                self.kv.num_hit_tokens += seq.num_computed_tokens
                budget -= num_new
                continue
            self.kv.detach(seq)
            if overtaking or self._may_be_overtaken(seq):
                index += 1
            else:
                break  # first come, first served

    def _needs_load(self, seq: Sequence) -> bool:
        return self.adapters.pages_to_load(seq.adapter) > 0

    def _may_be_overtaken(self, head: Sequence) -> bool:
        if not self._needs_load(head) or head.num_bypassed >= MAX_BYPASS_STEPS:
            return False
        head.num_bypassed += 1
        return True

    def _admit(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        out.scheduled.append(self._reserve(seq, num_new))
        seq.status = Status.RUNNING
        self.running.append(seq)

    # -- after the step --------------------------------------------------------------------

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the step ran; drop finished sequences."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new
            self.kv.name_full_pages(item.seq)
        if any(item.seq.is_finished for item in out.scheduled):
            still_running = []
            for seq in self.running:
                if seq.is_finished:
                    self._release(seq)
                else:
                    still_running.append(seq)
            self.running = still_running

    def sequences(self):
        """Every sequence the scheduler holds, waiting or running."""
        yield from self.waiting
        yield from self.running

    def abort(self, seqs: list[Sequence]) -> None:
        """Remove these sequences wherever they are and free their pages."""
        doomed = set(map(id, seqs))
        self.waiting = deque(s for s in self.waiting if id(s) not in doomed)
        self.running = [s for s in self.running if id(s) not in doomed]
        for seq in seqs:
            self._release(seq)
            seq.status = Status.FINISHED
