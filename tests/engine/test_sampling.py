"""Sampling: seeds, top-k/top-p, penalties, n, logprobs, stop conditions."""

from __future__ import annotations

import math

import pytest
import torch

from loraplex import SamplingParams
from tests.factories import make_llm
from tests.oracle import load_reference_model, reference_greedy

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return make_llm(smollm2_dir, memory_budget="256MiB")


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return make_llm(tiny_llama)


def chat_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


@pytest.mark.smollm2
def test_seeded_request_gives_same_text_alone_and_in_a_busy_batch(smol):
    prompt = chat_ids(smol, PROMPT)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=40)
    alone = smol.generate([prompt], seeded)[0].outputs[0].text

    others = [chat_ids(smol, f"Tell me fact number {i} about the sea.") for i in range(12)]
    noisy = [SamplingParams(temperature=1.0, max_tokens=10 + 3 * i) for i in range(6)] + [
        SamplingParams(temperature=0.0, max_tokens=30) for _ in range(6)
    ]
    busy = (
        smol.generate([*others[:6], prompt, *others[6:]], [*noisy[:6], seeded, *noisy[6:]])[6]
        .outputs[0]
        .text
    )
    assert busy == alone

    other_seed = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=40)
    assert smol.generate([prompt], other_seed)[0].outputs[0].text != alone


def test_top_k_1_is_greedy(tiny):
    prompt = "the old city river"
    greedy = tiny.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20))
    top1 = tiny.generate([prompt], SamplingParams(temperature=1.5, top_k=1, max_tokens=20))
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_tiny_top_p_keeps_only_the_best_token(tiny):
    prompt = "a cat runs"
    greedy = tiny.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20))
    narrow = tiny.generate([prompt], SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=20))
    assert narrow[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_unseeded_sampling_varies(tiny):
    params = SamplingParams(temperature=1.0, max_tokens=20)
    texts = {tiny.generate(["the"], params)[0].outputs[0].text for _ in range(4)}
    assert len(texts) > 1


def test_n_completions_are_distinct_and_reproducible(tiny):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16)
    first = tiny.generate(["the green mountain"], params)[0]
    again = tiny.generate(["the green mountain"], params)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in first.outputs}) == 3
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]


def test_penalties_reduce_repetition(tiny):
    def distinct(params):
        out = tiny.generate(["the the the"], params)[0].outputs[0].token_ids
        return len(set(out))

    plain = distinct(SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    frequency = distinct(
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, frequency_penalty=2.0)
    )
    presence = distinct(
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, presence_penalty=2.0)
    )
    assert frequency > plain and presence > plain


def test_greedy_requests_in_one_batch_each_get_what_they_ask(tiny):
    """Greedy requests side by side: a plain one gets the tokens it gets alone, one with a logit
    bias its forced token, one with logprobs its logprobs, one with a penalty fewer repeats. A
    step that picked for them all as for the plain one would fail here."""
    prompt = "the the the"
    greedy = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    plain = SamplingParams(**greedy)
    alone = tiny.generate([prompt], plain)[0].outputs[0].token_ids
    asks = [
        plain,
        SamplingParams(**greedy, logit_bias={42: 100.0}),
        SamplingParams(**greedy, logprobs=2),
        SamplingParams(**greedy, presence_penalty=2.0),
    ]
    outs = [out.outputs[0] for out in tiny.generate([prompt] * len(asks), asks)]
    assert outs[0].token_ids == alone
    assert outs[1].token_ids == [42] * 12
    assert outs[2].token_ids == alone and len(outs[2].logprobs) == 12
    assert all(len(entry.top) == 2 for entry in outs[2].logprobs)
    assert len(set(outs[3].token_ids)) > len(set(alone))


def test_logprobs_are_the_models_distribution(tiny, tiny_llama):
    prompt = tiny.tokenizer.encode("the blue river tells")
    out = tiny.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
    )[0].outputs[0]
    ref = reference_greedy(load_reference_model(tiny_llama), prompt, 8, None)
    assert len(out.logprobs) == len(out.token_ids) == 8
    for entry, logits in zip(out.logprobs, ref.logits, strict=True):
        expected = torch.log_softmax(logits, dim=-1)
        assert entry.top[0][0] == entry.token_id  # greedy picks the most likely token
        assert len(entry.top) == 3
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
        assert math.isclose(entry.logprob, expected[entry.token_id].item(), abs_tol=1e-4)


def test_max_tokens_finishes_with_length(tiny):
    out = tiny.generate(["a"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[
        0
    ].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stop_token_id_ends_the_completion(tiny):
    free = tiny.generate(
        ["the king"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )[0].outputs[0]
    stop_token = free.token_ids[5]
    first = free.token_ids.index(stop_token)
    out = tiny.generate(
        ["the king"],
        SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_token]
        ),
    )
    assert out[0].outputs[0].token_ids == free.token_ids[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop"


@pytest.mark.smollm2
def test_stop_string_cuts_text_and_never_leaks_while_streaming(smol):
    prompt = chat_ids(smol, PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    free = smol.generate([prompt], params)[0].outputs[0]
    # a stop string that spans a token boundary, from the middle of the free answer
    start = len(smol.tokenizer.decode(free.token_ids[:10])) - 2
    stop = free.text[start : start + 6]
    assert len(stop) == 6 and free.text.find(stop) == start

    engine = smol.engine
    stopped = SamplingParams(temperature=0.0, max_tokens=40, stop=[stop])
    engine.add_request(engine.make_request(prompt, stopped, request_id="stop-test"))
    streamed, final = "", None
    while engine.has_unfinished():
        for delta in engine.step():
            streamed += delta.outputs[0].text
            assert stop[:3] not in streamed[start - 1 :], "a partial stop string leaked"
            final = delta.outputs[0]
    assert streamed == free.text[:start]
    assert final.finish_reason == "stop"
