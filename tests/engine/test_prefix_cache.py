"""Prefix caching: full KV pages kept and reused by later requests with the same tokens under the
same adapter weights (keyed by content hash, never by name); outputs identical to running
without it (float32, greedy); kept pages given back before anything is preempted."""

from __future__ import annotations

import shutil

import pytest

from loraplex import LoRARequest, SamplingParams
from tests.factories import build_adapter, make_llm

SYSTEM = (
    "You are the harbour master's assistant. Answer in one sentence, mention the tide, "
    "and never give advice about the weather beyond what the port authority publishes. "
)
QUESTIONS = ["when does the ferry leave", "where can I park", "is the lighthouse open", "hello"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def hits(llm) -> int:
    return llm.engine.stats().num_prefix_hit_tokens


def run(llm, prompts, adapters=None):
    results = llm.generate(prompts, GREEDY, adapters=adapters)
    return [r.outputs[0].token_ids for r in results]


@pytest.mark.parametrize("page_size", [4, 16])
def test_outputs_with_the_cache_equal_outputs_without(tiny_llama, tiny_adapters, page_size):
    loras = [None, LoRARequest("a", str(tiny_adapters["qv-r4"]))]
    loras.append(LoRARequest("b", str(tiny_adapters["all-r2"])))
    jobs = [(SYSTEM + q, lora) for lora in loras for q in QUESTIONS]
    prompts, adapters = [p for p, _ in jobs], [a for _, a in jobs]
    cached = make_llm(tiny_llama, page_size=page_size)
    plain = make_llm(tiny_llama, page_size=page_size, enable_prefix_caching=False)

    first = run(cached, prompts, adapters)  # all at once: the system prompt computed per request
    assert first == run(plain, prompts, adapters)
    again = run(cached, prompts[::-1], adapters[::-1])  # now served from the cache
    assert again == first[::-1]
    assert hits(cached) >= len(jobs) * (len(cached.tokenizer.encode(SYSTEM)) // page_size - 1)
    assert hits(plain) == 0


def test_the_same_tokens_under_other_weights_never_share_kv(tiny_llama, tiny_adapters, tmp_path):
    llm = make_llm(tiny_llama, page_size=4)
    prompt = SYSTEM + QUESTIONS[0]
    a = LoRARequest("a", str(tiny_adapters["qv-r4"]))
    b = LoRARequest("b", str(tiny_adapters["attn-r8"]))
    alone = {
        name: run(make_llm(tiny_llama, enable_prefix_caching=False), [prompt], [lora])[0]
        for name, lora in (("base", None), ("a", a), ("b", b))
    }
    assert len(set(map(tuple, alone.values()))) == 3  # the adapters do change the answer

    assert run(llm, [prompt], [a])[0] == alone["a"]
    before = hits(llm)
    assert run(llm, [prompt], [b])[0] == alone["b"]  # same tokens, other adapter: no hit
    assert run(llm, [prompt])[0] == alone["base"]  # nor for the base model
    assert hits(llm) == before
    assert run(llm, [prompt], [a])[0] == alone["a"]  # same adapter again: a hit
    assert hits(llm) > before

    # the same name with new weights (re-registered): never the old KV
    other = build_adapter(tiny_llama, tmp_path / "new", rank=4, seed=99)
    renamed = tmp_path / "a-v2"
    shutil.copytree(other, renamed)
    before = hits(llm)
    fresh = run(
        make_llm(tiny_llama, enable_prefix_caching=False),
        [prompt],
        [LoRARequest("a", str(renamed))],
    )
    llm.engine.unload_adapter("a")
    assert run(llm, [prompt], [LoRARequest("a", str(renamed))])[0] == fresh[0]
    assert hits(llm) == before


def test_kept_pages_are_given_back_before_anything_is_preempted(tiny_llama):
    llm = make_llm(tiny_llama, page_size=4, num_pages=40)
    prompts = [f"{SYSTEM[:60]} number {i}" for i in range(6)]
    run(llm, prompts[:3])
    stats = llm.engine.stats()
    assert stats.cached_pages > 0 and stats.kv_pages == 0
    # requests that need more pages than are free take the kept ones, nobody is preempted
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    llm.generate(prompts[3:4], long)
    assert llm.engine.num_preemptions == 0
    assert llm.engine.pool.num_available == llm.engine.pool.num_pages
