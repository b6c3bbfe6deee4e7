"""loraplex's own Llama-family forward pass over a flat, unpadded token batch with paged KV.

Covers Llama 2/3, Mistral, SmolLM2 and Qwen2 (q/k/v bias): RMSNorm, GQA attention with RoPE,
SwiGLU MLP, optionally tied embeddings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.engine.adapters.lora_batch import Modules
from loraplex.engine.attention import paged_attention, write_kv
from loraplex.engine.checkpoint import LayerWeights, load_weights
from loraplex.engine.config import ModelConfig
from loraplex.engine.device import Linear, choose_bf16_ops, native_lm_head
from loraplex.engine.fetch_placement import FetchPlacement
from loraplex.engine.forward_batch import ForwardBatch
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.rope import RotaryEmbedding
from loraplex.kernels import cpu_lora


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # In float32 whatever the serving dtype, as the reference does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_attention_norm: torch.Tensor
    gate_up: Linear
    down: Linear

    @classmethod
    def from_weights(cls, w: LayerWeights) -> Layer:
        return cls(
            input_norm=w.input_norm,
            qkv=Linear(w.qkv, w.qkv_bias),
            o=Linear(w.o),
            post_attention_norm=w.post_attention_norm,
            gate_up=Linear(w.gate_up),
            down=Linear(w.down),
        )


class CausalLM:
    def __init__(
        self,
        config: ModelConfig,
        model_dir: Path,
        max_positions: int,
        dtype: torch.dtype,
        device: str,
    ) -> None:
        self.config = config
        weights = load_weights(model_dir, config, dtype, device)
        self.embed = weights.embed  # [vocab, hidden]
        self.layers = [Layer.from_weights(w) for w in weights.layers]
        self.final_norm = weights.final_norm
        self.lm_head = Linear(weights.lm_head, decode_kernel=native_lm_head())
        self.rope = RotaryEmbedding(config.rope, config.head_dim, max_positions, dtype, device)
        self.scale = config.head_dim**-0.5
        self._bf16_ops = choose_bf16_ops(device, dtype)
        # the LoRA modules on each projection's output: (module, first column, width)
        c, inter = config, config.intermediate_size
        self._qkv_modules = (
            ("q_proj", 0, c.q_size),
            ("k_proj", c.q_size, c.kv_size),
            ("v_proj", c.q_size + c.kv_size, c.kv_size),
        )
        self._o_modules = (("o_proj", 0, c.hidden_size),)
        self._gate_up_modules = (("gate_proj", 0, inter), ("up_proj", inter, inter))
        self._down_modules = (("down_proj", 0, c.hidden_size),)
        self.fetch_placement = FetchPlacement()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._bf16_ops is not None:
            return self._bf16_ops.rms_norm(x, weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _add_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + delta, its norm): in bfloat16 one native pass, the sum in place."""
        if self._bf16_ops is not None:
            return hidden, self._bf16_ops.add_rms_norm(
                hidden, delta, weight, self.config.rms_norm_eps
            )
        hidden = hidden + delta
        return hidden, rms_norm(hidden, weight, self.config.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCacheManager) -> torch.Tensor:
        """-> final hidden states of the rows in `batch.logits_indices`: [num_sampled, hidden].

        Each layer's residual adds go with the norm that follows them (the next layer's input
        norm after the MLP), so the bfloat16 path makes one pass of each add and norm."""
        started = time.perf_counter()
        hidden = self.embed[batch.input_ids]  # [num_tokens, hidden]
        cos, sin = self.rope.lookup(batch.positions)
        x = self._norm(hidden, self.layers[0].input_norm)
        # where gate_up may fetch the next layer's q,k,v rows, whether it does or each q,k,v
        # projection fetches its own is timed (fetch_placement.py)
        first = self._next_qkv_rows(batch, 0, self.layers[0], x)
        fetch_ahead = first is None or self.fetch_placement.choose()
        fetched = False  # whether the layer before brought this layer's q,k,v LoRA rows in
        for index, layer in enumerate(self.layers):
            cache = kv.layer_cache(index)
            attended = self._attention(index, layer, x, batch, cache, cos, sin, fetched)
            hidden, x = self._add_norm(hidden, attended, layer.post_attention_norm)
            if not fetch_ahead:
                ahead = None
            elif index == 0:
                ahead = first  # the rows do not depend on x's values, only on its shape
            else:
                ahead = self._next_qkv_rows(batch, index, layer, x)
            mlp = self._mlp(index, layer, x, batch, ahead)
            fetched = ahead is not None
            if index + 1 < len(self.layers):
                hidden, x = self._add_norm(hidden, mlp, self.layers[index + 1].input_norm)
        rows = batch.logits_indices  # the last add only for the rows that sample
        out = self._norm(hidden[rows] + mlp[rows], self.final_norm)
        if first is not None:
            self.fetch_placement.record(fetch_ahead, x.shape[0], time.perf_counter() - started)
        return out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_sampled, hidden] -> [num_sampled, vocab] in float32."""
        return self.lm_head(hidden).float()

    def _attention(
        self,
        index: int,
        layer: Layer,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        fetched: bool,
    ) -> torch.Tensor:
        c = self.config
        qkv = _project(batch, index, self._qkv_modules, x, layer.qkv, fetched=fetched)
        if self._bf16_ops is not None:
            q = self._bf16_ops.rotate_and_write(
                qkv, c.num_heads, c.num_kv_heads, self.rope.cos, self.rope.sin, batch.positions,
                kv_cache, batch.slot_pages, batch.slot_offsets,
            )  # fmt: skip
        else:
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = self.rope.rotate(q.reshape(-1, c.num_heads, c.head_dim), cos, sin)
            k = self.rope.rotate(k.reshape(-1, c.num_kv_heads, c.head_dim), cos, sin)
            write_kv(kv_cache, k, v.reshape(-1, c.num_kv_heads, c.head_dim), batch)
        attended = paged_attention(q, kv_cache, batch, self.scale).flatten(1)
        return _project(batch, index, self._o_modules, attended, layer.o)

    def _next_qkv_rows(
        self, batch: ForwardBatch, index: int, layer: Layer, x: torch.Tensor
    ) -> cpu_lora.Fetch | None:
        """The next layer's q,k,v adapter rows, for this layer's gate_up projection to bring into
        cache where it fetches and has no LoRA call of its own (adapters on attention only, as
        q,v adapters are); else None. Whether gate_up or the q,k,v projection itself is the
        faster to fetch them depends on the CPU, so forward times both (fetch_placement.py)."""
        lora = batch.lora
        if (
            lora is None
            or index + 1 == len(self.layers)
            or not layer.gate_up.fetches(x)
            or lora.plan(index, self._gate_up_modules) is not None
            or lora.plan(index + 1, self._qkv_modules) is None
        ):
            return None
        return lora.fetch(index + 1, self._qkv_modules, self.config.hidden_size)

    def _mlp(
        self,
        index: int,
        layer: Layer,
        x: torch.Tensor,
        batch: ForwardBatch,
        ahead: cpu_lora.Fetch | None,
    ) -> torch.Tensor:
        gate_up = _project(batch, index, self._gate_up_modules, x, layer.gate_up, ahead)
        if self._bf16_ops is not None:
            hidden = self._bf16_ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        return _project(batch, index, self._down_modules, hidden, layer.down)


def _project(
    batch: ForwardBatch,
    layer: int,
    modules: Modules,
    x: torch.Tensor,
    projection: Linear,
    ahead: cpu_lora.Fetch | None = None,
    fetched: bool = False,
) -> torch.Tensor:
    """projection(x), plus the LoRA deltas of `modules` (each at its columns of the output) for
    the tokens whose adapter changes them: in the projection's own native call where it takes
    the LoRA call, else after it; the adapter rows brought into cache during the projection
    where it fetches (AVX512-BF16), unless an earlier projection did (`fetched`). A projection
    with no LoRA call of its own fetches `ahead` (where it fetches): a later one's rows."""
    lora = batch.lora
    plan = lora.plan(layer, modules) if lora is not None else None
    if plan is None:
        return projection(x, ahead)
    fetching = projection.fetches(x) and not fetched
    fetch = lora.fetch(layer, modules, x.shape[-1]) if fetching else None
    if plan.fused is not None and projection.native(x):
        return projection(x, fetch, lora=plan.fused)
    out = projection(x, fetch)
    plan.add(x, out)
    return out
