"""The reference: transformers' greedy `generate`, one request at a time, float32, and the rule
for comparing against it.

Two float32 implementations add in different orders, so their logits differ in the last bits.
Where the reference's two best candidates are within NEAR_TIE of each other that can flip a greedy
choice without either being wrong: such a sequence is compared up to that token only, and the
near-tie is counted. Any other difference fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

NEAR_TIE = 1e-3


@dataclass
class Reference:
    token_ids: list[int]
    logits: list[torch.Tensor]  # raw logits before each generated token: [vocab] float32


def load_reference_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@torch.inference_mode()
def reference_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None
) -> Reference:
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if eos_token_id is not None else 0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return Reference(token_ids=tokens, logits=[step[0].float() for step in out.logits])


@dataclass
class Comparison:
    matched: bool
    near_tie_at: int | None  # position of the near-tie where comparison stopped
    detail: str = ""


def compare_greedy(ours: list[int], ref: Reference) -> Comparison:
    for t, (mine, theirs) in enumerate(zip(ours, ref.token_ids, strict=False)):
        if mine == theirs:
            continue
        gap = abs(ref.logits[t][mine].item() - ref.logits[t][theirs].item())
        if gap < NEAR_TIE:
            return Comparison(True, t)
        return Comparison(
            False,
            None,
            f"token {t}: ours {mine}, reference {theirs}, reference logit gap {gap:.4g}",
        )
    if len(ours) != len(ref.token_ids):
        return Comparison(
            False, None, f"lengths differ: ours {len(ours)}, reference {len(ref.token_ids)}"
        )
    return Comparison(True, None)


def assert_matches_reference(outputs: list[list[int]], refs: list[Reference]) -> int:
    """Fails on any real divergence; returns the number of near-ties met."""
    failures, near_ties = [], 0
    for i, (ours, ref) in enumerate(zip(outputs, refs, strict=True)):
        result = compare_greedy(ours, ref)
        if not result.matched:
            failures.append(f"prompt {i}: {result.detail}")
        near_ties += result.near_tie_at is not None
    assert not failures, "greedy output differs from transformers:\n" + "\n".join(failures)
    return near_ties
