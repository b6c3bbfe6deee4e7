"""The choice of how a decode step fetches its LoRA rows follows the steps' timings: the way that
took less time is kept, apart for each key (a batch's ways and modules), rounds spoilt by a change
of batch size do not count, the choice is measured again after a while, and a fixed way is kept.
An engine decoding on adapters keeps the way its steps were faster in. (The fetch changes no
result: the engine's outputs are checked against PEFT elsewhere, and
tests/engine/test_fused_layers.py gives the same bits under each way.)"""

from __future__ import annotations

import random
import time

import pytest

from loraplex import LoRARequest, SamplingParams
from loraplex.engine.adapters.peft_format import MODULES, random_peft_adapter
from loraplex.engine.fetch_placement import AHEAD, ALL, SHRINKS, FetchPlacement
from loraplex.engine.lora_steps import BatchSteps
from tests.factories import make_llm

TWO = (AHEAD, ALL)
THREE = (SHRINKS, AHEAD, ALL)


def drive(placement: FetchPlacement, sizes: list[int], seconds, ways=TWO, key="q,v") -> list:
    """Steps of `sizes` tokens, each taking seconds(way, tokens) -> the way each took."""
    chosen = []
    for tokens in sizes:
        way = placement.choose(key, ways)
        chosen.append(way)
        placement.record(key, ways, way, tokens, seconds(way, tokens))
    return chosen


def noisy(ms: dict[str, float], seed: int = 0):
    rng = random.Random(seed)
    return lambda way, tokens: (ms[way] + rng.gauss(0, 0.3)) / 1e3


@pytest.mark.parametrize("ways", [TWO, THREE])
def test_the_fastest_way_is_kept_then_measured_again(ways):
    for fastest in ways:
        ms = {way: 35.0 if way == fastest else 35.5 for way in ways}
        placement = FetchPlacement(rounds=16, keep=50)
        assert placement.choose("q,v", ways) == ways[0]  # the CPU's way until measured
        assert placement.measuring("q,v", ways)
        measuring = drive(placement, [32] * 16 * len(ways), noisy(ms), ways)
        assert all(measuring.count(way) == 16 for way in ways)  # one of each a round
        assert not placement.measuring("q,v", ways)  # what benchmarks wait for
        assert drive(placement, [32] * 50, noisy(ms), ways) == [fastest] * 50
        assert placement.chosen("q,v", ways) == fastest
        assert placement.measuring("q,v", ways)
        again = drive(placement, [32] * len(ways), noisy(ms), ways)
        assert sorted(again) == sorted(ways)


def test_each_key_keeps_its_own_way():
    placement = FetchPlacement(rounds=8, keep=50)
    qv, every = ("q,v", (SHRINKS, ALL)), ("all", (SHRINKS, ALL))
    drive(placement, [32] * 16, noisy({SHRINKS: 30.0, ALL: 31.0}), qv[1], qv[0])
    drive(placement, [32] * 16, noisy({SHRINKS: 51.0, ALL: 50.0}), every[1], every[0])
    assert placement.chosen(*qv) == SHRINKS and placement.chosen(*every) == ALL
    # one's steps between the other's measurement's do not spoil it
    placement = FetchPlacement(rounds=8, keep=50)
    for _ in range(16):
        drive(placement, [32], noisy({SHRINKS: 30.0, ALL: 31.0}), qv[1], qv[0])
        drive(placement, [20], noisy({SHRINKS: 51.0, ALL: 50.0}), every[1], every[0])
    assert placement.chosen(*qv) == SHRINKS and placement.chosen(*every) == ALL


def test_a_round_whose_batch_changed_size_does_not_count():
    placement = FetchPlacement(rounds=4, keep=10)
    # each step's batch one token smaller than the last, the ahead steps 100x faster: counted,
    # these would settle on fetching ahead
    drive(placement, list(range(64, 32, -1)), lambda way, tokens: 0.001 if way == AHEAD else 0.1)
    # 4 rounds of one size, where fetching ahead is the slower, decide
    drive(placement, [32] * 8, lambda way, tokens: 0.036 if way == AHEAD else 0.035)
    assert drive(placement, [32] * 10, noisy({AHEAD: 35.0, ALL: 35.0})) == [ALL] * 10


@pytest.mark.parametrize("fixed", [AHEAD, ALL, SHRINKS])
def test_a_fixed_way_is_kept_whatever_the_timings(fixed):
    placement = FetchPlacement(rounds=4, keep=10)
    placement.fix(fixed)

    def slower(way: str, tokens: int) -> float:  # the fixed way: measured, it would lose
        return 0.1 if way == fixed else 0.001

    assert drive(placement, [32] * 40, slower, THREE) == [fixed] * 40
    assert not placement.measuring("q,v", THREE)
    assert placement.chosen("q,v", THREE) == fixed  # what benchmarks print as the way taken
    # where a step cannot fetch that way, its first
    assert drive(placement, [32] * 4, slower, (ALL,)) == [ALL] * 4
    assert placement.chosen("q,v", (ALL,)) == ALL


@pytest.mark.parametrize("modules", [("q_proj", "v_proj"), MODULES])
def test_the_engine_keeps_the_way_its_steps_took_least_time_in(
    tiny_model_dirs, tmp_path, monkeypatch, modules
):
    """An engine decoding on adapters times its steps' ways and keeps the one whose steps were
    faster: here every way but one made 20 ms slower a step, each in turn."""
    llm = make_llm(tiny_model_dirs["llama"], max_num_batched_tokens=64)
    model = llm.engine.runner.model
    config = llm.engine.model_config
    loras = [
        LoRARequest(f"a{i}", str(random_peft_adapter(tmp_path / f"a{i}", config, 8, modules, i)))
        for i in range(4)
    ]
    prompts = ["the river city", "tell me", "numbers: one two", "a story of light"]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    native_calls = BatchSteps.native_calls
    layers_for = BatchSteps.layers_for
    favoured = None

    def slowed(method):
        def call(steps, way):
            if steps.lora is not None and way != favoured:
                time.sleep(0.02)
            return method(steps, way)

        return call

    monkeypatch.setattr(BatchSteps, "native_calls", slowed(native_calls))
    monkeypatch.setattr(BatchSteps, "layers_for", slowed(layers_for))
    first = llm.generate(prompts, params, adapters=loras)  # and the batch's ways known
    steps = model._steps
    if len(steps.ways) == 1:
        pytest.skip(f"one way to fetch on this CPU ({steps.ways[0]})")
    for favoured in reversed(steps.ways):  # the CPU's first way last
        model.fetch_placement = FetchPlacement(rounds=4, keep=1000)
        outputs = llm.generate(prompts, params, adapters=loras)
        assert model.fetch_placement.chosen(model._steps.key, model._steps.ways) == favoured
        # the way changes no token
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in first]
