"""bfloat16 is measured, not compared token for token: teacher-forced next-token agreement and
mean KL divergence against transformers in float32, for loraplex in bfloat16 and for
transformers/PEFT in bfloat16 on the same prompts, adapters and forced continuations. loraplex
must be no worse than transformers (with a margin).

Like for like: the peer runs wholly in bfloat16, adapter weights included, as loraplex keeps them
in its pool. PEFT's own default under a bfloat16 base keeps adapter weights in float32 (twice the
bytes); its figures are printed too, not asserted on.

Both bfloat16 runs are judged on the same information: the 20 likeliest tokens of each position
(what loraplex's prompt_logprobs return). The KL is taken over the float32 reference's 20
likeliest tokens plus one bucket for the rest of the vocabulary; a token outside a run's top 20 is
given that run's 20th log-probability (an upper bound on its own)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from loraplex import LoRARequest, SamplingParams
from loraplex.engine.adapters.peft_format import random_peft_adapter
from loraplex.engine.config import ModelConfig
from tests.factories import make_llm

DEMO = Path(__file__).resolve().parents[2] / "demo" / "adapters"
PROMPTS = [
    "The history of the lighthouse begins",
    "Here is a recipe for a simple tomato soup:",
    "Q: Why is the sky blue?\nA:",
    "def fibonacci(n):",
    "Dear team, I am writing to let you know that",
    "The three largest planets in the solar system are",
]
FORCED_TOKENS = 24  # the float32 reference's greedy continuation, fed back as input
TOP = 20
AGREEMENT_MARGIN = 0.02  # loraplex may agree this much less often than transformers
KL_MARGIN = 1.25  # ... and have at most this times its mean KL (plus KL_FLOOR)
KL_FLOOR = 0.002


@dataclass
class Score:
    agree: int = 0
    kl: float = 0.0
    positions: int = 0

    def add(self, reference: torch.Tensor, top: list[tuple[int, float]]) -> None:
        """`reference`: [vocab] float32 log-probabilities; `top`: a run's best (id, logprob)."""
        self.positions += 1
        self.agree += int(top[0][0] == int(reference.argmax()))
        self.kl += coarse_kl(reference, dict(top))

    @property
    def agreement(self) -> float:
        return self.agree / self.positions

    @property
    def mean_kl(self) -> float:
        return self.kl / self.positions


def coarse_kl(reference: torch.Tensor, top: dict[int, float]) -> float:
    ref_values, ref_ids = reference.topk(TOP)
    floor = min(top.values())
    p = ref_values.exp().tolist()
    q = [math.exp(top.get(token, floor)) for token in ref_ids.tolist()]
    kl = sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q, strict=True) if pi > 0)
    p_rest, q_rest = max(1.0 - sum(p), 1e-12), max(1.0 - sum(q), 1e-12)
    return kl + p_rest * (math.log(p_rest) - math.log(q_rest))


def top_of(logprobs: torch.Tensor) -> list[tuple[int, float]]:
    values, ids = logprobs.topk(TOP)
    return list(zip(ids.tolist(), values.tolist(), strict=True))


@torch.inference_mode()
def logprobs_of(model, ids: list[int]) -> torch.Tensor:
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def with_adapter(base, path: Path | None, float32_adapter: bool = True):
    if path is None:
        return base
    return PeftModel.from_pretrained(base, str(path), autocast_adapter_dtype=float32_adapter).eval()


def bf16_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)


@pytest.mark.smollm2
def test_bfloat16_is_no_worse_than_transformers_bfloat16(smollm2_dir, tmp_path, report):
    config = ModelConfig.from_dir(smollm2_dir)
    all_modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapters = {
        "base": None,
        "ahoy": DEMO / "ahoy",
        "uppercase": DEMO / "uppercase",
        "r16-all": random_peft_adapter(
            tmp_path / "r16", config, 16, all_modules, seed=5, std=0.6 / 16**0.5
        ),
    }
    llm = make_llm(smollm2_dir, dtype="bfloat16", memory_budget="512MiB")
    prompts = [llm.tokenizer.encode(text) for text in PROMPTS]
    ours, theirs, peft_default = Score(), Score(), Score()
    by_adapter = {}
    for name, path in adapters.items():
        mine, peers = Score(), Score()
        reference = with_adapter(
            AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32), path
        )
        peer = with_adapter(bf16_model(smollm2_dir), path, float32_adapter=False)
        default = with_adapter(bf16_model(smollm2_dir), path) if path else peer
        forced = []
        for ids in prompts:
            out = reference.generate(
                torch.tensor([ids]), max_new_tokens=FORCED_TOKENS, do_sample=False
            )
            forced.append(out[0].tolist())
        lora = LoRARequest(name, str(path)) if path else None
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP)
        results = llm.generate(forced, params, adapters=[lora] * len(forced))
        for ids, sequence, result in zip(prompts, forced, results, strict=True):
            ref, peer_logprobs = logprobs_of(reference, sequence), logprobs_of(peer, sequence)
            default_logprobs = logprobs_of(default, sequence) if path else peer_logprobs
            for target in range(len(ids), len(sequence)):  # the forced continuation's tokens
                for score in (ours, mine):
                    score.add(ref[target - 1], result.prompt_logprobs[target].top)
                for score in (theirs, peers):
                    score.add(ref[target - 1], top_of(peer_logprobs[target - 1]))
                peft_default.add(ref[target - 1], top_of(default_logprobs[target - 1]))
        by_adapter[name] = f"{mine.mean_kl:.4f}/{peers.mean_kl:.4f}"

    report(
        f"bfloat16 vs transformers float32, teacher-forced over {ours.positions} positions "
        f"(SmolLM2, base + 3 adapters): loraplex agreement {ours.agreement:.3f}, mean KL "
        f"{ours.mean_kl:.4f}; transformers/PEFT bfloat16 agreement {theirs.agreement:.3f}, "
        f"mean KL {theirs.mean_kl:.4f} (PEFT's default, adapters kept in float32: agreement "
        f"{peft_default.agreement:.3f}, mean KL {peft_default.mean_kl:.4f}); mean KL "
        "loraplex/transformers by adapter: "
        + ", ".join(f"{name} {kls}" for name, kls in by_adapter.items())
    )
    assert ours.agreement >= theirs.agreement - AGREEMENT_MARGIN
    assert ours.mean_kl <= KL_MARGIN * theirs.mean_kl + KL_FLOOR
