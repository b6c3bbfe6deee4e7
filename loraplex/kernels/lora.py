"""Batched LoRA over a flat token batch: shrink (h -> r) and expand (r -> h, accumulate).

The contract, shared by the Triton kernels and the torch reference:

    x      [num_tokens, in_features]        the layer input (float32 or bfloat16)
    pool   [pool_numel]                     the page pool, flat; adapter rows live in it
    tokens are grouped by adapter into segments (built once per step):
      seg_starts, seg_lens, seg_slots [num_segments]   a segment is rows start..start+len of one
                                                       adapter slot; rows in no segment are base
    per adapter slot (for one layer and module):
      a_offsets [num_slots, max_rank] int64   pool offset of each lora_A row (in_features long)
      b_offsets [num_slots, max_rank] int64   pool offset of each lora_B^T row (out_features long)
      ranks     [num_slots] int32             0 = this adapter leaves the module alone
      scales    [num_slots] float32

    shrink:  v[t, :rank]  = x[t] @ A_slot^T                    v: [num_tokens, max_rank] float32
    expand:  y[t]        += scale_slot * v[t, :rank] @ B_slot   y: [num_tokens, out_features]

Rows of one adapter need not be contiguous: every row is addressed through its offset, so the
pages an adapter occupies can be anywhere in the pool. Mixed ranks share one launch. Arithmetic is
float32 whatever the storage dtype (the Triton interpreter also needs it: bfloat16 arithmetic there
gives NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Segments:
    starts: torch.Tensor  # [num_segments] int32
    lens: torch.Tensor  # [num_segments] int32
    slots: torch.Tensor  # [num_segments] int32
    max_len: int

    @classmethod
    def from_lists(cls, segments: list[tuple[int, int, int]], device) -> Segments:
        """segments: (start, length, slot) triples."""
        columns = torch.tensor(segments, dtype=torch.int32, device=device).reshape(-1, 3)
        return cls(
            columns[:, 0].contiguous(),
            columns[:, 1].contiguous(),
            columns[:, 2].contiguous(),
            max((s[1] for s in segments), default=0),
        )


# -- torch reference ------------------------------------------------------------------------


def _rows(pool: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """[n] row offsets -> [n, width] rows gathered from the flat pool."""
    return pool[offsets[:, None] + torch.arange(width, device=pool.device)]


def lora_shrink_reference(x, pool, a_offsets, ranks, segments: Segments) -> torch.Tensor:
    v = torch.zeros(x.shape[0], a_offsets.shape[1], dtype=torch.float32, device=x.device)
    for start, length, slot in zip(
        segments.starts.tolist(), segments.lens.tolist(), segments.slots.tolist(), strict=True
    ):
        rank = int(ranks[slot])
        if rank == 0 or length == 0:
            continue
        a = _rows(pool, a_offsets[slot, :rank], x.shape[1]).float()  # [rank, in]
        v[start : start + length, :rank] = x[start : start + length].float() @ a.T
    return v


def lora_expand_reference(y, v, pool, b_offsets, ranks, scales, segments: Segments) -> None:
    for start, length, slot in zip(
        segments.starts.tolist(), segments.lens.tolist(), segments.slots.tolist(), strict=True
    ):
        rank = int(ranks[slot])
        if rank == 0 or length == 0:
            continue
        b = _rows(pool, b_offsets[slot, :rank], y.shape[1]).float()  # [rank, out]
        delta = float(scales[slot]) * (v[start : start + length, :rank] @ b)
        y[start : start + length] = (y[start : start + length].float() + delta).to(y.dtype)


# -- Triton ---------------------------------------------------------------------------------


@triton.jit
def _segment(seg_start_ptr, seg_len_ptr, seg_slot_ptr, ranks_ptr):
    """This program's segment (grid axis 0): first row, length, adapter slot, rank."""
    segment = tl.program_id(0)
    slot = tl.load(seg_slot_ptr + segment)
    return (
        tl.load(seg_start_ptr + segment),
        tl.load(seg_len_ptr + segment),
        slot,
        tl.load(ranks_ptr + slot),
    )


