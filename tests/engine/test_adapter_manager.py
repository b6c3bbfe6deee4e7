"""Adapter residency: one source of truth for pins, users and idle pages, whatever the order of
operations; unloads, pins and process restarts do what an operator expects."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from loraplex import LoRARequest, SamplingParams
from loraplex.engine.adapters.catalog import AdapterRef
from loraplex.engine.adapters.manager import AdapterManager
from loraplex.engine.adapters.peft_format import load_peft_adapter, random_peft_adapter
from loraplex.engine.config import ModelConfig
from loraplex.engine.errors import AdapterError, ErrorCode, InvalidRequestError
from loraplex.engine.pool import PagePool
from tests.factories import make_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SHAPES = [
    (4, ("q_proj", "v_proj")),
    (8, ("k_proj",)),
    (4, ("o_proj", "down_proj")),
    (16, ("gate_proj",)),
    (4, ("q_proj", "k_proj")),
    (4, ("up_proj",)),
]


@pytest.fixture(scope="module")
def weights(tiny_llama, tmp_path_factory):
    model = ModelConfig.from_dir(tiny_llama)
    root = tmp_path_factory.mktemp("manager")
    return [
        load_peft_adapter(
            random_peft_adapter(root / str(i), model, rank, modules, seed=i),
            model,
            64,
            torch.float32,
        )
        for i, (rank, modules) in enumerate(SHAPES)
    ]


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_the_manager_consistent(tiny_llama, weights, seed):
    rng = random.Random(seed)
    model = ModelConfig.from_dir(tiny_llama)
    pool = PagePool(num_pages=9, page_numel=3072, dtype=torch.float32, device="cpu")
    manager = AdapterManager(pool, model)
    ids = [f"a{i}" for i in range(4)]
    held: list[AdapterRef] = []  # refs counted as users, like running sequences
    kv: list[list[int]] = []  # pages some KV owner holds
    for _ in range(1500):
        op = rng.choice(["acquire", "release", "preload", "pin", "unpin", "unload", "kv", "kv-"])
        ref = AdapterRef(rng.choice(ids), rng.choice(weights))
        if op == "acquire":
            manager.free_up(manager.pages_to_load(ref), keep=ref)
            if pool.can_allocate(manager.pages_to_load(ref)):
                manager.acquire(ref)
                held.append(ref)
        elif op == "release" and held:
            manager.release(held.pop(rng.randrange(len(held))))
        elif op == "preload":
            manager.preload(ref)
        elif op == "pin":
            try:
                manager.pin(ref)
            except AdapterError as error:
                assert error.code is ErrorCode.OVERLOADED  # pages busy with KV right now
        elif op == "unpin":
            manager.unpin(ref.adapter_id)
        elif op == "unload":
            manager.unload(ref.adapter_id)
            # what the engine does: refs in flight under that id no longer name it
            held = [h.retired() if h.adapter_id == ref.adapter_id else h for h in held]
        elif op == "kv":
            want = rng.randint(1, 3)
            manager.free_up(want)
            if pool.can_allocate(want):
                kv.append(pool.allocate(want))
        elif op == "kv-" and kv:
            pool.free(kv.pop(rng.randrange(len(kv))))
        manager.check_invariants()
        kv_pages = [p for pages in kv for p in pages]
        adapter_pages = [p for r in manager.resident.values() for p in r.pages]
        assert not set(kv_pages) & set(adapter_pages), "a page is both KV and adapter"
        assert pool.num_free + len(kv_pages) + len(adapter_pages) == pool.num_pages
        for ref in held:  # everything in use stays resident
            assert manager.resident[ref.content_hash].num_users > 0
    for ref in held:
        manager.release(ref)
    for adapter_id in ids:
        manager.unload(adapter_id)
    manager.check_invariants()
    assert manager.resident == {} and pool.num_free + sum(map(len, kv)) == pool.num_pages


def test_unloading_an_adapter_while_its_requests_wait(tiny_llama, tiny_adapters):
    llm = make_llm(tiny_llama, max_num_seqs=1)
    engine = llm.engine
    lora = LoRARequest("a", str(tiny_adapters["attn-r8"]))
    expected = make_llm(tiny_llama).generate(["the river"], GREEDY, adapters=[lora])
    requests = [engine.make_request("the river", GREEDY, f"r{i}", lora=lora) for i in range(3)]
    for request in requests:
        engine.add_request(request)
    engine.step()  # the first runs, two wait
    engine.unload_adapter("a")
    outputs = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.request_id] += delta.outputs[0].token_ids
    assert outputs["r1"] == outputs["r2"] == expected[0].outputs[0].token_ids
    snapshot = engine.pool_snapshot()
    assert snapshot.resident == () and snapshot.free_pages == snapshot.num_pages


def test_a_pin_that_would_starve_a_request_in_flight_is_refused(tiny_llama, tiny_adapters):
    llm = make_llm(tiny_llama, num_pages=12, max_model_len=512)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    expected = make_llm(tiny_llama).generate([[5] * 100], params)[0].outputs[0].token_ids
    engine.add_request(engine.make_request([5] * 100, params, "big"))  # 170 tokens: 11 pages
    engine.step()
    big = LoRARequest("big-pin", str(tiny_adapters["mlp-r16"]))
    with pytest.raises(AdapterError) as error:
        engine.pin_adapter(big)
    assert error.value.code is ErrorCode.ADAPTER_TOO_LARGE
    assert "a request in flight needs 11" in str(error.value)
    # validated before the pin, added after it: refused, not left to stall the queue
    late = engine.make_request([5] * 100, params, "late")
    tokens = []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += delta.outputs[0].token_ids
    assert tokens[-69:] == expected[1:] and engine.num_preemptions == 0
    small = LoRARequest("small-pin", str(tiny_adapters["attn-r8"]))  # 4 pages
    engine.pin_adapter(small)  # fine now: nothing in flight needs those pages
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request(late)
    assert error.value.code is ErrorCode.EXCEEDS_POOL


ORDER_SCRIPT = """
import json, sys, torch
from loraplex.engine.adapters.catalog import AdapterRef
from loraplex.engine.adapters.manager import AdapterManager
from loraplex.engine.adapters.peft_format import load_peft_adapter
from loraplex.engine.config import ModelConfig
from loraplex.engine.pool import PagePool
model = ModelConfig.from_dir(sys.argv[1])
manager = AdapterManager(PagePool(64, 3072, torch.float32, "cpu"), model)
residents = [
    manager.acquire(AdapterRef(path, load_peft_adapter(path, model, 64, torch.float32)))
    for path in sys.argv[2:]
]
print(json.dumps([r.content_hash for r in sorted(residents, key=lambda r: r.batch_order)]))
"""


def test_batch_order_is_the_same_in_every_process(tiny_llama, tmp_path):
    model = ModelConfig.from_dir(tiny_llama)
    modules = [("q_proj",), ("k_proj",), ("v_proj",), ("o_proj",), ("up_proj",), ("down_proj",)]
    paths = [
        str(random_peft_adapter(tmp_path / str(i), model, 4, m, seed=i))
        for i, m in enumerate(modules)
    ]
    orders = set()
    for hash_seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run(
            [sys.executable, "-c", ORDER_SCRIPT, str(tiny_llama), *paths],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        orders.add(tuple(json.loads(out.stdout)))
    assert len(orders) == 1


def test_a_request_made_before_an_unload_and_added_after_it(tiny_llama, tiny_adapters):
    """The async engine builds requests on a worker thread: an unload can land in between."""
    llm = make_llm(tiny_llama)
    engine = llm.engine
    lora = LoRARequest("a", str(tiny_adapters["attn-r8"]))
    request = engine.make_request("the river", GREEDY, "r", lora=lora)
    engine.unload_adapter("a")
    engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    snapshot = engine.pool_snapshot()
    assert snapshot.resident == () and snapshot.free_pages == snapshot.num_pages


def test_a_pinned_adapter_validates_and_a_busy_pool_says_retry(tiny_llama, tiny_adapters):
    llm = make_llm(tiny_llama, num_pages=24)
    engine = llm.engine
    big = LoRARequest("big", str(tiny_adapters["mlp-r16"]))
    pages = engine.validate_adapter(big).num_pages
    assert 24 / 2 < pages <= 24
    engine.pin_adapter(big)
    assert engine.validate_adapter(big).num_pages == pages  # its own pin does not count
    engine.unpin_adapter("big")
    engine.unload_adapter("big")
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for _ in range(3):  # each fits beside the pin; together they leave too few pages free
        engine.add_request(engine.make_request([5] * 70, params))
    for _ in range(3):
        engine.step()
    with pytest.raises(AdapterError) as error:
        engine.pin_adapter(big)
    assert error.value.code is ErrorCode.OVERLOADED
