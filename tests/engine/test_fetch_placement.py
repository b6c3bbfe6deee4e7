"""The choice of where a decode step fetches its q,k,v LoRA rows follows the steps' timings: the
way that took less time is kept, pairs spoilt by a change of batch size do not count, and the
choice is measured again after a while. (The fetch changes no result: the engine's outputs are
checked against PEFT elsewhere with both ways alternating.)"""

from __future__ import annotations

import random

import pytest

from loraplex.engine.fetch_placement import FetchPlacement


def drive(placement: FetchPlacement, sizes: list[int], seconds) -> list[bool]:
    """Steps of `sizes` tokens, each taking seconds(ahead, tokens) -> the choice of each."""
    chosen = []
    for tokens in sizes:
        ahead = placement.choose()
        chosen.append(ahead)
        placement.record(ahead, tokens, seconds(ahead, tokens))
    return chosen


def noisy(ahead_ms: float, own_ms: float, seed: int = 0):
    rng = random.Random(seed)
    return lambda ahead, tokens: ((ahead_ms if ahead else own_ms) + rng.gauss(0, 0.3)) / 1e3


def test_the_faster_way_is_kept_then_measured_again():
    for ahead_ms, own_ms, expected in ((35.5, 35.0, False), (35.0, 35.5, True)):
        placement = FetchPlacement(pairs=16, keep=50)
        measuring = drive(placement, [32] * 32, noisy(ahead_ms, own_ms))
        assert measuring.count(True) == measuring.count(False) == 16  # one of each a pair
        assert drive(placement, [32] * 50, noisy(ahead_ms, own_ms)) == [expected] * 50
        again = drive(placement, [32] * 4, noisy(ahead_ms, own_ms))
        assert again.count(True) == again.count(False) == 2


def test_a_pair_whose_batch_changed_size_does_not_count():
    placement = FetchPlacement(pairs=4, keep=10)
    # each step's batch one token smaller than the last, the ahead steps 100x faster: counted,
    # these would settle on fetching ahead
    drive(placement, list(range(64, 32, -1)), lambda ahead, tokens: 0.001 if ahead else 0.1)
    # 4 pairs of one size, where fetching ahead is the slower, decide
    drive(placement, [32] * 8, lambda ahead, tokens: 0.036 if ahead else 0.035)
    assert drive(placement, [32] * 10, noisy(35.0, 35.0)) == [False] * 10


@pytest.mark.parametrize("ahead", [True, False])
def test_a_fixed_way_is_kept_whatever_the_timings(ahead):
    placement = FetchPlacement(pairs=4, keep=10)
    placement.fix(ahead)

    def slower(way: bool, tokens: int) -> float:  # the fixed way: measured, it would lose
        return 0.1 if way == ahead else 0.001

    assert drive(placement, [32] * 40, slower) == [ahead] * 40
