"""bfloat16 on CPU: a step's decoder layers without LoRA run in one native call (cpu/layers.c)
where every projection is native for its rows. They must give the bits of the calls the model
otherwise makes one by one, in prompt chunks and decode steps alike, with biases on q,k,v (the
tiny Qwen2) and without."""

from __future__ import annotations

import pytest

from loraplex import SamplingParams
from tests.factories import make_llm

PROMPTS = [
    "the river city",
    "a story of light and dark told by the old king " * 3,
    "tell me",
    "numbers: one two three four five six seven eight nine ten eleven twelve",
]


def run(llm, fused: bool) -> list:
    llm.engine.runner.model.fuse_layers = fused
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    results = llm.generate(PROMPTS, params)
    return [
        (r.outputs[0].token_ids, [(lp.logprob, lp.top) for lp in r.outputs[0].logprobs])
        for r in results
    ]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_layers_give_the_bits_of_the_calls_one_by_one(tiny_model_dirs, family):
    llm = make_llm(tiny_model_dirs[family], dtype="bfloat16", max_num_batched_tokens=24)
    model = llm.engine.runner.model
    if model._decoder is None or not model.layers[0].qkv.native_rows(1):
        pytest.skip("no native bfloat16 projection on this CPU")
    fused_steps = 0
    fuse = model._fused_layers

    def counted(*args):
        nonlocal fused_steps
        fused_steps += 1
        return fuse(*args)

    model._fused_layers = counted
    one_by_one = run(llm, fused=False)
    assert fused_steps == 0
    assert run(llm, fused=True) == one_by_one
    assert fused_steps >= 12  # the decode steps at least
