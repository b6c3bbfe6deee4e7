"""Bad input is refused with a ValueError that names the field and range; nothing else changes."""

from __future__ import annotations

import pytest

from loraplex import SamplingParams
from tests.factories import make_llm


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"temperature": -0.5}, "temperature must be a number in [0, inf)"),
        ({"top_p": 0.0}, "top_p must be a number in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be a number in (0, 1]"),
        ({"n": 0}, "n must be an integer in [1, 64]"),
        ({"top_k": 0}, "top_k must be an integer >= 1"),
        ({"frequency_penalty": 3.0}, "frequency_penalty must be a number in [-2, 2]"),
        ({"presence_penalty": -2.5}, "presence_penalty must be a number in [-2, 2]"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"logprobs": 21}, "logprobs must be an integer in [0, 20]"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop allows at most 16 strings, got 17"),
        ({"stop": [""]}, "stop must be a non-empty string or a list of them"),
        ({"temperature": float("nan")}, "temperature must be a number in [0, inf)"),
    ],
)
def test_invalid_sampling_values_name_the_field_and_range(options, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**options)
    assert message in str(error.value)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama, max_model_len=128)


def test_prompt_longer_than_the_context_is_refused(llm):
    with pytest.raises(ValueError, match=r"prompt has 200 tokens; the model's context is 128"):
        llm.engine.make_request([5] * 200, SamplingParams())


def test_max_tokens_past_the_context_is_refused(llm):
    with pytest.raises(ValueError, match=r"max_tokens must be in \[1, 28\] .* got 50"):
        llm.engine.make_request([5] * 100, SamplingParams(max_tokens=50))


def test_request_larger_than_the_pool_is_refused(tiny_llama):
    small = make_llm(tiny_llama, num_pages=2, max_model_len=128)
    with pytest.raises(ValueError, match=r"needs 4 pages of KV; the pool has 2"):
        small.engine.make_request([5] * 40, SamplingParams(max_tokens=20))


def test_token_ids_outside_the_vocabulary_are_refused(llm):
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 384\)"):
        llm.engine.make_request([1, 99999], SamplingParams())


def test_engine_keeps_serving_after_refusals(llm):
    engine = llm.engine
    engine.add_request(
        engine.make_request("the river", SamplingParams(max_tokens=30, ignore_eos=True))
    )
    engine.step()
    for bad in ([5] * 200, []):
        with pytest.raises(ValueError):
            engine.make_request(bad, SamplingParams())
    while engine.has_unfinished():
        engine.step()
    out = llm.generate(["the city"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert engine.pool.num_available == engine.pool.num_pages
