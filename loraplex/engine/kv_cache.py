"""Paged KV cache: block tables per sequence, pages taken from the shared pool.

A KV page holds `page_size` consecutive tokens of one sequence for every layer:

    page: [num_layers, page_size, 2 (k, v), num_kv_heads, head_dim]

so one block table (a list of page ids) serves all layers, and a token at position p of a
sequence lives in page `block_table[p // page_size]` at slot `p % page_size`. Keys and values of a
slot sit side by side so that one gather per layer fetches both, and the gathered pages of a
sequence flatten into its token axis without a copy.

Prefix caching: a full page of a sequence is named by a key chained over everything that
determines its KV: the key of the page before it, the adapter's content hash (never its name:
the same tokens under two adapters never share KV, and re-registered weights never meet their
old KV) and the page's tokens. A finished or preempted sequence's named pages stay in the pool,
idle, least recently used first; a new sequence whose leading full pages have known keys starts
on those pages with their tokens already computed. Idle pages are given back to the pool whenever
an allocation needs them: before any idle adapter is evicted, before any sequence is preempted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from loraplex.engine.config import ModelConfig
from loraplex.engine.pool import PagePool
from loraplex.engine.sequence import Sequence


def kv_page_numel(model: ModelConfig, page_size: int) -> int:
    return model.num_layers * page_size * 2 * model.num_kv_heads * model.head_dim


class KVCacheManager:
    """Grows and frees the block tables of sequences, and keeps the prefix cache. Knows nothing
    about scheduling."""

    def __init__(
        self, pool: PagePool, model: ModelConfig, page_size: int, prefix_caching: bool = True
    ) -> None:
        self.pool = pool
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        # [num_pages, num_layers, page_size, 2, num_kv_heads, head_dim], a view of the pool
        self.pages = pool.data.view(
            pool.num_pages, model.num_layers, page_size, 2, model.num_kv_heads, model.head_dim
        )
        # each layer's view, made once rather than at every layer of every step
        self._layers = [self.pages[:, layer] for layer in range(model.num_layers)]
        self._page_of: dict[bytes, int] = {}  # key -> the page holding that block's KV
        self._key_of: dict[int, bytes] = {}  # the reverse, for named pages only
        self._users: dict[int, int] = {}  # named page -> sequences whose tables hold it
        self._idle: OrderedDict[int, None] = OrderedDict()  # named pages nobody uses, LRU first
        self.num_hit_tokens = 0  # prompt tokens served from the cache, since start
        pool.set_reclaimer(lambda: len(self._idle), self._evict)

    def layer_cache(self, layer: int) -> torch.Tensor:
        """[num_pages, page_size, 2, num_kv_heads, head_dim] view of one layer."""
        return self._layers[layer]

    @property
    def num_cached_pages(self) -> int:
        """Named pages no sequence uses: KV kept for later prefixes, given back on demand."""
        return len(self._idle)

    @property
    def cached_page_ids(self) -> set[int]:
        return set(self._idle)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def num_missing_pages(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, self.pages_for(num_tokens) - len(block_table))

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.pool.can_allocate(self.num_missing_pages(block_table, num_tokens))

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend `block_table` in place so it covers `num_tokens` tokens."""
        block_table.extend(self.pool.allocate(self.num_missing_pages(block_table, num_tokens)))

    def release(self, seq: Sequence) -> None:
        """Give back the pages of `seq`: named ones go idle (kept), the rest to the pool."""
        unnamed = []
        for page in seq.block_table:
            if page in self._key_of:
                self._users[page] -= 1
                if not self._users[page]:
                    self._idle[page] = None
            else:
                unnamed.append(page)
        self.pool.free(unnamed)
        seq.block_table.clear()
        seq.block_keys.clear()

    # -- the prefix cache ------------------------------------------------------------------

    def attach(self, seq: Sequence) -> int:
        """Start a sequence that has no pages yet on the cached pages of its longest known
        prefix (leaving at least one token to compute); -> tokens served from the cache."""
        if seq.block_table or not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return 0  # (prompt log-probabilities need every prompt position computed)
        for key in self._keys(seq, (seq.num_tokens - 1) // self.page_size):
            page = self._page_of.get(key)
            if page is None:
                break
            if not self._users.get(page):
                del self._idle[page]
            self._users[page] = self._users.get(page, 0) + 1
            seq.block_table.append(page)
            seq.block_keys.append(key)
        seq.num_computed_tokens = len(seq.block_table) * self.page_size
        return seq.num_computed_tokens

    def detach(self, seq: Sequence) -> None:
        """Undo `attach` (the sequence could not start after all)."""
        self.release(seq)
        seq.num_computed_tokens = 0

    def name_full_pages(self, seq: Sequence) -> None:
        """Name the pages `seq` has filled (computed every token of) since last time."""
        if not self.prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.page_size, len(seq.block_table))
        if full <= len(seq.block_keys):
            return
        for index, key in enumerate(
            self._keys(seq, full)[len(seq.block_keys) :], len(seq.block_keys)
        ):
            seq.block_keys.append(key)
            page = seq.block_table[index]
            if key in self._page_of or page in self._key_of:
                continue  # computed twice at once: the first copy stays the named one
            self._page_of[key], self._key_of[page], self._users[page] = page, key, 1

    def _keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The keys of the first `num_blocks` full pages of `seq` (known ones reused)."""
        keys = seq.block_keys[:num_blocks]
        salt = seq.adapter.content_hash.encode() if seq.adapter is not None else b""
        previous = keys[-1] if keys else b""
        size = self.page_size
        for block in range(len(keys), num_blocks):
            tokens = array("q", seq.token_ids[block * size : (block + 1) * size]).tobytes()
            previous = hashlib.blake2b(previous + salt + tokens, digest_size=16).digest()
            keys.append(previous)
        return keys

    def _evict(self, num_pages: int) -> None:
        """Give `num_pages` idle named pages (or all there are) back to the pool, LRU first."""
        pages = []
        while self._idle and len(pages) < num_pages:
            page, _ = self._idle.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            del self._users[page]
            pages.append(page)
        self.pool.free(pages)
