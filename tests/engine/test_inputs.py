"""Whatever a careless client sends is either served or refused with InvalidRequestError (a
ValueError) naming the field; nothing else escapes, and the engine keeps serving."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplex import SamplingParams
from loraplex.engine.detokenizer import IncrementalDetokenizer
from loraplex.engine.errors import InvalidRequestError
from tests.factories import make_llm


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return make_llm(tiny_llama, max_model_len=128)


@pytest.mark.parametrize(
    "prompt",
    [[1.5, 2], None, [[1, 2]], {"a": 1}, [1, "2"], b"abc", [True, False], 3.0, [1, None], [], ""],
    ids=repr,
)
def test_malformed_prompts_are_refused_naming_the_prompt(llm, prompt):
    with pytest.raises(InvalidRequestError) as error:
        llm.engine.make_request(prompt, SamplingParams(max_tokens=2))
    assert error.value.param == "prompt"
    assert "prompt" in str(error.value)
    out = llm.generate(["the river"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_tiny_positive_temperature_is_greedy(llm):
    greedy = llm.generate(["the river"], SamplingParams(temperature=0.0, max_tokens=12))
    tiny = llm.generate(["the river"], SamplingParams(temperature=1e-38, max_tokens=12))
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_logit_bias_forces_and_forbids_tokens(llm):
    params = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    greedy = llm.generate(["the river"], SamplingParams(**params))[0].outputs[0].token_ids
    banned = (
        llm.generate(["the river"], SamplingParams(**params, logit_bias={greedy[0]: -100}))[0]
        .outputs[0]
        .token_ids
    )
    forced = llm.generate(["the river"], SamplingParams(**params, logit_bias={"42": 100}))
    assert banned[0] != greedy[0]
    assert forced[0].outputs[0].token_ids == [42] * 8
    with pytest.raises(InvalidRequestError, match=r"logit_bias must hold token ids in \[0, 384\)"):
        llm.engine.make_request("a", SamplingParams(logit_bias={10**6: 1}))


# -- property: any value validates or raises ValueError --------------------------------------

anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2)  # lone surrogates
    | st.binary(max_size=4),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=3) | st.integers(-3, 500), children, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = [
    "n",
    "temperature",
    "top_p",
    "top_k",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "skip_special_tokens",
    "logit_bias",
]
plausible = {
    "n": st.integers(-2, 70),
    "temperature": st.floats(-1, 5) | st.sampled_from([0.0, 1e-38, 1e-6, 1e30]),
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 1000) | st.none(),
    "max_tokens": st.integers(-2, 200) | st.none(),
    "stop": st.lists(st.text(max_size=4), max_size=3) | st.text(max_size=4),
    "logprobs": st.integers(-1, 25) | st.none(),
    "logit_bias": st.dictionaries(st.integers(-1, 400), st.floats(-150, 150), max_size=3),
}


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), anything, max_size=5))
def test_any_sampling_params_validate_or_raise_value_error(options):
    try:
        SamplingParams(**options)
    except ValueError as error:
        assert isinstance(error, InvalidRequestError) and error.param in FIELDS


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    prompt=anything | st.lists(st.integers(-5, 500), max_size=6),
    options=st.fixed_dictionaries({}, optional=plausible),
)
def test_any_prompt_and_params_are_served_or_refused_with_value_error(llm, prompt, options):
    try:
        params = SamplingParams(**options)
        request = llm.engine.make_request(prompt, params)
    except ValueError as error:
        assert isinstance(error, InvalidRequestError)
        return
    llm.engine.add_request(request)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert llm.engine.pool.num_available == llm.engine.pool.num_pages


# -- a prompt that ends inside a character -------------------------------------------------


def _byte_token_ids(tokenizer, text: str) -> list[int]:
    """The byte-level BPE's single-byte tokens for `text`'s UTF-8 bytes (GPT-2's byte map)."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    shown += range(ord("®"), ord("ÿ") + 1)
    hidden = [b for b in range(256) if b not in shown]

    def char(byte: int) -> str:
        return chr(byte) if byte in shown else chr(256 + hidden.index(byte))

    return [tokenizer.token_to_id(char(byte)) for byte in text.encode()]


def test_prompt_ending_inside_a_character_never_echoes_the_prompt(llm):
    tokenizer = llm.tokenizer.backend
    emoji = _byte_token_ids(tokenizer, "😀")
    assert len(emoji) == 4 and tokenizer.decode(emoji) == "😀"
    prompt = tokenizer.encode("I love ").ids + emoji[:3]
    result = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0]
    assert "love" not in result.text
    assert result.text == tokenizer.decode(result.token_ids)

    # the completion's byte finishes the prompt's character: it shows as U+FFFD, exactly as
    # decoding the completion alone does
    the = tokenizer.encode(" the").ids
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, [], True)
    pieces = []
    for token in [emoji[3], *the]:
        detokenizer.add_token(token)
        pieces.append(detokenizer.take_new_text(final=False))
    pieces.append(detokenizer.take_new_text(final=True))
    assert "".join(pieces) == tokenizer.decode([emoji[3], *the]) == "\ufffd the"


@pytest.mark.parametrize("where", ["prompt", "chat"])
def test_a_lone_surrogate_is_refused(llm, where):
    with pytest.raises(InvalidRequestError, match="not valid Unicode"):
        if where == "prompt":
            llm.engine.make_request("hello \ud800", SamplingParams())
        else:
            llm.tokenizer.encode_chat([{"role": "user", "content": "hi \udfff"}])


def test_oversized_values_are_refused_by_name():
    for options, param in (
        ({"stop": ["x" * 1001]}, "stop"),
        ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
        ({"n": 10**5000}, "n"),
    ):
        with pytest.raises(InvalidRequestError) as error:
            SamplingParams(**options)
        assert error.value.param == param


def test_stop_strings_and_textless_tokens_cost_the_same_at_every_step(tiny_tokenizer_dir):
    """The detokenizer's work per token must not grow with the output: long stop strings, runs
    of tokens that add no text, and stray bytes keep its decode window short."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    windows = []
    decode = tokenizer.decode

    class Counting:
        def decode(self, ids, skip_special_tokens):
            windows.append(len(ids))
            return decode(ids, skip_special_tokens=skip_special_tokens)

    special = tokenizer.token_to_id("<|im_end|>")
    stray = _byte_token_ids(tokenizer, "😀")[3]  # a continuation byte on its own
    stops = ["".join(chr(0x41 + (i + j) % 26) for j in range(1000)) for i in range(16)]
    detokenizer = IncrementalDetokenizer(Counting(), [5, 6, 7], stops, True)
    started = time.monotonic()
    for i in range(3000):
        detokenizer.add_token([special, stray, 300][i % 3] if i < 2000 else 300)
        detokenizer.take_new_text(final=False)
    assert max(windows) <= 16
    assert time.monotonic() - started < 10  # was minutes before the stop automaton
