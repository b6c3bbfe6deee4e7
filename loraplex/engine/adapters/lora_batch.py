"""Per-step LoRA metadata: built once from the step's token order, applied by every layer.

The flat batch is ordered so that tokens of one adapter are contiguous (the forward batch sorts
decodes by adapter; a prefill span is one sequence, hence one adapter):

    tokens:   base base | a a | b | c c c c c | a a a a
    segments:             (2,2,a) (4,1,b) (5,5,c) (10,4,a)

Two ways to apply them, with the same result:

* `TorchLoRA` (CPU): decode tokens of adapters that share rank and modules are stacked into one
  batched matmul per projection; longer single-adapter segments use plain matmuls on views of the
  adapter's pool pages.
* `KernelLoRA` (CUDA: Triton; or the torch reference): the shrink/expand kernels over all segments
  in one launch each, adapters addressed through per-row pool offsets.
"""

from __future__ import annotations

import torch

from loraplex.engine.adapters.manager import ResidentAdapter
from loraplex.engine.adapters.peft_format import MODULES
from loraplex.kernels.lora import (
    Segments,
    lora_expand_reference,
    lora_expand_triton,
    lora_shrink_reference,
    lora_shrink_triton,
)

TokenRun = tuple[int, int, ResidentAdapter]  # (start, end, adapter)


def adapter_runs(token_adapters: list[ResidentAdapter | None]) -> list[TokenRun]:
    """Maximal runs of consecutive tokens that use the same adapter (base tokens skipped)."""
    runs: list[TokenRun] = []
    for i, adapter in enumerate(token_adapters):
        if adapter is None:
            continue
        if runs and runs[-1][2] is adapter and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1, adapter)
        else:
            runs.append((i, i + 1, adapter))
    return runs


def build_lora_batch(
    backend: str, token_adapters: list[ResidentAdapter | None], num_decodes: int, pool: torch.Tensor
) -> TorchLoRA | KernelLoRA | None:
    if all(adapter is None for adapter in token_adapters):
        return None
    if backend == "torch":
        return TorchLoRA(token_adapters, num_decodes)
    return KernelLoRA(token_adapters, pool, use_triton=backend == "triton")


class TorchLoRA:
    def __init__(self, token_adapters: list[ResidentAdapter | None], num_decodes: int) -> None:
        runs = adapter_runs(token_adapters)
        # Single decode tokens are batched; a run of several tokens of one adapter is its own
        # matmul.
        self.spans = [run for run in runs if run[1] - run[0] > 1 or run[0] >= num_decodes]
        singles = [run for run in runs if run[1] - run[0] == 1 and run[0] < num_decodes]
        self.groups = _group_by_shape(singles)

    def add(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        key = (layer, module)
        for start, end, adapters, scales in self.groups:
            if key not in adapters[0].a_chunks:
                continue
            a = torch.stack([ad.a_matrix(layer, module) for ad in adapters])  # [n, rank, in]
            v = torch.bmm(x[start:end].unsqueeze(1), a.transpose(1, 2)).mul_(scales)
            b = torch.stack([ad.b_matrix(layer, module) for ad in adapters])  # [n, rank, out]
            y[start:end].add_(torch.bmm(v, b).squeeze(1))
        for start, end, adapter in self.spans:
            if key not in adapter.a_chunks:
                continue
            v = x[start:end] @ adapter.a_matrix(layer, module).T  # [len, rank]
            y[start:end].addmm_(v, adapter.b_matrix(layer, module), alpha=adapter.scale)


def _group_by_shape(singles: list[TokenRun]):
    """Consecutive single tokens whose adapters have equal rank and modules -> one group each:
    (start, end, adapters, scales [n, 1, 1])."""
    groups, current = [], []
    for run in singles:
        if current and (run[0] != current[-1][1] or _shape(run[2]) != _shape(current[-1][2])):
            groups.append(current)
            current = []
        current.append(run)
    if current:
        groups.append(current)
    return [
        (
            g[0][0],
            g[-1][1],
            [run[2] for run in g],
            torch.tensor([run[2].scale for run in g]).view(-1, 1, 1),
        )
        for g in groups
    ]


def _shape(adapter: ResidentAdapter):
    return adapter.rank, adapter.targets


class KernelLoRA:
    """Segments and per-(layer, module) row-offset tables for the batched kernels."""

    def __init__(
        self, token_adapters: list[ResidentAdapter | None], pool: torch.Tensor, use_triton: bool
    ) -> None:
        runs = adapter_runs(token_adapters)
        slots: dict[int, int] = {}
        adapters: list[ResidentAdapter] = []
        for _, _, adapter in runs:
            if id(adapter) not in slots:
                slots[id(adapter)] = len(adapters)
                adapters.append(adapter)
        device = pool.device
        self.segments = Segments.from_lists(
            [(start, end - start, slots[id(ad)]) for start, end, ad in runs], device
        )
        self.pool = pool.view(-1)
        self.shrink = lora_shrink_triton if use_triton else lora_shrink_reference
        self.expand = lora_expand_triton if use_triton else lora_expand_reference
        self._build_tables(adapters, device)

    def _build_tables(self, adapters: list[ResidentAdapter], device) -> None:
        num_layers, num_modules = adapters[0].has_module.shape if adapters else (0, 0)
        max_rank = max((ad.rank for ad in adapters), default=0)
        shape = (num_layers, num_modules, len(adapters), max_rank)
        self.a_offsets = torch.zeros(shape, dtype=torch.long)
        self.b_offsets = torch.zeros(shape, dtype=torch.long)
        self.ranks = torch.zeros(shape[:3], dtype=torch.int32)
        for slot, ad in enumerate(adapters):
            self.a_offsets[:, :, slot, : ad.rank] = ad.a_offsets
            self.b_offsets[:, :, slot, : ad.rank] = ad.b_offsets
            self.ranks[:, :, slot] = ad.has_module.int() * ad.rank
        self.active = (self.ranks > 0).any(dim=-1).tolist()  # [layer][module] host-side
        self.scales = torch.tensor(
            [ad.scale for ad in adapters], dtype=torch.float32, device=device
        )
        self.a_offsets, self.b_offsets, self.ranks = (
            t.to(device) for t in (self.a_offsets, self.b_offsets, self.ranks)
        )

    def add(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> None:
        m = MODULES.index(module)
        if not self.active or not self.active[layer][m]:
            return
        ranks = self.ranks[layer, m]
        v = self.shrink(x, self.pool, self.a_offsets[layer, m], ranks, self.segments)
        self.expand(y, v, self.pool, self.b_offsets[layer, m], ranks, self.scales, self.segments)
