"""Scheduling as a user sees it: long prompts do not stall decodes; nothing deadlocks."""

from __future__ import annotations

from loraplex import SamplingParams
from tests.factories import make_llm


def test_long_prompt_is_chunked_and_running_decodes_advance_every_step(tiny_llama):
    llm = make_llm(tiny_llama, max_num_batched_tokens=32)
    engine = llm.engine
    decode_params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    decoders = [engine.make_request(p, decode_params) for p in ("the", "a cat", "old")]
    for request in decoders:
        engine.add_request(request)
    engine.step()  # all three prefill in one step and start decoding
    long_prompt = engine.make_request([7] * 200, SamplingParams(max_tokens=5))
    engine.add_request(long_prompt)
    steps_until_first_token = 0
    while True:
        deltas = {d.request_id: d for d in engine.step()}
        steps_until_first_token += 1
        # every decoding request got its token in this step
        assert all(r.request_id in deltas for r in decoders)
        if long_prompt.request_id in deltas:
            break
    # 200 prompt tokens through the 29 tokens per step that 3 decodes leave of a budget of 32
    assert steps_until_first_token == 7


def test_tight_pool_with_many_requests_finishes_without_deadlock(tiny_llama):
    # each request alone needs up to 5 pages; the pool has 6: constant preemption pressure
    llm = make_llm(tiny_llama, num_pages=6, max_num_batched_tokens=40)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = llm.generate([[3 + i] * (10 + 3 * i) for i in range(12)], params)
    assert all(len(r.outputs[0].token_ids) == 40 for r in results)
    assert llm.engine.num_preemptions > 0
    assert llm.engine.pool.num_available == llm.engine.pool.num_pages
