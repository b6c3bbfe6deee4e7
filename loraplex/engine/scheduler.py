"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

Each step has a token budget. Running sequences go first, in arrival order, so decodes never wait
behind a long prompt: a prompt only gets what the budget has left (chunked prefill). Waiting
sequences are admitted first come, first served while budget, sequence slots and pages last.
When a running sequence needs a page and none is free, the newest running sequence is preempted:
its pages are freed and it is recomputed from its tokens later (nothing is sampled twice).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.sequence import Sequence, Status


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, num_new_tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_batched_tokens(self) -> int:
        return sum(num_new for _, num_new in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:  # memory is short: admitting more would only thrash
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, num_new, out):
                break  # seq itself was preempted; it was the last running one
            self.kv.grow(seq.block_table, seq.num_computed_tokens + num_new)
            out.scheduled.append((seq, num_new))
            budget -= num_new
            i += 1
        return budget

    def _make_room(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until `seq` can grow; False if `seq` went."""
        while not self.kv.can_grow(seq.block_table, seq.num_computed_tokens + num_new):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.can_grow(seq.block_table, seq.num_computed_tokens + num_new):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.kv.grow(seq.block_table, seq.num_computed_tokens + num_new)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.kv.release(seq.block_table)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the step ran; drop finished sequences."""
        for seq, num_new in out.scheduled:
            seq.num_computed_tokens += num_new
        if any(seq.is_finished for seq, _ in out.scheduled):
            self._drop_finished()

    def _drop_finished(self) -> None:
        still_running = []
        for seq in self.running:
            if seq.is_finished:
                self.kv.release(seq.block_table)
            else:
                still_running.append(seq)
        self.running = still_running

    def abort(self, seqs: list[Sequence]) -> None:
        """Remove these sequences wherever they are and free their pages."""
        doomed = set(map(id, seqs))
        self.waiting = deque(s for s in self.waiting if id(s) not in doomed)
        self.running = [s for s in self.running if id(s) not in doomed]
        for seq in seqs:
            self.kv.release(seq.block_table)
            seq.status = Status.FINISHED
