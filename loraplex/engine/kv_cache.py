"""Paged KV cache: block tables per sequence, pages taken from the shared pool.

A KV page holds `page_size` consecutive tokens of one sequence for every layer:

    page: [num_layers, page_size, 2 (k, v), num_kv_heads, head_dim]

so one block table (a list of page ids) serves all layers, and a token at position p of a
sequence lives in page `block_table[p // page_size]` at slot `p % page_size`. Keys and values of a
slot sit side by side so that one gather per layer fetches both, and the gathered pages of a
sequence flatten into its token axis without a copy.
"""

from __future__ import annotations

import torch

from loraplex.engine.config import ModelConfig
from loraplex.engine.pool import PagePool


def kv_page_numel(model: ModelConfig, page_size: int) -> int:
    return model.num_layers * page_size * 2 * model.num_kv_heads * model.head_dim


class KVCacheManager:
    """Grows and frees the block tables of sequences. Knows nothing about scheduling."""

    def __init__(self, pool: PagePool, model: ModelConfig, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        # [num_pages, num_layers, page_size, 2, num_kv_heads, head_dim], a view of the pool
        self.pages = pool.data.view(
            pool.num_pages, model.num_layers, page_size, 2, model.num_kv_heads, model.head_dim
        )

    def layer_cache(self, layer: int) -> torch.Tensor:
        """[num_pages, page_size, 2, num_kv_heads, head_dim] view of one layer."""
        return self.pages[:, layer]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def num_missing_pages(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, self.pages_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.pool.can_allocate(self.num_missing_pages(block_table, num_tokens))

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend `block_table` in place so it covers `num_tokens` tokens."""
        block_table.extend(self.pool.allocate(self.num_missing_pages(block_table, num_tokens)))

    def release(self, block_table: list[int]) -> None:
        self.pool.free(block_table)
        block_table.clear()
