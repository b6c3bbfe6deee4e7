"""Turns a step's logits into one token per sampling sequence.

Order, as OpenAI and vLLM apply it: frequency/presence penalties on the raw logits, then the
logit bias, then the structured-output mask (constrained rows only), then greedy argmax, or
temperature -> top-k -> top-p -> a draw from the sequence's own generator (so a seeded request
draws the same numbers whatever else shares the batch).
Log-probabilities are those of the model's raw distribution.
"""

from __future__ import annotations

from typing import Protocol

import torch

from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.sequence import Sequence, TokenLogprob
from loraplex.engine.structured import Masks


class Argmax(Protocol):
    """Greedy sampling's pick (device.choose_argmax)."""

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """[n, vocab] float32 -> int64 [n], the first best of each row."""

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """[n, vocab] float32 or bfloat16 -> the picks and whether each row is all finite, from
        one pass; None where it has no such pass for these logits."""


class Sampler:
    def __init__(self, seed: int, argmax: Argmax) -> None:
        self._shared_generator = torch.Generator().manual_seed(seed)
        self._argmax = argmax

    def greedy(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a step whose sequences all pick greedily and ask for nothing more (plain_greedy,
        which the caller checks): each row's token (int64) and whether its logits are all
        finite (bool), from one pass over `logits` in the dtype the model gave them (bfloat16
        needs no float32 copy). None where the argmax has no such pass: then the runner takes
        float32 logits to __call__."""
        return self._argmax.greedy(logits)

    @staticmethod
    def plain_greedy(seqs: list[Sequence], masks: Masks | None = None) -> bool:
        """Whether each of `seqs` takes the argmax of its raw logits and asks for nothing more
        (no penalty, logit bias, structured-output mask or log-probabilities)."""
        return masks is None and all(_plain_greedy(seq.params) for seq in seqs)

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], masks: Masks | None = None
    ) -> list[tuple[int, TokenLogprob | None]]:
        """logits [num_seqs, vocab] float32, one row per sequence of `seqs`; `masks` the token
        masks of those with a structured-output constraint (the runner starts filling them
        before the forward pass)."""
        raw_logprobs = None
        if any(seq.params.logprobs is not None for seq in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if any(seq.params.has_penalties for seq in seqs):
            logits = _apply_penalties(logits, seqs)
        if any(seq.params.logit_bias for seq in seqs):
            logits = _apply_logit_bias(logits, seqs)
        if masks is not None:
            masks.apply(logits, [seq.matcher for seq in seqs])
        token_ids = self._argmax(logits)
        random_rows = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
        if random_rows:
            drawn = self._draw(logits[random_rows], [seqs[i] for i in random_rows])
            token_ids[random_rows] = drawn
        chosen = token_ids.tolist()
        return [
            (
                token,
                logprob_entry(raw_logprobs[i], token, seq.params.logprobs)
                if raw_logprobs is not None and seq.params.logprobs is not None
                else None,
            )
            for i, (token, seq) in enumerate(zip(chosen, seqs, strict=True))
        ]

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temperatures = torch.tensor([s.params.temperature for s in seqs], dtype=logits.dtype)
        logits = logits / temperatures[:, None]
        if any(s.params.top_k is not None or s.params.top_p < 1.0 for s in seqs):
            logits = _top_k_top_p(logits, seqs)
        probs = torch.softmax(logits, dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p, and each row's noise
        # comes from its own generator.
        noise = torch.stack(
            [
                torch.empty(probs.shape[1]).exponential_(
                    generator=s.generator or self._shared_generator
                )
                for s in seqs
            ]
        )
        return (probs / noise).argmax(dim=-1)


def _plain_greedy(params: SamplingParams) -> bool:
    """Whether a sequence's pick is the argmax of its raw logits and asks for nothing more."""
    return (
        params.greedy and params.logprobs is None and not params.has_penalties
        and not params.logit_bias
    )  # fmt: skip


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    counts = torch.zeros_like(logits)
    for row, seq in enumerate(seqs):
        output = seq.output_token_ids
        if output:
            counts[row].index_add_(0, torch.tensor(output), torch.ones(len(output)))
    frequency = torch.tensor([s.params.frequency_penalty for s in seqs])[:, None]
    presence = torch.tensor([s.params.presence_penalty for s in seqs])[:, None]
    return logits - frequency * counts - presence * (counts > 0).float()


def _apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    logits = logits.clone()
    for row, seq in enumerate(seqs):
        bias = seq.params.logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long)
            logits[row].index_add_(0, ids, torch.tensor(list(bias.values()), dtype=logits.dtype))
    return logits


def _top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    top_k = torch.tensor([min(s.params.top_k or vocab, vocab) for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs], dtype=logits.dtype)
    ranks = torch.arange(vocab)[None, :]
    drop = ranks >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
    # already does. The best token is always kept.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop[:, 0] = False
    filtered = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, filtered)


def logprob_entry(logprobs: torch.Tensor, token: int, num_top: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if num_top:
        values, ids = logprobs.topk(num_top)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token_id=token, logprob=logprobs[token].item(), top=top)
