"""Attention over the paged KV cache, in torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraplex.engine.forward_batch import ForwardBatch, PrefillSpan
from loraplex.engine.workspace import Workspace


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
    """Store this step's keys/values [num_tokens, num_kv_heads, head_dim] in their slots of
    kv_cache [num_pages, page_size, 2, num_kv_heads, head_dim]."""
    kv_cache[batch.slot_pages, batch.slot_offsets] = torch.stack((k, v), dim=1)


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].

    kv_cache already holds this step's keys and values.
    """
    rows = batch.num_row_queries
    if rows == q.shape[0] and not batch.prefills:  # a decode step: nothing to put together
        return _row_queries(q, kv_cache, batch, scale)
    out = torch.empty_like(q)
    if rows:
        out[:rows] = _row_queries(q[:rows], kv_cache, batch, scale)
    for span in batch.prefills:
        out[span.start : span.end] = _prefill(
            q[span.start : span.end], kv_cache, span, scale, batch.workspace
        )
    return out


def _gather(
    kv_cache: torch.Tensor, block_tables: torch.Tensor, workspace: Workspace
) -> torch.Tensor:
    """[..., num_pages] page ids -> [..., num_pages * page_size, 2, num_kv_heads, head_dim]."""
    flat = block_tables.flatten()
    out = workspace.take("kv_gather", (flat.shape[0], *kv_cache.shape[1:]), kv_cache.dtype)
    torch.index_select(kv_cache, 0, flat, out=out)
    return out.view(*block_tables.shape[:-1], -1, *kv_cache.shape[2:])


def _row_queries(
    q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """One query row per token, each over its own context (ForwardBatch.num_row_queries)."""
    if batch.attention_kernel is not None:
        return batch.attention_kernel.decode(
            q, kv_cache, batch.row_block_tables, batch.row_lens, scale
        )
    kv = _gather(
        kv_cache, batch.row_block_tables, batch.workspace
    )  # [B, ctx, 2, kv_heads, head_dim]
    dtype = q.dtype
    compute = batch.row_mask.dtype  # device.decode_attention_dtype
    q, kv = q.to(compute), kv.to(compute)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, heads, 1, head_dim]
        kv[:, :, 0].transpose(1, 2),  # [B, kv_heads, ctx, head_dim]
        kv[:, :, 1].transpose(1, 2),
        attn_mask=batch.row_mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2).to(dtype)


def _prefill(
    q: torch.Tensor, kv_cache: torch.Tensor, span: PrefillSpan, scale: float, workspace: Workspace
) -> torch.Tensor:
    kv = _gather(kv_cache, span.pages, workspace)[
        : span.context_len
    ]  # [ctx, 2, kv_heads, head_dim]
    k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # [kv_heads, ctx, head_dim]
    group = q.shape[1] // k.shape[0]
    if group > 1 and q.dtype != torch.float32:
        # each kv head repeated for its query heads: torch's CPU attention takes grouped heads
        # (enable_gqa) only in its reference kernel, which its fused kernel beats 1.7x in
        # bfloat16 even with the copy (Zen 4, 9 heads over 3, 64-256 tokens); the whole prefill
        # of 32 prompts of 64 tokens 1.09x faster, alternated in one process. float32 keeps the
        # reference kernel (1.04x there), with which it is token-identical to transformers.
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, heads, q_len, head_dim]
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=span.mask,
        is_causal=span.mask is None,
        scale=scale,
        enable_gqa=k.shape[0] != q.shape[1],
    )
    return out[0].transpose(0, 1)
