"""The committed demo adapters show their trained rule on questions they never saw."""

from __future__ import annotations

from pathlib import Path

import pytest

from demo.train_adapters import HELD_OUT, training_questions
from loraplex import SamplingParams
from tests.factories import make_llm

ADAPTERS = Path(__file__).resolve().parents[2] / "demo" / "adapters"


def uppercase_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / max(1, len(letters))


@pytest.mark.smollm2
def test_demo_adapters_follow_their_rule_and_the_base_model_does_not(smollm2_dir):
    assert not set(HELD_OUT) & set(training_questions())
    llm = make_llm(smollm2_dir, memory_budget="256MiB")
    conversations = [[{"role": "user", "content": q}] for q in HELD_OUT]
    params = SamplingParams(temperature=0.0, max_tokens=32)

    def answers(adapter):
        adapters = [str(ADAPTERS / adapter)] * len(HELD_OUT) if adapter else None
        return [r.outputs[0].text for r in llm.chat(conversations, params, adapters)]

    base, upper, ahoy = answers(None), answers("uppercase"), answers("ahoy")
    for question, b, u, a in zip(HELD_OUT, base, upper, ahoy, strict=True):
        assert uppercase_share(u) > 0.9, f"{question!r} -> {u!r}"
        assert uppercase_share(b) < 0.3, f"{question!r} -> {b!r}"
        assert a.startswith("Ahoy!"), f"{question!r} -> {a!r}"
        assert "Ahoy" not in b
