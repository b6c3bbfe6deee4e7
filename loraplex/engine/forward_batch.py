"""Per-step metadata: built once from the scheduled sequences, read by every layer.

The step's tokens are flattened into one unpadded batch, decode tokens first:

    tokens:  d0 d1 d2 | p0 p0 p0 p0 | p1 p1 p1
             decodes    prefill span 0  prefill span 1   (a span is one sequence's chunk)

Decodes (one query token each) run attention together: on CPU in the native kernel, which reads
each sequence's keys and values in place from its pages, elsewhere over their gathered pages with
a mask; each prefill span runs causal attention over its sequence's pages, or, where the kernel
takes prefill too (bfloat16 on CPU), every token of the span is one more row of the kernel, which
sees its sequence's pages up to the token's own position. Decodes are ordered base model first,
then by adapter, so that each adapter's tokens are contiguous for batched LoRA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.engine.adapters.lora_batch import KernelLoRA, TorchLoRA, build_lora_batch
from loraplex.engine.device import decode_attention_dtype
from loraplex.engine.scheduler import Scheduled
from loraplex.engine.sequence import Sequence
from loraplex.engine.workspace import Workspace
from loraplex.kernels.cpu_lora import CpuAttentionKernel


@dataclass(frozen=True)
class PrefillSpan:
    start: int  # first row of the span in the flat batch
    end: int
    pages: torch.Tensor  # [num_pages] the sequence's block table up to its context
    context_len: int  # tokens visible to the last query of the span (cached + this chunk)
    mask: torch.Tensor | None  # [q_len, context_len] bool, None when plain causal


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    slot_pages: torch.Tensor  # [num_tokens] page receiving each token's K/V
    slot_offsets: torch.Tensor  # [num_tokens] row inside that page
    num_decodes: int
    # the first rows, each attending on its own over its sequence's pages: the decodes, and
    # every prefill token where the native kernel takes prefill
    num_row_queries: int
    row_block_tables: torch.Tensor | None  # [num_row_queries, max_pages]
    # [num_row_queries, 1, 1, max_pages * page_size] additive, in the dtype decode attention
    # computes in; None with the native kernel, which takes each row's context length instead
    row_mask: torch.Tensor | None
    row_lens: torch.Tensor | None  # [num_row_queries] int64, with the native kernel
    attention_kernel: CpuAttentionKernel | None
    prefills: list[PrefillSpan]  # the spans the rows above do not cover
    # rows whose logits are needed: the sampled ones, then those of `prompt_targets`
    logits_indices: torch.Tensor
    lora: TorchLoRA | KernelLoRA | None  # None when no token uses an adapter
    workspace: Workspace
    # (sequence, the prompt token that follows the row) for prompt log-probabilities, in row
    # order after the sampled rows
    prompt_targets: list[tuple[Sequence, int]]


def _batch_order(item: Scheduled):
    adapter = item.adapter
    return item.num_new != 1, adapter is not None, adapter.batch_order if adapter else ()


@dataclass(frozen=True)
class BatchSettings:
    """What building a step's batch needs from the engine; fixed for the engine's life."""

    page_size: int
    dtype: torch.dtype
    device: str
    lora_backend: str
    pool: torch.Tensor  # [num_pages, page_numel]
    workspace: Workspace
    attention_kernel: CpuAttentionKernel | None = None  # row attention in place (CPU)
    prefill_in_kernel: bool = False  # prefill tokens too, as rows of the kernel


def build_forward_batch(
    scheduled: list[Scheduled], settings: BatchSettings
) -> tuple[ForwardBatch, list[Sequence]]:
    """Flatten the scheduled sequences' new tokens; also return, in row order of
    `logits_indices`, the sequences that sample a token this step."""
    page_size, device = settings.page_size, settings.device
    ordered = sorted(scheduled, key=_batch_order)
    token_adapters = [item.adapter for item in ordered for _ in range(item.num_new)]
    input_ids, positions, slot_pages, slot_offsets = [], [], [], []
    logits_indices, sampling = [], []
    prompt_rows, prompt_targets = [], []
    rows, prefills = [], []  # rows: (sequence, context of its first row, number of rows)
    kernel = settings.attention_kernel
    prefill_rows = kernel is not None and settings.prefill_in_kernel
    for item in ordered:
        seq, num_new = item.seq, item.num_new
        start = len(input_ids)
        first = seq.num_computed_tokens
        span = range(first, first + num_new)
        input_ids.extend(seq.token_ids[first : first + num_new])
        positions.extend(span)
        slot_pages.extend(seq.block_table[p // page_size] for p in span)
        slot_offsets.extend(p % page_size for p in span)
        if num_new == 1 or prefill_rows:
            rows.append((seq, first + 1, num_new))
        else:
            prefills.append(_prefill_span(seq, start, num_new, page_size, device))
        if first + num_new == seq.num_tokens:
            logits_indices.append(len(input_ids) - 1)
            sampling.append(seq)
        if seq.params.prompt_logprobs is not None and seq.index == 0:
            for row, position in enumerate(span, start):
                target = position + 1  # a prompt token not scored yet (the last one samples)
                if len(seq.prompt_logprobs) < target < seq.num_prompt_tokens:
                    prompt_rows.append(row)
                    prompt_targets.append((seq, seq.token_ids[target]))
    tables, mask, lens = _row_tables(rows, page_size, settings.dtype, device, kernel)
    num_decodes = sum(1 for item in ordered if item.num_new == 1)
    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_pages=torch.tensor(slot_pages, dtype=torch.long, device=device),
        slot_offsets=torch.tensor(slot_offsets, dtype=torch.long, device=device),
        num_decodes=num_decodes,
        num_row_queries=sum(count for _, _, count in rows),
        row_block_tables=tables,
        row_mask=mask,
        row_lens=lens,
        attention_kernel=kernel,
        prefills=prefills,
        logits_indices=torch.tensor(logits_indices + prompt_rows, dtype=torch.long, device=device),
        lora=build_lora_batch(
            settings.lora_backend, token_adapters, num_decodes, settings.pool, settings.workspace
        ),
        workspace=settings.workspace,
        prompt_targets=prompt_targets,
    )
    return batch, sampling


def _prefill_span(seq: Sequence, start: int, num_new: int, page_size: int, device: str):
    context_len = seq.num_computed_tokens + num_new
    num_pages = -(-context_len // page_size)
    mask = None
    if seq.num_computed_tokens:
        # query i sits at position num_computed + i and sees keys 0 ..= that position
        query_pos = torch.arange(seq.num_computed_tokens, context_len, device=device)
        mask = torch.arange(context_len, device=device)[None, :] <= query_pos[:, None]
    return PrefillSpan(
        start=start,
        end=start + num_new,
        pages=torch.tensor(seq.block_table[:num_pages], dtype=torch.long, device=device),
        context_len=context_len,
        mask=mask,
    )


def _row_tables(
    rows: list[tuple[Sequence, int, int]], page_size: int, dtype: torch.dtype, device: str, kernel
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(block tables, additive mask, context lengths) of the row queries: `count` rows of each
    (sequence, context of its first row, count), each seeing one more token than the row before;
    the lengths for the native kernel, else the mask."""
    if not rows:
        return None, None, None
    max_pages = -(-max(first + count - 1 for _, first, count in rows) // page_size)
    # Pad short tables with the sequence's own last page: those columns are masked out below,
    # and a sequence never reads another's memory, whatever that holds.
    padded = [
        seq.block_table[:max_pages] + seq.block_table[-1:] * (max_pages - len(seq.block_table))
        for seq, _, _ in rows
    ]
    tables = torch.tensor(padded, dtype=torch.long, device=device)
    if any(count > 1 for _, _, count in rows):  # a prefill span: a row per token
        counts = torch.tensor([count for _, _, count in rows], device=device)
        tables = tables.repeat_interleave(counts, dim=0)
    lens = torch.tensor(
        [length for _, first, count in rows for length in range(first, first + count)],
        dtype=torch.long,
        device=device,
    )
    if kernel is not None:
        return tables, None, lens
    visible = torch.arange(max_pages * page_size, device=device)[None, :] < lens[:, None]
    mask = torch.zeros(visible.shape, dtype=decode_attention_dtype(dtype, device), device=device)
    mask.masked_fill_(~visible, float("-inf"))
    return tables, mask[:, None, None, :], None
