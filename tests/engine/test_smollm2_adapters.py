"""SmolLM2 with 8 adapters (ranks 4 to 64, different module sets) and the base model in one
continuous batch, token for token against PEFT + transformers run per adapter."""

from __future__ import annotations

import pytest
from peft import PeftModel

from loraplex import LoRARequest, SamplingParams
from loraplex.engine.adapters.peft_format import random_peft_adapter
from loraplex.engine.config import ModelConfig
from tests.factories import make_llm
from tests.oracle import assert_matches_reference, load_reference_model, reference_greedy

SPECS = {
    "r4-qv": (4, ("q_proj", "v_proj")),
    "r8-attn": (8, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "r16-mlp": (16, ("gate_proj", "up_proj", "down_proj")),
    "r32-all": (32, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    "r64-qv": (64, ("q_proj", "v_proj")),
    "r12-o-down": (12, ("o_proj", "down_proj")),
    "r24-k-gate": (24, ("k_proj", "gate_proj")),
    "r48-v-up": (48, ("v_proj", "up_proj")),
}
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain photosynthesis in one sentence.",
    "List three colors.",
]
MAX_TOKENS = 20


@pytest.mark.smollm2
def test_eight_adapters_and_base_in_one_batch_match_peft(smollm2_dir, tmp_path, report):
    config = ModelConfig.from_dir(smollm2_dir)
    dirs = {
        name: random_peft_adapter(
            tmp_path / name, config, rank, modules, seed=i, std=0.6 / rank**0.5
        )
        for i, (name, (rank, modules)) in enumerate(SPECS.items())
    }
    llm = make_llm(smollm2_dir, memory_budget="512MiB")
    names = [*SPECS, None]
    cases = [(names[i % len(names)], QUESTIONS[i % len(QUESTIONS)]) for i in range(2 * len(names))]
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for _, q in cases]
    loras = [LoRARequest(n, str(dirs[n])) if n else None for n, _ in cases]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    results = llm.generate(prompts, params, adapters=loras)

    base = load_reference_model(smollm2_dir)
    peft = PeftModel.from_pretrained(base, str(dirs[names[0]]), adapter_name=names[0])
    for name in names[1:-1]:
        peft.load_adapter(str(dirs[name]), adapter_name=name)
    peft.eval()
    eos = config.eos_token_ids[0]
    refs = []
    for (name, _), prompt in zip(cases, prompts, strict=True):
        if name is None:
            with peft.disable_adapter():
                refs.append(reference_greedy(peft, prompt, MAX_TOKENS, eos))
        else:
            peft.set_adapter(name)
            refs.append(reference_greedy(peft, prompt, MAX_TOKENS, eos))
    near_ties = assert_matches_reference([r.outputs[0].token_ids for r in results], refs)
    changed = sum(
        r.outputs[0].token_ids != b.outputs[0].token_ids
        for r, b in zip(results, llm.generate(prompts, params), strict=True)
    )
    assert changed >= len(SPECS), "the adapters should change most answers"
    report(
        f"SmolLM2 + 8 adapters (ranks 4-64) + base, one batch of {len(cases)}: identical to "
        f"PEFT, {near_ties} near-ties"
    )
