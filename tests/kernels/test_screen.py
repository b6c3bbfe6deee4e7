"""The LM head's greedy screen (kernels/cpu_screen.py) against the native float32 head and the
argmax it stands for: the same tokens, a tie's first included; a decline where it cannot vouch
for its picks, and the engine's full head then; an engine taking it token-identical to
transformers."""

from __future__ import annotations

import pytest
import torch

from loraplex import SamplingParams
from loraplex.engine.device import NATIVE_LINEAR_MAX_ROWS
from loraplex.engine.model import CausalLM
from loraplex.engine.tokenizer import TokenizerWrapper
from loraplex.kernels import cpu_screen
from tests.engine.test_fidelity import mixed_prompts, run_and_compare
from tests.factories import make_llm
from tests.kernels.test_native_linear import f32_kernel, f32_library  # noqa: F401 (fixtures)


@pytest.fixture
def screen(f32_library) -> cpu_screen.CpuScreenF32:  # noqa: F811
    """The screen of the library the float32 projection comes from (each build of it)."""
    screen = cpu_screen.CpuScreenF32(f32_library)
    if not screen.native:
        pytest.skip("the library has no screen on this CPU (no AVX2 and FMA)")
    return screen


@pytest.fixture
def engine_screen(monkeypatch, f32_kernel, screen):  # noqa: F811
    """Engines built now take the screen, whatever the CPU (LORAPLEX_SCREEN=1)."""
    monkeypatch.setenv("LORAPLEX_SCREEN", "1")
    monkeypatch.setattr(cpu_screen, "load", lambda: screen)
    return screen


