"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

Each step has a token budget. Running sequences go first, so decodes never wait behind a long
prompt: a prompt only gets what the budget has left (chunked prefill). Waiting sequences are
admitted while budget, sequence slots and pages last, in the order the policy gives
(loraplex.engine.fairness: fair shares between tenants by default, or first come, first served).
With tiers, each tier runs its running then its waiting sequences before the next tier starts,
and a lower tier is admitted only while no sequence of a higher one waits.

Memory is one pool: a sequence's next pages of KV and, if its adapter is not resident, the
adapter's pages are counted together, and idle adapters (no running user, not pinned) are evicted
least recently used first before any sequence is preempted. When a running sequence still cannot
grow, a running sequence not yet scheduled this step is preempted (the policy picks which; first
come, first served picks the newest): its pages are freed and it is recomputed from its tokens
later (nothing is sampled twice). Before a step, the first sequence in admission order that finds
no slot or no room may displace running ones the policy names (a tenant above its fair share, or
batch work), and is then admitted.

When the first sequence in admission order waits for room to load its adapter, sequences behind
it whose adapters are already resident may go first (no load, no thrash), for at most
MAX_BYPASS_STEPS steps; after that nobody overtakes it until it runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.engine.adapters.manager import AdapterManager, ResidentAdapter
from loraplex.engine.fairness import FirstComeFirstServed, SchedulingPolicy
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
    preempted: list[Sequence] = field(default_factory=list)  # memory was short
    displaced: list[Sequence] = field(default_factory=list)  # made way for a waiting sequence

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
        policy: SchedulingPolicy | None = None,
    ) -> None:
        self.kv = kv
        self.adapters = adapters
        self.pool = kv.pool
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy: SchedulingPolicy = policy or FirstComeFirstServed()
        self.waiting: list[Sequence] = []  # preempted ones first, then in arrival order
        self.running: list[Sequence] = []  # by tier, then in admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.policy.joined(seq)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        order = self._displace(out)
        budget = self.max_num_batched_tokens
        admitting = True
        for tier in self.policy.tiers([*self.running, *self.waiting]):
            if out.scheduled and any(item.num_new > 1 for item in out.scheduled):
                break  # a higher tier's prompt runs in a step of its own: sooner first token
            budget = self._schedule_running(out, budget, tier)
            # memory is short (admitting more would only thrash), or a sequence of a higher tier
            # still waits (no lower tier goes before it)
            if admitting and not out.preempted:
                waiting = [seq for seq in order if self.policy.tier(seq) == tier]
                admitting = self._schedule_waiting(out, budget, tier, waiting)
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

    def _schedule_running(self, out: SchedulerOutput, budget: int, tier: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.policy.tier(seq) != tier:
                if self.policy.tier(seq) > tier:
                    break  # the rest belong to lower tiers
                i += 1
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(i, num_new, out):
                continue  # seq itself was preempted: the next one is at i now
            out.scheduled.append(self._reserve(seq, num_new))
            budget -= num_new
            i += 1
        return budget

    def _make_room(self, i: int, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt running sequences not yet scheduled (from i on) until running[i] fits;
        False if running[i] itself went."""
        seq = self.running[i]
        while not self._fits(seq, num_new):
            victim = self.policy.victim(self.running[i:], self.running)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.insert(0, seq)  # first in line again: it had started
        self.num_preemptions += 1

    def _displace(self, out: SchedulerOutput) -> list[Sequence]:
        """The first waiting sequence in admission order, if it finds no slot or no room, takes
        the place of running ones the policy names. -> the waiting sequences in admission order
        (the step's one order: until the step ends, only a preemption, after which nobody is
        admitted, could change it)."""
        if not self.waiting:
            return []
        order = self.policy.admission_order(self.waiting, self.running)
        seq, num_new = order[0], self._first_chunk(order[0])
        while len(self.running) >= self.max_num_seqs or not self._fits(seq, num_new):
            victim = self.policy.displace(seq, self.running)
            if victim is None:
                break
            self._preempt(victim)
            out.displaced.append(victim)
        if out.displaced:
            order = self.policy.admission_order(self.waiting, self.running)
        return order

    def _first_chunk(self, seq: Sequence) -> int:
        return min(seq.num_tokens - seq.num_computed_tokens, self.max_num_batched_tokens)

    def _release(self, seq: Sequence) -> None:
        self.kv.release(seq)
        if seq.holds_adapter:
            self.adapters.release(seq.adapter)
            seq.holds_adapter = False

    # -- waiting ---------------------------------------------------------------------------

    def _schedule_waiting(
        self, out: SchedulerOutput, budget: int, tier: int, order: list[Sequence]
    ) -> bool:
        """Admit from `order` (one tier's waiting sequences, in admission order; consumed);
        True if none of them is left waiting."""
        index = 0
        while index < len(order) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = order[index]
            self.kv.attach(seq)  # its longest cached prefix, if any, is computed already
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            overtaking = index > 0
            if self._fits(seq, num_new) and not (overtaking and self._needs_load(seq)):
                del order[index]
                self.waiting.remove(seq)
                self._admit(seq, num_new, tier, out)
                self.kv.num_hit_tokens += seq.num_computed_tokens
                budget -= num_new
                continue
            self.kv.detach(seq)
            if overtaking or self._may_be_overtaken(seq):
                index += 1
            else:
                break  # nobody overtakes it
        return not order

    def _needs_load(self, seq: Sequence) -> bool:
        return self.adapters.pages_to_load(seq.adapter) > 0

    def _may_be_overtaken(self, head: Sequence) -> bool:
        if not self._needs_load(head) or head.num_bypassed >= MAX_BYPASS_STEPS:
            return False
        head.num_bypassed += 1
        return True

    def _admit(self, seq: Sequence, num_new: int, tier: int, out: SchedulerOutput) -> None:
        out.scheduled.append(self._reserve(seq, num_new))
        seq.status = Status.RUNNING
        # after its tier's running sequences, before any lower tier's
        end = next(
            (i for i, other in enumerate(self.running) if self.policy.tier(other) > tier),
            len(self.running),
        )
        self.running.insert(end, seq)

    # -- after the step --------------------------------------------------------------------

    def update(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the step ran; drop finished sequences."""
        for item in out.scheduled:
            seq = item.seq
            self._charge(seq, seq.num_computed_tokens + item.num_new)
            seq.num_computed_tokens += item.num_new
            self.kv.name_full_pages(seq)
        if any(item.seq.is_finished for item in out.scheduled):
            still_running = []
            for seq in self.running:
                if seq.is_finished:
                    self._release(seq)
                    self.policy.left(seq)
                else:
                    still_running.append(seq)
            self.running = still_running

    def _charge(self, seq: Sequence, computed: int) -> None:
        """Tokens computed for the first time go to the policy (a recomputed prefix, after a
        preemption, or a cached one does not)."""
        start = max(seq.num_computed_tokens, seq.num_charged_tokens)
        if computed <= start:
            return
        prompt_end = seq.num_prompt_tokens
        num_prompt = max(0, min(computed, prompt_end) - start)
        self.policy.charge(seq, num_prompt, computed - start - num_prompt)
        seq.num_charged_tokens = computed

    def sequences(self):
        """Every sequence the scheduler holds, waiting or running."""
        yield from self.waiting
        yield from self.running

    def abort(self, seqs: list[Sequence]) -> None:
        """Remove these sequences wherever they are and free their pages."""
        doomed = set(map(id, seqs))
        for seq in self.sequences():
            if id(seq) in doomed:
                self.policy.left(seq)
        self.waiting = [s for s in self.waiting if id(s) not in doomed]
        self.running = [s for s in self.running if id(s) not in doomed]
        for seq in seqs:
            self._release(seq)
            seq.status = Status.FINISHED
