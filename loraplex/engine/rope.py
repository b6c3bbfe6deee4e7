"""Rotary position embeddings, with the linear and Llama-3 frequency scalings."""

from __future__ import annotations

import math

import torch

from loraplex.engine.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32, computed the way the reference implementation computes it."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3 keeps high frequencies (short wavelengths), divides low frequencies by `factor`,
    # and blends the two linearly in between, by where the wavelength sits relative to the
    # original context.
    wavelength = 2 * math.pi / inv_freq
    original = rope.original_max_position_embeddings
    long_wavelength = original / rope.low_freq_factor
    short_wavelength = original / rope.high_freq_factor
    scaled = torch.where(wavelength > long_wavelength, inv_freq / rope.factor, inv_freq)
    blend = (original / wavelength - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - blend) * scaled / rope.factor + blend * scaled
    in_between = (wavelength >= short_wavelength) & (wavelength <= long_wavelength)
    return torch.where(in_between, blended, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position, built once; applied to the flat token batch."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype, device) -> None:
        inv_freq = inverse_frequencies(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = angles.cos().to(dtype=dtype, device=device)
        self.sin = angles.sin().to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a step's positions: [T, 1, head_dim] each, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] rotated by its tokens' angles."""
        half = x.shape[-1] // 2
        rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated_half * sin