def full_picks(kernel, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The native float32 head's logits for x, and the first best of each row."""
    return kernel(x, kernel.pack(weight), weight.shape[0], None).max(dim=-1).indices


def hidden_states(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows like a model's final hidden states: a few inputs far larger than the rest."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator)
    x[:, torch.randperm(k, generator=generator)[:3]] *= 15.0
    return x


@pytest.mark.parametrize("rows", [1, 2, 3, 31, 32, 64, 101])
@pytest.mark.parametrize("vocab, k", [(4099, 576), (1000, 70), (25, 3)])
def test_screen_picks_the_full_heads_tokens(f32_kernel, screen, rows, vocab, k):  # noqa: F811
    torch.manual_seed(rows * 7 + vocab)
    weight = torch.randn(vocab, k) * 0.05
    weight[torch.randint(vocab, (vocab // 50 + 1,))] *= 4.0  # tokens of larger rows
    head = screen.prepare(weight)
    for seed in range(4):
        x = hidden_states(rows, k, seed)
        assert torch.equal(head.greedy(x), full_picks(f32_kernel, weight, x))
    wide = hidden_states(rows, k + 9, 9)[:, :k]  # rows k + 9 apart
    assert torch.equal(head.greedy(wide), full_picks(f32_kernel, weight, wide.contiguous()))
    assert head.declined == 0


def test_a_tie_picks_the_first_token(f32_kernel, screen):  # noqa: F811
    torch.manual_seed(0)
    weight = torch.randn(3000, 576) * 0.05
    # the same row, four tokens: two in a block, one in another of the same thread (of two),
    # one in the other thread's
    weight[2999] = weight[1000] = weight[41] = weight[40] = weight[40] * 3.0
    x = weight[40:41] * 10.0
    assert full_picks(f32_kernel, weight, x).tolist() == [40]
    assert screen.prepare(weight).greedy(x).tolist() == [40]
    weight[40] = 0.0  # then the first is the next
    assert full_picks(f32_kernel, weight, x).tolist() == [41]
    assert screen.prepare(weight).greedy(x).tolist() == [41]


def test_screen_declines_what_it_cannot_vouch_for(screen):
    torch.manual_seed(0)
    head = screen.prepare(torch.randn(500, 64) * 0.05)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(3, 64)
        x[1, 5] = bad
        assert head.greedy(x) is None
    assert head.declined == 3
    assert head.greedy(torch.randn(3, 64)) is not None  # 3 declines in a row: it still tries
    head = screen.prepare(torch.randn(500, 64) * 0.05)
    screen.budget = screen.budget_per_row = 0  # not one float32 logit: every step declines
    for _ in range(head.streak):
        assert head.greedy(torch.randn(3, 64)) is None
    assert head.declined == head.streak
    screen.budget = 10**6  # resting: no try for `rest` calls, then one
    assert all(head.greedy(torch.randn(3, 64)) is None for _ in range(head.rest))
    assert head.declined == head.streak and head.greedy(torch.randn(3, 64)) is not None
    assert head.greedy(torch.full((2, 64), 1e37)) is None  # logits that might not be finite
    with pytest.raises(ValueError, match="float32"):
        head.greedy(torch.randn(3, 64).bfloat16())
    assert screen.prepare(torch.full((10, 8), float("nan"))) is None


def test_an_engine_with_the_screen_matches_transformers(engine_screen, tiny_llama, report):
    """Decode steps' greedy picks through the screen, and through the full head where it
    declines (a budget of no float32 logit), token-identical to transformers."""
    llm = make_llm(tiny_llama)
    prompts = mixed_prompts(llm.tokenizer, 12, seed=11)
    llm = run_and_compare(tiny_llama, prompts, 16, None, report, "tiny llama, screened head")
    head = llm.engine.runner.model._screen
    assert head is not None and head.picked > 0 and head.declined == 0
    engine_screen.budget = engine_screen.budget_per_row = 0
    llm = run_and_compare(tiny_llama, prompts, 16, None, report, "tiny llama, screen declining")
    assert llm.engine.runner.model._screen.declined > 0


def test_steps_of_more_rows_than_the_native_head_takes(
    engine_screen, tiny_llama, report, monkeypatch
):
    """Decode steps of more sequences than the native head takes (NATIVE_LINEAR_MAX_ROWS): the
    AVX512-VNNI tile picks them too, the AVX2 tile leaves them to the full head; token-identical
    to transformers either way."""
    picked_rows = []
    greedy_picks = CausalLM.greedy_picks

    def recorded(model, hidden):
        picks = greedy_picks(model, hidden)
        if picks is not None:
            picked_rows.append(hidden.shape[0])
        return picks

    monkeypatch.setattr(CausalLM, "greedy_picks", recorded)
    prompts = mixed_prompts(TokenizerWrapper(tiny_llama), 48, seed=5)
    run_and_compare(tiny_llama, prompts, 24, None, report, "tiny llama, 48 sequences screened")
    assert picked_rows
    assert (max(picked_rows) > NATIVE_LINEAR_MAX_ROWS) == engine_screen.wide


def test_greedy_tokens_are_the_same_with_sampled_requests_beside(engine_screen, tiny_llama):
    """A step with a sampled request takes the full head (the screen picks greedy steps alone);
    the greedy requests' tokens are those of a run of them alone, through the screen."""
    llm = make_llm(tiny_llama)
    prompts = mixed_prompts(llm.tokenizer, 6, seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True)
    alone = [r.outputs[0].token_ids for r in llm.generate(prompts, greedy)]
    mixed = llm.generate(prompts + prompts[:2], [greedy] * len(prompts) + [sampled] * 2)
    assert [r.outputs[0].token_ids for r in mixed[: len(prompts)]] == alone


@pytest.mark.smollm2
def test_smollm2_with_the_screen_matches_transformers(engine_screen, smollm2_dir, report):
    llm = make_llm(smollm2_dir)
    prompts = mixed_prompts(llm.tokenizer, 16, seed=3)
    eos = llm.engine.model_config.eos_token_ids[0]
    llm = run_and_compare(smollm2_dir, prompts, 24, eos, report, "SmolLM2, screened head")
    head = llm.engine.runner.model._screen
    assert head.picked > 0 and head.declined == 0
