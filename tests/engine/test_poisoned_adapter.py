"""A hostile adapter cannot corrupt anyone else's output: not before, not beside, not after it.

The poisoned adapter passes validation (finite weights, a sane scale) but its lora_B entries are
3e38, so its keys overflow to inf: exactly what a hostile tenant, or a float overflow in reduced
precision, would write into KV pages.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from loraplex import LoRARequest, SamplingParams
from loraplex.engine.device import cpu_has_native_bf16
from loraplex.engine.errors import AdapterError, ErrorCode, RequestFailedError
from tests.factories import build_adapter, make_llm, poison_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
OTHERS = ["the river runs", "a cat sleeps quickly", "old king tells a story", "hello world"]

DTYPES = [
    "float32",
    pytest.param(
        "bfloat16",
        marks=pytest.mark.skipif(
            not cpu_has_native_bf16(), reason="this CPU has no native bfloat16"
        ),
    ),
]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("poison")
    k_adapter = build_adapter(tiny_llama, root / "k", rank=4, targets=("k_proj",), seed=7)
    return {
        "k": k_adapter,
        "poison": poison_adapter(k_adapter, root / "poison"),
        "other": build_adapter(tiny_llama, root / "other", rank=8, targets=("q_proj", "v_proj")),
    }


def other_requests(adapters):
    """Base-model and other-adapter requests: (prompt, adapter)."""
    other = LoRARequest("other", str(adapters["other"]))
    return [(p, None if i % 2 else other) for i, p in enumerate(OTHERS)]


def run(llm, requests):
    prompts = [p for p, _ in requests]
    return llm.generate(prompts, GREEDY, adapters=[a for _, a in requests])


def assert_free_pages_clean(engine):
    free = sorted(set(range(engine.pool.num_pages)) - _used_pages(engine))
    data = engine.pool.data[free]
    assert torch.isfinite(data).all(), "a free page holds NaN or inf"
    assert not data.any(), "a free page holds stale values"


def _used_pages(engine):
    used = {p for seq in engine.scheduler.sequences() for p in seq.block_table}
    used |= engine.kv.cached_page_ids  # kept prefixes: not free, given back wiped
    return used | {p for r in engine.adapters.resident.values() for p in r.pages}


@pytest.mark.parametrize("dtype", DTYPES)
def test_poisoned_adapter_fails_alone_before_and_beside_others(tiny_llama, adapters, dtype):
    options = dict(dtype=dtype, num_pages=64, max_num_seqs=16)
    clean = run(make_llm(tiny_llama, **options), other_requests(adapters))
    expected = [r.outputs[0].token_ids for r in clean]

    llm = make_llm(tiny_llama, **options)
    poison = LoRARequest("poison", str(adapters["poison"]))
    # before: the poisoned requests run alone and leave their pages behind
    failed = run(llm, [(p, poison) for p in ("the river", "green light", "a dog runs")])
    for result in failed:
        assert isinstance(result.error, RequestFailedError)
        assert result.error.code is ErrorCode.NON_FINITE
        assert result.outputs[0].finish_reason == "error"
    assert_free_pages_clean(llm.engine)
    after = run(llm, other_requests(adapters))
    assert [r.outputs[0].token_ids for r in after] == expected

    # beside: poisoned requests in the same continuous batch
    mixed = other_requests(adapters) + [(p, poison) for p in ("the city", "blue old cat")]
    results = run(llm, mixed)
    assert [r.outputs[0].token_ids for r in results[: len(OTHERS)]] == expected
    assert all(r.error is not None for r in results[len(OTHERS) :])
    assert_free_pages_clean(llm.engine)
    assert (
        llm.engine.pool.num_available == llm.engine.pool.num_pages - llm.engine.adapters.num_pages
    )


def test_poisoned_prefill_beside_running_decodes_of_other_lengths(tiny_llama, adapters):
    """Decodes of different lengths pad their page tables; the padding must never read a page
    that a poisoned prefill is writing in the same step."""
    llm = make_llm(tiny_llama, num_pages=64)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = ["the river runs over the old mountain city light", "a cat"]
    expected = [r.outputs[0].token_ids for r in make_llm(tiny_llama).generate(prompts, params)]

    placeholder = engine.make_request("hello", params, "placeholder")  # takes page 0 first
    engine.add_request(placeholder)
    requests = [engine.make_request(p, params, f"r{i}") for i, p in enumerate(prompts)]
    for request in requests:
        engine.add_request(request)
    tokens = {r.request_id: [] for r in requests}
    for delta in engine.step():
        tokens.get(delta.request_id, []).extend(delta.outputs[0].token_ids)
    engine.abort_request("placeholder")  # page 0 goes back to the pool, next in line
    poison = LoRARequest("poison", str(adapters["poison"]))
    engine.add_request(engine.make_request("the city of light", params, "p", lora=poison))
    errors = []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.get(delta.request_id, []).extend(delta.outputs[0].token_ids)
            if delta.error:
                errors.append(delta.request_id)
    assert errors == ["p"]
    assert [tokens[r.request_id] for r in requests] == expected
    assert_free_pages_clean(engine)


def test_absurd_scale_is_refused_at_validation(tiny_llama, adapters, tmp_path):
    """The issue's own probe: lora_alpha 1e30 on a k_proj adapter."""
    shutil.copytree(adapters["k"], tmp_path / "alpha")  # targets k_proj, as in the issue
    config_path = tmp_path / "alpha" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["lora_alpha"] = 1e30
    config_path.write_text(json.dumps(config))
    llm = make_llm(tiny_llama)
    with pytest.raises(AdapterError, match=r"scale .* is 2.5e\+29; loraplex serves scales up to"):
        llm.generate(["the river"], GREEDY, adapters=[str(tmp_path / "alpha")])
