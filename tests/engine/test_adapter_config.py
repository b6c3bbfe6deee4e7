"""adapter_config.json is read strictly: every malformed or misleading config is refused with an
AdapterError carrying a code, and nothing that PEFT would not load is ever applied."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from loraplex import LoRARequest, SamplingParams
from loraplex.engine.errors import AdapterError, ErrorCode
from tests.factories import build_adapter, make_llm

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def edited(src, dst, change):
    shutil.copytree(src, dst)
    path = dst / "adapter_config.json"
    config = json.loads(path.read_text())
    changed = change(config)
    path.write_text(changed if isinstance(changed, str) else json.dumps(changed))
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
    "weights of excluded modules": (
        with_fields(exclude_modules=["v_proj"]),
        "v_proj.lora_A.weight is outside what adapter_config.json targets",
    ),
    "no target_modules means q/v only (PEFT's default)": (
        with_fields(target_modules=None),
        "k_proj.lora_A.weight is outside what adapter_config.json targets",
    ),
    "a pattern together with layers_to_transform": (
        with_fields(target_modules=r".*\.q_proj", layers_to_transform=[0]),
        "layers_to_transform cannot be used with a target_modules pattern",
    ),
    "r is a huge integer": (with_fields(r=10**400), "r must be a positive integer"),
    "lora_alpha is a huge integer": (
        with_fields(lora_alpha=10**400),
        "lora_alpha must be a finite",
    ),
    "an integer of 5000 digits": (
        lambda c: json.dumps({**c, "r": 0}).replace('"r": 0', '"r": ' + "9" * 5000),
        "is not valid JSON",
    ),
    "JSON nested 100000 deep": (lambda c: "[" * 100_000 + "]" * 100_000, "is not valid JSON"),
}


@pytest.fixture(scope="module")
def qv_adapter(tiny_llama, tmp_path_factory):
    return build_adapter(tiny_llama, tmp_path_factory.mktemp("qv") / "qv", rank=4)


@pytest.mark.parametrize("case", CASES)
def test_malformed_config_is_refused_with_a_code(
    tiny_llama, qv_adapter, tiny_adapters, tmp_path, case
):
    change, message = CASES[case]
    llm = make_llm(tiny_llama)
    source = tiny_adapters["qkv-r8"] if "default" in case else qv_adapter  # has k_proj weights
    bad = edited(source, tmp_path / "bad", change)
    with pytest.raises(AdapterError) as error:
        llm.generate(["the river"], GREEDY, adapters=[str(bad)])
    assert message in str(error.value)
    assert error.value.code is ErrorCode.ADAPTER_CORRUPT
    fine = llm.generate(["the river"], GREEDY, adapters=[str(qv_adapter)])
    assert len(fine[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    ("change", "served"),
    [
        (with_fields(target_modules=r".*\.(q_proj|v_proj)"), True),  # PEFT's regex form
        (with_fields(target_modules="ALL-LINEAR"), True),  # case-insensitive, as in PEFT
        (with_fields(layers_to_transform=[]), True),  # PEFT: empty means every layer
        (with_fields(layers_pattern="blocks"), False),
    ],
    ids=["regex", "all-linear", "no-layers", "layers-pattern"],
)
def test_configs_are_read_as_peft_reads_them(tiny_llama, qv_adapter, tmp_path, change, served):
    llm = make_llm(tiny_llama)
    expected = llm.generate(["the river"], GREEDY, adapters=[str(qv_adapter)])
    variant = edited(qv_adapter, tmp_path / "variant", change)
    if not served:
        with pytest.raises(AdapterError, match="not supported"):
            llm.generate(["the river"], GREEDY, adapters=[str(variant)])
        return
    got = llm.generate(["the river"], GREEDY, adapters=[LoRARequest("v", str(variant))])
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_a_pathological_pattern_is_refused_quickly(tiny_llama, qv_adapter, tmp_path):
    """A pattern that backtracks for seconds must not freeze the engine for every tenant."""
    slow = r"(.*)(.*)(.*)(.*)(.*)(.*)(.*)\7\6\5\4\3\2\1"
    variant = edited(qv_adapter, tmp_path / "redos", with_fields(target_modules=slow))
    llm = make_llm(tiny_llama)
    started = time.monotonic()
    with pytest.raises(AdapterError, match="takes too long") as error:
        llm.generate(["the river"], GREEDY, adapters=[str(variant)])
    assert error.value.code is ErrorCode.ADAPTER_UNSUPPORTED
    assert time.monotonic() - started < 5


def test_unusable_files_and_paths_are_adapter_errors(tiny_llama, qv_adapter, tmp_path):
    from safetensors.torch import save_file

    scalar = tmp_path / "scalar"
    shutil.copytree(qv_adapter, scalar)
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file(
        {f"{name}.lora_A.weight": torch.tensor(1.0), f"{name}.lora_B.weight": torch.tensor(1.0)},
        scalar / "adapter_model.safetensors",
    )
    llm = make_llm(tiny_llama)
    for path, code in (
        (scalar, ErrorCode.ADAPTER_CORRUPT),
        ("/tmp/with\0nul", ErrorCode.ADAPTER_NOT_FOUND),
        ("/tmp/" + "x" * 5000, ErrorCode.ADAPTER_NOT_FOUND),
    ):
        with pytest.raises(AdapterError) as error:
            llm.generate(["the river"], GREEDY, adapters=[str(path)])
        assert error.value.code is code
