"""loraplex's own Llama-family forward pass over a flat, unpadded token batch with paged KV.

Covers Llama 2/3, Mistral, SmolLM2 and Qwen2 (q/k/v bias): RMSNorm, GQA attention with RoPE,
SwiGLU MLP, optionally tied embeddings.
"""

from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from loraplex.engine.adapters.lora_batch import TorchLoRA
from loraplex.engine.attention import paged_attention, write_kv
from loraplex.engine.checkpoint import LayerWeights, load_weights
from loraplex.engine.config import ModelConfig
from loraplex.engine.device import Linear, choose_ops, choose_screen
from loraplex.engine.fetch_placement import AHEAD, ALL, SHRINKS, FetchPlacement, Ways
from loraplex.engine.forward_batch import ForwardBatch
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.lora_steps import (
    NO_LORA,
    BatchSteps,
    LayerLoRA,
    ProjectionStep,
    StepLoRA,
    StridedSteps,
    own_fetch,
    projection_step,
)
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

    @property
    def projections(self) -> tuple[Linear, Linear, Linear, Linear]:
        """q,k,v, o, gate_up, down, in the order a layer runs them."""
        return self.qkv, self.o, self.gate_up, self.down


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
        self.lm_head = Linear(weights.lm_head)
        self._screen = choose_screen(weights.lm_head, self.lm_head)
        self.rope = RotaryEmbedding(config.rope, config.head_dim, max_positions, dtype, device)
        self.scale = config.head_dim**-0.5
        self._ops = choose_ops(device, dtype)
        # a step's layers in one native call where it takes the step (_fused_layers);
        # cpu/layers.c takes a bias on q,k,v alone, as Layer has them
        unbiased = all(
            p.bias is None for layer in self.layers for p in (layer.o, layer.gate_up, layer.down)
        )
        fusable = self._ops is not None and unbiased
        self._decoder = cpu_lora.load_decoder_layers() if fusable else None
        self._decoder_layers: tuple[int, object] | None = None  # (the KV pool's address, them)
        inter = config.intermediate_size
        self._layer_buffers = (  # workspace names and row widths of the layers' stages
            ("layers_qkv", config.q_size + 2 * config.kv_size), ("layers_q", config.q_size),
            ("layers_attended", config.q_size), ("layers_o", config.hidden_size),
            ("layers_gate_up", 2 * inter), ("layers_act", inter),
            ("layers_down", config.hidden_size),
        )  # fmt: skip
        self.fuse_layers = True  # False: the calls one by one (tests compare the two)
        # the LoRA modules on each projection's output: (module, first column, width)
        c, inter = config, config.intermediate_size
        self._qkv_modules = (
            ("q_proj", 0, c.q_size),
            ("k_proj", c.q_size, c.kv_size),
            ("v_proj", c.q_size + c.kv_size, c.kv_size),
        )
        # those of each of a layer's projections, in Layer.projections' order
        self._modules = (
            self._qkv_modules,
            (("o_proj", 0, c.hidden_size),),
            (("gate_proj", 0, inter), ("up_proj", inter, inter)),
            (("down_proj", 0, c.hidden_size),),
        )
        self.fetch_placement = FetchPlacement()
        self._steps: BatchSteps | None = None  # the last batch's LoRA steps (_lora_steps)
        self._likely_shrinks: bool | None = None  # the last step's way fetched A rows alone

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._ops is not None:
            return self._ops.rms_norm(x, weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _add_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden + delta, its norm): one native pass where the native ops run, the sum in
        place."""
        if self._ops is not None:
            return hidden, self._ops.add_rms_norm(hidden, delta, weight, self.config.rms_norm_eps)
        hidden = hidden + delta
        return hidden, rms_norm(hidden, weight, self.config.rms_norm_eps)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: KVCacheManager) -> torch.Tensor:
        """-> final hidden states of the rows in `batch.logits_indices`: [num_sampled, hidden].

        Each layer's residual adds go with the norm that follows them (the next layer's input
        norm after the MLP), so the native ops make one pass of each add and norm; where it
        can, it runs every layer in one native call (_takes_fused)."""
        started = time.perf_counter()
        hidden = self.embed[batch.input_ids]  # [num_tokens, hidden]
        x = self._norm(hidden, self.layers[0].input_norm)
        steps = self._lora_steps(batch, x)
        # where a step may fetch its LoRA rows more than one way, which is timed
        # (fetch_placement.py)
        ways = steps.ways
        way = ways[0]
        if len(ways) > 1:
            way = self.fetch_placement.choose(steps.key, ways)
            self._likely_shrinks = steps.shrinks(way)
        if self._takes_fused(batch, x.shape[0], steps):
            mlp = self._fused_layers(batch, kv, x, hidden, steps.native_calls(way))
        else:
            layers = steps.layers_for(way)
            hidden, mlp = self._layer_by_layer(batch, kv, x, hidden, layers, way == AHEAD)
        rows = batch.logits_indices  # the last add only for the rows that sample
        out = self._norm(hidden[rows] + mlp[rows], self.final_norm)
        if len(ways) > 1:
            seconds = time.perf_counter() - started
            self.fetch_placement.record(steps.key, ways, way, x.shape[0], seconds)
        return out

    def _layer_by_layer(
        self,
        batch: ForwardBatch,
        kv: KVCacheManager,
        x: torch.Tensor,
        hidden: torch.Tensor,
        steps: list[LayerLoRA],
        fetch_ahead: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer, its calls one by one -> the residual stream without the last layer's MLP
        output, and that output. With `fetch_ahead`, each gate_up fetches the next layer's q,k,v
        rows where its step has them (LayerLoRA.ahead), and that q,k,v projection fetches none."""
        cos, sin = self.rope.lookup(batch.positions)
        fetched = False  # whether the layer before brought this layer's q,k,v LoRA rows in
        for index, (layer, step) in enumerate(zip(self.layers, steps, strict=True)):
            cache = kv.layer_cache(index)
            attended = self._attention(layer, step, x, batch, cache, cos, sin, fetched)
            hidden, x = self._add_norm(hidden, attended, layer.post_attention_norm)
            ahead = step.ahead if fetch_ahead else None
            mlp = self._mlp(layer, step, x, ahead)
            fetched = ahead is not None
            if index + 1 < len(self.layers):
                hidden, x = self._add_norm(hidden, mlp, self.layers[index + 1].input_norm)
        return hidden, mlp

    def _takes_fused(self, batch: ForwardBatch, rows: int, steps: BatchSteps) -> bool:
        """Whether the step's `rows` tokens go through the layers in one native call: the native
        ops, every token a query row of the attention kernel, every projection native for that
        many rows, and every LoRA call of the batch's `steps` one cpu/layers.c makes."""
        if self._decoder is None or not self.fuse_layers or not steps.native:
            return False
        if batch.attention_kernel is None or batch.num_row_queries != rows:
            return False
        first = self.layers[0]
        return all(p.native_rows(rows) for p in first.projections)

    def _fused_layers(
        self,
        batch: ForwardBatch,
        kv: KVCacheManager,
        x: torch.Tensor,
        hidden: torch.Tensor,
        lora: ctypes.Array | None,
    ) -> torch.Tensor:
        """Every layer in one native call (cpu/layers.c), the residual stream `hidden` added to
        in place, with the batch's LoRA calls and fetches `lora` (BatchSteps.native_calls) ->
        the last layer's MLP output (a workspace buffer, until the next step)."""
        rows, space = x.shape[0], batch.workspace
        layers, shape = self._decoder_arguments(kv)
        buffers = [space.take(name, (rows, width), x.dtype) for name, width in self._layer_buffers]
        step = cpu_lora.DecoderStep(
            rows, batch.row_block_tables.stride(0), batch.positions.data_ptr(),
            batch.slot_pages.data_ptr(), batch.slot_offsets.data_ptr(),
            batch.row_block_tables.data_ptr(), batch.row_lens.data_ptr(), x.data_ptr(),
            hidden.data_ptr(), *(buffer.data_ptr() for buffer in buffers),
        )  # fmt: skip
        self._decoder(x.dtype, layers, shape, step, lora)
        return buffers[-1]  # the down projection's

    def _decoder_arguments(self, kv: KVCacheManager) -> tuple:
        """The layers' weights and caches and the model's shapes as cpu/layers.c takes them,
        made once for the KV pool (whose pages never move)."""
        first = kv.layer_cache(0)
        if self._decoder_layers is not None and self._decoder_layers[0] == first.data_ptr():
            return self._decoder_layers[1]
        c = self.config
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [None]
        layers = (cpu_lora.DecoderLayer * len(self.layers))(
            *(
                _decoder_layer(layer, next_norm, kv.layer_cache(i))
                for i, (layer, next_norm) in enumerate(zip(self.layers, next_norms, strict=True))
            )
        )
        shape = cpu_lora.DecoderShape(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
            first.shape[1], first.stride(0), self.rope.cos.shape[0], self.rope.cos.data_ptr(),
            self.rope.sin.data_ptr(), c.rms_norm_eps, self.scale,
        )  # fmt: skip
        self._decoder_layers = (first.data_ptr(), (layers, shape))
        return layers, shape

    @torch.inference_mode()
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_sampled, hidden] -> [num_sampled, vocab] in the serving dtype."""
        return self.lm_head(hidden)

    @torch.inference_mode()
    def greedy_picks(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_sampled, hidden] -> int64 [num_sampled], each row's greedy token, where the LM
        head's screen takes these rows (device.choose_screen; it declines rows that are not all
        finite); else None. Its picks are the native float32 head's, which takes up to
        NATIVE_LINEAR_MAX_ROWS rows; its AVX512-VNNI tile takes more too (`any_rows`), where the
        full head would be oneDNN's, whose float32 sums may differ from those in the last
        place, and then so may a near-tie's pick."""
        if self._screen is None:
            return None
        if not (self._screen.any_rows or self.lm_head.native(hidden)):
            return None
        return self._screen.greedy(hidden)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_sampled, hidden] -> [num_sampled, vocab] in float32."""
        return self.head(hidden).float()

    def _lora_steps(self, batch: ForwardBatch, x: torch.Tensor) -> BatchSteps:
        """What each layer's projections take from the batch's LoRA metadata, decided once for
        a batch's adapters and kept for every step of an unchanged batch, as the metadata itself
        is (which also fixes the rows: one adapter entry a token). Decided anew at every
        projection, the LoRA path's Python cost a decode step on 32 q,v adapters about 0.33 ms
        over base (2-core Zen 5, 25 ms steps)."""
        lora, rows = batch.lora, x.shape[0]
        if lora is None:
            return self._no_lora
        if self._steps is not None and self._steps.lora is lora:
            return self._steps
        layers = functools.partial(self._layer_steps, lora, rows, x.dtype)
        strided = functools.partial(self._strided_steps, lora, rows, x.dtype)
        contents = self._fetch_contents(rows)
        self._steps = BatchSteps(lora, layers, strided, contents, self._likely_shrinks)
        return self._steps

    def _fetch_contents(self, rows: int) -> Ways:
        """What a step of `rows` rows may have its projections fetch of their own LoRA calls'
        rows, the CPU's choice first: all of them and the A rows alone (fetch_placement.py) where
        the native projections can fetch either (float32 on AMD's and on Intel's with
        AVX512-FP16, decode-sized), else their one way (ALL stands for it)."""
        qkv = self.layers[0].qkv
        if not (qkv.fetches_rows(rows) and qkv.fetches_shrink_rows(rows)):
            return (ALL,)
        return (SHRINKS, ALL) if qkv.shrinks_first else (ALL, SHRINKS)

    def _layer_steps(
        self, lora: StepLoRA, rows: int, dtype: torch.dtype, shrinks: bool
    ) -> tuple[list[LayerLoRA], bool]:
        """Each layer's projection steps for a batch of `rows` rows (fetching their A rows alone
        with `shrinks`, where they can), and whether cpu/layers.c can make all their LoRA
        calls."""
        projections = [
            tuple(
                projection_step(lora, index, modules, rows, projection, shrinks)
                for modules, projection in zip(self._modules, layer.projections, strict=True)
            )
            for index, layer in enumerate(self.layers)
        ]
        steps = []
        for index, (layer, (qkv, o, gate_up, down)) in enumerate(
            zip(self.layers, projections, strict=True)
        ):
            next_qkv = projections[index + 1][0] if index + 1 < len(projections) else NO_LORA
            ahead = self._next_qkv_rows(lora, index, layer, rows, gate_up, next_qkv)
            steps.append(LayerLoRA(qkv, o, gate_up, down, ahead))
        return steps, self._decoder is not None and self._native_steps(steps, rows, dtype)

    def _strided_steps(
        self, lora: StepLoRA, rows: int, dtype: torch.dtype, shrinks: bool
    ) -> StridedSteps | None:
        """The batch's LoRA for every layer at once, where each projection's is one native call
        in it, the same in every layer but for where its tables are (TorchLoRA.layer_call): made
        without a step a layer, for cpu/layers.c (fetching the A rows alone with `shrinks`, where
        they can); None where it is not that, or the layers take no native call."""
        if self._decoder is None or not isinstance(lora, TorchLoRA):
            return None
        first, parts = self.layers[0], []
        for modules, projection in zip(self._modules, first.projections, strict=True):
            layer_call = lora.layer_call(modules)
            if layer_call is None:
                return None
            fetch = None
            if layer_call.call is not None:
                if not projection.native_rows(rows):
                    return None
                layer_call.call.check_fits(rows, projection.out_features, dtype, dtype)
                own = own_fetch(projection, rows, True, shrinks)
                if own is not None:
                    fetch = lora.layer_fetch(modules, projection.in_features, shrinks_only=own)
            parts.append((layer_call, fetch))
        # as _next_qkv_rows decides it for each layer but the last
        (qkv, _), (gate_up, _) = parts[0], parts[2]
        ahead = None
        if (
            len(self.layers) > 1
            and gate_up.call is None
            and qkv.call is not None
            and first.gate_up.fetches_decode_rows(rows)
        ):
            ahead = lora.layer_fetch(self._qkv_modules, self.config.hidden_size)
        return StridedSteps(tuple(parts), ahead)

    def _native_steps(self, steps: list[LayerLoRA], rows: int, dtype: torch.dtype) -> bool:
        """Whether every LoRA call of `steps` is a native kernel call, which cpu/layers.c can
        make as _project does (each checked to fit the step's `rows` rows)."""
        for layer, step in zip(self.layers, steps, strict=True):
            for projection, p in zip(
                layer.projections,
                (step.qkv, step.o, step.gate_up, step.down),
                strict=True,
            ):
                calls = p.plan.calls if p.plan is not None else ()
                if not all(isinstance(call, cpu_lora.BoundLoRA) for call in calls):
                    return False
                for call in calls:
                    call.check_fits(rows, projection.out_features, dtype, dtype)
        return True

    @functools.cached_property
    def _no_lora(self) -> BatchSteps:
        no_lora = LayerLoRA(NO_LORA, NO_LORA, NO_LORA, NO_LORA, None)
        return BatchSteps(None, lambda shrinks: ([no_lora] * len(self.layers), True))

    def _attention(
        self,
        layer: Layer,
        step: LayerLoRA,
        x: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        fetched: bool,
    ) -> torch.Tensor:
        c = self.config
        qkv = _project(step.qkv, x, layer.qkv, fetched=fetched)
        if self._ops is not None:
            q = self._ops.rotate_and_write(
                qkv, c.num_heads, c.num_kv_heads, self.rope.cos, self.rope.sin, batch.positions,
                kv_cache, batch.slot_pages, batch.slot_offsets,
            )  # fmt: skip
        else:
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = self.rope.rotate(q.reshape(-1, c.num_heads, c.head_dim), cos, sin)
            k = self.rope.rotate(k.reshape(-1, c.num_kv_heads, c.head_dim), cos, sin)
            write_kv(kv_cache, k, v.reshape(-1, c.num_kv_heads, c.head_dim), batch)
        attended = paged_attention(q, kv_cache, batch, self.scale).flatten(1)
        return _project(step.o, attended, layer.o)

    def _next_qkv_rows(
        self,
        lora: StepLoRA,
        index: int,
        layer: Layer,
        rows: int,
        gate_up: ProjectionStep,
        next_qkv: ProjectionStep,
    ) -> cpu_lora.Fetch | None:
        """The next layer's q,k,v adapter rows, for this layer's gate_up projection to bring into
        cache where it fetches and has no LoRA call of its own (adapters on attention only, as
        q,v adapters are); else None. Whether gate_up or the q,k,v projection itself is the
        faster to fetch them depends on the CPU, so forward times both (fetch_placement.py), on
        decode-sized steps (NATIVE_LINEAR_MAX_ROWS rows at most): in a larger one (a prompt
        chunk's) each q,k,v projection fetches its own."""
        if gate_up.plan is not None or next_qkv.plan is None:
            return None  # gate_up has its own LoRA call, or the next layer's q,k,v none
        if not layer.gate_up.fetches_decode_rows(rows):
            return None
        return lora.fetch(index + 1, self._qkv_modules, self.config.hidden_size)

    def _mlp(
        self, layer: Layer, step: LayerLoRA, x: torch.Tensor, ahead: cpu_lora.Fetch | None
    ) -> torch.Tensor:
        gate_up = _project(step.gate_up, x, layer.gate_up, ahead)
        if self._ops is not None:
            hidden = self._ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        return _project(step.down, hidden, layer.down)


def _decoder_layer(
    layer: Layer, next_norm: torch.Tensor | None, cache: torch.Tensor
) -> cpu_lora.DecoderLayer:
    """A layer as cpu/layers.c takes it: its native projections' packed weights, the q,k,v bias
    (or none), its norm after attention, the next layer's input norm (none after the last) and
    its KV cache."""
    packed = [p.native_packed.data_ptr() for p in layer.projections]
    bias = layer.qkv.bias.data_ptr() if layer.qkv.bias is not None else None
    return cpu_lora.DecoderLayer(
        packed[0], bias, *packed[1:], layer.post_attention_norm.data_ptr(),
        next_norm.data_ptr() if next_norm is not None else None, cache.data_ptr(),
    )  # fmt: skip


def _project(
    step: ProjectionStep,
    x: torch.Tensor,
    projection: Linear,
    ahead: cpu_lora.Fetch | None = None,
    fetched: bool = False,
) -> torch.Tensor:
    """projection(x), plus the LoRA deltas of its step's plan for the tokens whose adapter
    changes them: in the projection's own native call where it takes the LoRA call, else after
    it; the adapter rows brought into cache during the projection where it fetches (bfloat16 on
    AVX512-BF16 without AMX, float32 on AMD's and on Intel's with AVX512-FP16; the step's
    fetch_placement.py way), unless an earlier projection did (`fetched`). A projection with no
    LoRA call of its own fetches `ahead` (where it fetches): a later one's rows."""
    if step.plan is None:
        return projection(x, ahead)
    fetch = None if fetched else step.fetch
    if step.fused is not None:
        return projection(x, fetch, lora=step.fused)
    out = projection(x, fetch)
    step.plan.add(x, out)
    return out
