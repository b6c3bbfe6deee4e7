"""Churn: 200 adapters, a pool that holds a fraction of them, 400 requests, 16 at a time."""

from __future__ import annotations

import random

import pytest

from loraplex import LoRARequest, SamplingParams
from loraplex.engine.adapters.peft_format import MODULES, random_peft_adapter
from loraplex.engine.config import ModelConfig
from tests.factories import make_llm, sample_text
from tests.oracle import NEAR_TIE

NUM_ADAPTERS, NUM_REQUESTS, CONCURRENCY = 200, 400, 16


@pytest.fixture(scope="module")
def many_adapters(tmp_path_factory, tiny_llama) -> list[LoRARequest]:
    config = ModelConfig.from_dir(tiny_llama)
    root = tmp_path_factory.mktemp("churn-adapters")
    rng = random.Random(0)
    adapters = []
    for i in range(NUM_ADAPTERS):
        modules = tuple(rng.sample(MODULES, rng.randint(1, 4)))
        path = random_peft_adapter(
            root / f"a{i}", config, rng.choice([2, 4, 8, 16]), modules, seed=i, std=0.2
        )
        adapters.append(LoRARequest(f"a{i}", str(path)))
    return adapters


def matches_alone(ours: list[int], alone) -> bool:
    """Equal, or equal up to a near-tie in the lone run (its top-2 logprobs within NEAR_TIE)."""
    for t, (mine, theirs) in enumerate(zip(ours, alone.token_ids, strict=True)):
        if mine != theirs:
            top = dict(alone.logprobs[t].top)
            return mine in top and abs(top[mine] - top[theirs]) < NEAR_TIE
    return True


def test_churn_through_a_small_pool_matches_each_request_run_alone(
    tiny_llama, many_adapters, report
):
    rng = random.Random(1)
    jobs = [
        (
            rng.choice([*many_adapters, None]),
            sample_text(rng, rng.randint(1, 30)),
            rng.randint(1, 24),
        )
        for _ in range(NUM_REQUESTS)
    ]
    llm = make_llm(tiny_llama, num_pages=64, max_num_batched_tokens=64)
    engine = llm.engine
    adapter_pages = sum(
        engine.adapters.plan_pages(engine.catalog.get(a.adapter_id, a.path).weights)
        for a in many_adapters
    )
    assert adapter_pages > 5 * engine.pool.num_pages, "the pool should hold a fraction only"

    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(jobs))
    in_flight = 0
    while pending or engine.has_unfinished():
        while pending and in_flight < CONCURRENCY:
            i, (lora, prompt, max_tokens) = pending.pop(0)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(engine.make_request(prompt, params, f"r{i}", lora=lora))
            outputs[f"r{i}"] = []
            in_flight += 1
        for delta in engine.step():
            outputs[delta.request_id] += delta.outputs[0].token_ids
            in_flight -= delta.finished

    # the pool is back where it started: no KV, no user on any adapter, and once the adapters
    # are forgotten, every page is free
    snapshot = engine.pool_snapshot()
    assert snapshot.kv_pages == 0 and all(r.running_requests == 0 for r in snapshot.resident)
    for lora in many_adapters:
        engine.unload_adapter(lora.adapter_id)
    assert engine.pool.num_available == engine.pool.num_pages

    alone = make_llm(tiny_llama, memory_budget="256MiB")
    mismatches, near_ties = [], 0
    for i, (lora, prompt, max_tokens) in enumerate(jobs):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        reference = alone.generate([prompt], params, adapters=[lora])[0].outputs[0]
        ours = outputs[f"r{i}"]
        if ours != reference.token_ids:
            if matches_alone(ours, reference):
                near_ties += 1
            else:
                mismatches.append(i)
    assert not mismatches, f"requests {mismatches[:10]} differ from the same request alone"
    report(
        f"churn: {NUM_REQUESTS} requests over {NUM_ADAPTERS} adapters through a "
        f"{engine.pool.num_pages}-page pool ({engine.adapters.num_loads} adapter loads, "
        f"{engine.adapters.num_evictions} evictions, {engine.num_preemptions} preemptions), "
        f"all equal to running alone, {near_ties} near-ties"
    )
