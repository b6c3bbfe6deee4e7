"""Scratch buffers reused from step to step.

A fresh multi-megabyte tensor is fresh memory: the kernel maps its pages on first touch, every
step. Gathers whose output is consumed at once (stacked adapter weights, gathered KV pages) write
into a named buffer that lives as long as the engine instead. So does the last step's LoRA
metadata, which the next step reuses while its tokens use the same adapters in the same order.
"""

from __future__ import annotations

import math

import torch


class Workspace:
    """Invariant: a name's buffer is only valid until the next `take` of the same name."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self.last_lora: tuple | None = None  # (key, metadata, adapters): lora_batch's to use

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)
