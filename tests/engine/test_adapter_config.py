"""adapter_config.json is read strictly: every malformed or misleading config is refused with an
AdapterError carrying a code, and nothing that PEFT would not load is ever applied."""

from __future__ import annotations

import json
import shutil

import pytest

from loraplex import LoRARequest, SamplingParams
from loraplex.engine.errors import AdapterError, ErrorCode
from tests.factories import build_adapter, make_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def edited(src, dst, change):
    shutil.copytree(src, dst)
    path = dst / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(change(config)))
    return dst


def with_fields(**fields):
    return lambda config: {**config, **fields}


CASES = {
    "r is 0": (with_fields(r=0), "r must be a positive integer, got 0"),
    "r is a string": (with_fields(r="4"), "r must be a positive integer, got '4'"),
    "config is a list": (lambda c: [c], "must hold a JSON object, got list"),
    "use_rslora is a string": (
        with_fields(use_rslora="false"),
        "use_rslora must be true or false, got 'false'",
    ),
    "lora_alpha is NaN": (with_fields(lora_alpha=float("nan")), "lora_alpha must be a finite"),
    "lora_alpha is 1e30": (with_fields(lora_alpha=1e30), "loraplex serves scales up to 10000"),
    "weights outside layers_to_transform": (
        with_fields(layers_to_transform=[1]),
        "layers.0.self_attn.q_proj.lora_A.weight is outside what adapter_config.json targets",
    ),
    "weights outside target_modules": (
        with_fields(target_modules=["q_proj"]),
        "v_proj.lora_A.weight is outside what adapter_config.json targets",
    ),
    "target_modules is a number": (
        with_fields(target_modules=7),
        "target_modules must be a list of module names or a pattern",
    ),
    "layers_to_transform holds a string": (
        with_fields(layers_to_transform=["1"]),
        "layers_to_transform must be layer indices",
    ),
}


@pytest.fixture(scope="module")
def qv_adapter(tiny_llama, tmp_path_factory):
    return build_adapter(tiny_llama, tmp_path_factory.mktemp("qv") / "qv", rank=4)


@pytest.mark.parametrize("case", CASES)
def test_malformed_config_is_refused_with_a_code(tiny_llama, qv_adapter, tmp_path, case):
    change, message = CASES[case]
    llm = make_llm(tiny_llama)
    bad = edited(qv_adapter, tmp_path / "bad", change)
    with pytest.raises(AdapterError) as error:
        llm.generate(["the river"], GREEDY, adapters=[str(bad)])
    assert message in str(error.value)
    assert error.value.code is ErrorCode.ADAPTER_CORRUPT
    fine = llm.generate(["the river"], GREEDY, adapters=[str(qv_adapter)])
    assert len(fine[0].outputs[0].token_ids) == 8


def test_regex_target_modules_and_matching_layers_are_served(tiny_llama, qv_adapter, tmp_path):
    """PEFT's other spellings of the same targets load, and serve the same output."""
    llm = make_llm(tiny_llama)
    expected = llm.generate(["the river"], GREEDY, adapters=[str(qv_adapter)])
    pattern = edited(
        qv_adapter,
        tmp_path / "regex",
        with_fields(target_modules=r".*\.(q_proj|v_proj)", layers_to_transform=[0, 1, 2]),
    )
    got = llm.generate(["the river"], GREEDY, adapters=[LoRARequest("regex", str(pattern))])
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
