"""The scheduling policies alone: admission order, victims, displacement and counters, on
sequences made by hand (no model)."""

from __future__ import annotations

import itertools

import pytest

from loraplex.engine.fairness import (
    Fairness,
    FairShare,
    FirstComeFirstServed,
    Tier,
    make_policy,
)
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence

_arrivals = itertools.count()


def seq(key: str, prompt: int = 8, tier: Tier = Tier.INTERACTIVE, weight: float = 1.0):
    made = Sequence(
        request_id=f"{key}-{next(_arrivals)}",
        index=0,
        params=SamplingParams(),
        token_ids=[1] * prompt,
        num_prompt_tokens=prompt,
        max_tokens=16,
        detokenizer=None,
        generator=None,
        fairness=Fairness(key, weight, tier),
    )
    return made


def keys(seqs) -> list[str]:
    return [s.fairness.key for s in seqs]


def test_fcfs_keeps_arrival_order_and_preempts_the_newest():
    policy = make_policy("fcfs", 4)
    assert isinstance(policy, FirstComeFirstServed)
    waiting = [seq("a"), seq("a"), seq("b")]
    assert policy.admission_order(waiting, []) == waiting
    running = [seq("a"), seq("b"), seq("c")]
    assert policy.victim(running, running) is running[-1]
    assert policy.displace(seq("d"), running) is None


def test_a_key_below_its_share_goes_before_a_flooding_one():
    policy = FairShare(max_num_seqs=4)
    running = [seq("a") for _ in range(4)]
    flood = [seq("a") for _ in range(6)]
    late = seq("b")
    for s in [*running, *flood, late]:
        policy.joined(s)
    order = policy.admission_order([*flood, late], running)
    assert order[0] is late  # b has no sequence running; its share is 2 of 4 slots
    assert policy.displace(late, running) is running[-1]  # a's newest makes way
    # a lone key is never displaced below its share, nor does it displace anyone
    assert policy.displace(flood[0], running) is None


def test_displacing_cannot_go_back_and_forth():
    policy = FairShare(max_num_seqs=4)
    running = [seq("a"), seq("a"), seq("b"), seq("b")]
    waiting_a, waiting_b = seq("a"), seq("b")
    for s in [*running, waiting_a, waiting_b]:
        policy.joined(s)
    # both hold their share (2 of 4): neither may take the other's slot
    assert policy.displace(waiting_a, running) is None
    assert policy.displace(waiting_b, running) is None


def test_counters_charge_tokens_by_weight_and_order_the_keys():
    policy = FairShare(max_num_seqs=8)
    heavy, light = seq("heavy", weight=2.0), seq("light")
    policy.joined(heavy)
    policy.joined(light)
    policy.charge(heavy, num_prompt=10, num_output=5)  # (10 + 2 * 5) / 2
    policy.charge(light, num_prompt=4, num_output=3)  # 4 + 2 * 3
    assert policy.counters[(0, "heavy")] == pytest.approx(10.0)
    assert policy.counters[(0, "light")] == pytest.approx(10.0)
    policy.charge(light, 1, 0)
    # both within their shares: the smaller counter goes first
    order = policy.admission_order([seq("light"), seq("heavy", weight=2.0)], [])
    assert keys(order) == ["heavy", "light"]


def test_a_key_back_from_idling_starts_at_the_busy_keys_smallest_counter():
    policy = FairShare(max_num_seqs=8)
    busy, idle = seq("busy"), seq("idle")
    policy.joined(busy)
    policy.charge(busy, 100, 0)
    returning = seq("idle")
    policy.joined(returning)  # idle had never been served: no credit for that
    assert policy.counters[(0, "idle")] == pytest.approx(100.0)
    policy.left(returning)
    policy.left(busy)
    policy.joined(idle)  # nobody busy: its own counter stands
    assert policy.counters[(0, "idle")] == pytest.approx(100.0)


def test_batch_comes_after_interactive_and_goes_first():
    policy = FairShare(max_num_seqs=4)
    batch = [seq("a", tier=Tier.BATCH) for _ in range(3)]
    interactive = [seq("b"), seq("c")]
    for s in [*batch, *interactive]:
        policy.joined(s)
    waiting = [*batch[2:], *interactive]
    assert policy.tiers(waiting) == [0, 1]
    assert keys(policy.admission_order(waiting, [])) == ["b", "c", "a"]
    running = [interactive[0], batch[0], batch[1]]
    assert policy.victim(running, running) is batch[1]  # the newest batch one
    assert policy.displace(interactive[1], running) is batch[1]
    assert policy.displace(batch[2], running) is None


def test_memory_victim_is_the_newest_of_the_key_furthest_over_its_share():
    policy = FairShare(max_num_seqs=4)
    running = [seq("a"), seq("b"), seq("b"), seq("b")]
    for s in running:
        policy.joined(s)
    assert policy.victim(running, running) is running[-1]
    # with no key over its share, the newest goes, as first come, first served does
    even = [seq("a"), seq("a"), seq("b"), seq("b")]
    fresh = FairShare(max_num_seqs=4)
    for s in even:
        fresh.joined(s)
    assert fresh.victim(even[1:], even) is even[-1]


def test_fairness_is_checked():
    with pytest.raises(ValueError):
        Fairness("a", weight=0.0)
    with pytest.raises(TypeError):
        Fairness("a", tier="batch")