@triton.jit
def _shrink_kernel(
    x_ptr,
    pool_ptr,
    a_off_ptr,
    ranks_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    v_ptr,
    in_features,
    max_rank,
    stride_x,
    stride_v,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    start, length, slot, rank = _segment(seg_start_ptr, seg_len_ptr, seg_slot_ptr, ranks_ptr)
    m_block, r_block = tl.program_id(1), tl.program_id(2)
    if m_block * BLOCK_M >= length or r_block * BLOCK_R >= rank:
        return
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    cols = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    col_ok = cols < rank
    a_rows = tl.load(a_off_ptr + slot * max_rank + cols, mask=col_ok, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, in_features, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        k_ok = ks < in_features
        x_tile = tl.load(
            x_ptr + (start + rows)[:, None] * stride_x + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        a_tile = tl.load(
            pool_ptr + a_rows[None, :] + ks[:, None],  # [BLOCK_K, BLOCK_R]
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(x_tile, a_tile, input_precision="ieee")
    tl.store(
        v_ptr + (start + rows)[:, None] * stride_v + cols[None, :],
        acc,
        mask=row_ok[:, None] & col_ok[None, :],
    )


@triton.jit
def _expand_kernel(
    y_ptr,
    v_ptr,
    pool_ptr,
    b_off_ptr,
    ranks_ptr,
    scales_ptr,
    seg_start_ptr,
    seg_len_ptr,
    seg_slot_ptr,
    out_features,
    max_rank,
    stride_y,
    stride_v,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    start, length, slot, rank = _segment(seg_start_ptr, seg_len_ptr, seg_slot_ptr, ranks_ptr)
    m_block, n_block = tl.program_id(1), tl.program_id(2)
    if m_block * BLOCK_M >= length or rank == 0:
        return
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < out_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):
        rs = r + tl.arange(0, BLOCK_R)
        r_ok = rs < rank
        v_tile = tl.load(
            v_ptr + (start + rows)[:, None] * stride_v + rs[None, :],
            mask=row_ok[:, None] & r_ok[None, :],
            other=0.0,
        )
        b_rows = tl.load(b_off_ptr + slot * max_rank + rs, mask=r_ok, other=0)
        b_tile = tl.load(
            pool_ptr + b_rows[:, None] + cols[None, :],  # [BLOCK_R, BLOCK_N]
            mask=r_ok[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(v_tile, b_tile, input_precision="ieee")
    scale = tl.load(scales_ptr + slot)
    y_ptrs = y_ptr + (start + rows)[:, None] * stride_y + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    y_tile = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y_tile + scale * acc).to(y_ptr.dtype.element_ty), mask=mask)


_BLOCK_M, _BLOCK_R, _BLOCK_K, _BLOCK_N = 16, 16, 32, 32


def lora_shrink_triton(x, pool, a_offsets, ranks, segments: Segments) -> torch.Tensor:
    num_tokens, in_features = x.shape  # x: [num_tokens, in_features], rows contiguous
    num_slots, max_rank = a_offsets.shape  # [num_slots, max_rank]
    assert x.stride(1) == 1 and pool.dim() == 1 and ranks.shape == (num_slots,)
    v = torch.zeros(num_tokens, max_rank, dtype=torch.float32, device=x.device)
    if segments.max_len == 0 or max_rank == 0:
        return v
    grid = (
        segments.starts.shape[0],
        triton.cdiv(segments.max_len, _BLOCK_M),
        triton.cdiv(max_rank, _BLOCK_R),
    )
    _shrink_kernel[grid](
        x,
        pool,
        a_offsets.contiguous(),
        ranks,
        segments.starts,
        segments.lens,
        segments.slots,
        v,
        in_features,
        max_rank,
        x.stride(0),
        v.stride(0),
        BLOCK_M=_BLOCK_M,
        BLOCK_R=_BLOCK_R,
        BLOCK_K=_BLOCK_K,
    )
    return v


def lora_expand_triton(y, v, pool, b_offsets, ranks, scales, segments: Segments) -> None:
    num_tokens, out_features = y.shape  # y: [num_tokens, out_features], may be a column slice
    num_slots, max_rank = b_offsets.shape
    assert y.stride(1) == 1 and v.shape == (num_tokens, max_rank) and v.dtype == torch.float32
    assert ranks.shape == (num_slots,) and scales.shape == (num_slots,)
    if segments.max_len == 0 or max_rank == 0:
        return
    grid = (
        segments.starts.shape[0],
        triton.cdiv(segments.max_len, _BLOCK_M),
        triton.cdiv(out_features, _BLOCK_N),
    )
    _expand_kernel[grid](
        y,
        v,
        pool,
        b_offsets.contiguous(),
        ranks,
        scales,
        segments.starts,
        segments.lens,
        segments.slots,
        out_features,
        max_rank,
        y.stride(0),
        v.stride(0),
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_R=_BLOCK_R,
    )
