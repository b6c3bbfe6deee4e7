"""`prompt_logprobs`: each prompt token's log-probability given the tokens before it (and the k
likeliest alternatives), as transformers/PEFT compute them in float32; once per request, across
chunked prefill, preemption and n > 1."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from loraplex import LoRARequest, SamplingParams
from tests.factories import make_llm
from tests.oracle import load_reference_model

PROMPTS = [
    "the lighthouse keeper found a bottle on the rocks and opened it slowly",
    "seven small boats",
    "a",
]
TOP = 5


@torch.inference_mode()
def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row i is the distribution of token i + 1."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check(result, reference: torch.Tensor) -> None:
    entries = result.prompt_logprobs
    assert len(entries) == len(result.prompt_token_ids) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        expected = reference[i]
        assert entry.token_id == result.prompt_token_ids[i + 1]
        assert entry.logprob == pytest.approx(expected[entry.token_id].item(), abs=1e-4)
        top_ids = [token for token, _ in entry.top]
        assert len(top_ids) == TOP
        assert torch.allclose(
            torch.tensor([lp for _, lp in entry.top]), expected.topk(TOP).values, atol=1e-4
        )
        assert set(top_ids) <= set(expected.topk(TOP + 2).indices.tolist())  # near-ties may swap


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(max_num_batched_tokens=8),  # prompts prefilled in chunks of 8
        dict(num_pages=16, page_size=4, max_num_batched_tokens=8),  # preempted and recomputed
    ],
    ids=["one-chunk", "chunked", "preempted"],
)
def test_prompt_logprobs_equal_transformers(tiny_llama, options):
    llm = make_llm(tiny_llama, **options)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=TOP)
    results = llm.generate(PROMPTS, params)
    reference = load_reference_model(tiny_llama)
    for result in results:
        if len(result.prompt_token_ids) == 1:
            assert result.prompt_logprobs == [None]
            continue
        check(result, reference_logprobs(reference, result.prompt_token_ids))
    if "num_pages" in options:
        assert llm.engine.stats().num_preemptions > 0


def test_prompt_logprobs_under_an_adapter_equal_peft_and_come_once_with_n(
    tiny_llama, tiny_adapters
):
    path = tiny_adapters["attn-r8"]
    llm = make_llm(tiny_llama)
    params = SamplingParams(
        temperature=0.8, seed=3, n=2, max_tokens=6, ignore_eos=True, prompt_logprobs=TOP
    )
    lora = LoRARequest("attn", str(path))
    result = llm.generate(PROMPTS[:1], params, adapters=[lora])[0]
    base = load_reference_model(tiny_llama)
    adapted = PeftModel.from_pretrained(base, str(path)).eval()
    check(result, reference_logprobs(adapted, result.prompt_token_ids))
    # without the parameter, nothing is computed or returned
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), adapters=[lora])[0]
    assert plain.prompt_logprobs is None


def test_prompt_logprobs_range_is_checked():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
