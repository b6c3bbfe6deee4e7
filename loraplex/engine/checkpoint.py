"""Read a Hugging Face checkpoint directory (safetensors only) into loraplex's weight layout.

Projections that read the same input are fused so that each layer runs four matmuls:

    qkv     [q_size + 2 * kv_size, hidden]    q_proj | k_proj | v_proj
    o       [hidden, q_size]
    gate_up [2 * intermediate, hidden]        gate_proj | up_proj
    down    [hidden, intermediate]
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from loraplex.engine.config import ModelConfig


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_attention_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


class CheckpointError(ValueError):
    """The checkpoint directory cannot be loaded; the message says which file or tensor."""


def safetensors_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise CheckpointError(
            f"{model_dir} holds only pickle weights (.bin/.pt); loraplex never unpickles: "
            "convert it to safetensors"
        )
    raise CheckpointError(f"{model_dir} has no *.safetensors weights")


class _TensorReader(contextlib.ExitStack):
    """Every tensor of a (possibly sharded) checkpoint by name, files opened once."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self._files: dict[str, object] = {}
        for path in safetensors_files(model_dir):
            handle = self.enter_context(safe_open(path, framework="pt"))
            self._files.update(dict.fromkeys(handle.keys(), handle))
        self._dtype, self._device = dtype, device

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint")
        tensor = self._files[name].get_tensor(name)
        return tensor.to(dtype=self._dtype, device=self._device)


def load_weights(
    model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: str
) -> ModelWeights:
    with _TensorReader(model_dir, dtype, device) as reader:
        return _load_model(reader, config)


def _load_model(reader: _TensorReader, config: ModelConfig) -> ModelWeights:
    embed = reader.get("model.embed_tokens.weight")
    _expect_shape("model.embed_tokens.weight", embed, (config.vocab_size, config.hidden_size))
    tied = config.tie_word_embeddings or not reader.has("lm_head.weight")
    return ModelWeights(
        embed=embed,
        layers=[_load_layer(reader, config, i) for i in range(config.num_layers)],
        final_norm=reader.get("model.norm.weight"),
        lm_head=embed if tied else reader.get("lm_head.weight"),
    )


def _load_layer(reader: _TensorReader, config: ModelConfig, i: int) -> LayerWeights:
    prefix = f"model.layers.{i}"
    attn, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
    hidden = config.hidden_size
    q = reader.get(f"{attn}.q_proj.weight")
    k = reader.get(f"{attn}.k_proj.weight")
    v = reader.get(f"{attn}.v_proj.weight")
    _expect_shape(f"{attn}.q_proj.weight", q, (config.q_size, hidden))
    _expect_shape(f"{attn}.k_proj.weight", k, (config.kv_size, hidden))
    _expect_shape(f"{attn}.v_proj.weight", v, (config.kv_size, hidden))
    bias = None
    if config.qkv_bias:
        bias = torch.cat([reader.get(f"{attn}.{p}_proj.bias") for p in ("q", "k", "v")])
    gate = reader.get(f"{mlp}.gate_proj.weight")
    up = reader.get(f"{mlp}.up_proj.weight")
    return LayerWeights(
        input_norm=reader.get(f"{prefix}.input_layernorm.weight"),
        qkv=torch.cat([q, k, v]).contiguous(),
        qkv_bias=bias,
        o=reader.get(f"{attn}.o_proj.weight"),
        post_attention_norm=reader.get(f"{prefix}.post_attention_layernorm.weight"),
        gate_up=torch.cat([gate, up]).contiguous(),
        down=reader.get(f"{mlp}.down_proj.weight"),
    )


def _expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"tensor {name} has shape {tuple(tensor.shape)}, config.json implies {shape}"
        )
