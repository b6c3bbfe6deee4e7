"""Greedy output through the continuous batch is token-identical to transformers (float32)."""

from __future__ import annotations

import random

import pytest

from loraplex import SamplingParams
from tests.factories import make_llm, sample_text
from tests.oracle import assert_matches_reference, load_reference_model, reference_greedy

CHUNK = 64  # prefill chunk (per-step token budget) in these runs


def mixed_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """Prompts of 1 to ~3x CHUNK tokens; the last one is always longer than a chunk."""
    rng = random.Random(seed)
    prompts = [tokenizer.encode(sample_text(rng, rng.randint(1, 40))) for _ in range(count - 1)]
    prompts.append(tokenizer.encode(sample_text(rng, 120)))
    assert len(prompts[-1]) > CHUNK
    return prompts


def run_and_compare(model_dir, prompts, max_tokens, eos, report, label, **engine_options):
    llm = make_llm(model_dir, max_num_batched_tokens=CHUNK, **engine_options)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=eos is None)
    results = llm.generate(prompts, params)
    hf = load_reference_model(model_dir)
    refs = [reference_greedy(hf, p, max_tokens, eos) for p in prompts]
    near_ties = assert_matches_reference([r.outputs[0].token_ids for r in results], refs)
    report(
        f"{label}: {len(prompts)} prompts identical to transformers, {near_ties} near-ties, "
        f"{llm.engine.num_preemptions} preemptions"
    )
    return llm


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "mistral"])
def test_tiny_models_match_transformers(tiny_model_dirs, family, report):
    model_dir = tiny_model_dirs[family]
    llm = make_llm(model_dir)
    prompts = mixed_prompts(llm.tokenizer, 16, seed=1)
    run_and_compare(model_dir, prompts, 24, None, report, f"tiny {family}")


def test_torch_decode_attention_matches_transformers_too(tiny_llama, report, monkeypatch):
    """Where the native kernels cannot be built, decode attention gathers pages for torch's."""
    monkeypatch.setenv("LORAPLEX_TORCH_ATTENTION", "1")
    llm = make_llm(tiny_llama)
    assert llm.engine.runner.settings.attention_kernel is None
    prompts = mixed_prompts(llm.tokenizer, 16, seed=3)
    run_and_compare(tiny_llama, prompts, 24, None, report, "tiny llama, torch decode attention")


def test_tiny_model_matches_transformers_under_preemption(tiny_llama, report):
    llm = make_llm(tiny_llama)
    prompts = mixed_prompts(llm.tokenizer, 16, seed=2)
    # 12 pages of 16 tokens: the longest request needs 10, all together need ~50.
    llm = run_and_compare(
        tiny_llama, prompts, 24, None, report, "tiny llama, 12-page pool", num_pages=12
    )
    assert llm.engine.num_preemptions > 0


@pytest.mark.smollm2
def test_smollm2_matches_transformers(smollm2_dir, report):
    llm = make_llm(smollm2_dir)
    prompts = mixed_prompts(llm.tokenizer, 16, seed=3)
    eos = llm.engine.model_config.eos_token_ids[0]
    run_and_compare(smollm2_dir, prompts, 24, eos, report, "SmolLM2")


@pytest.mark.smollm2
def test_smollm2_matches_transformers_under_preemption(smollm2_dir, report):
    llm = make_llm(smollm2_dir)
    prompts = mixed_prompts(llm.tokenizer, 16, seed=3)
    llm = run_and_compare(
        smollm2_dir, prompts, 24, None, report, "SmolLM2, 16-page pool", num_pages=16
    )
    assert llm.engine.num_preemptions > 0
