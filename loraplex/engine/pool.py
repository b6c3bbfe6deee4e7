"""One preallocated pool of fixed-size pages shared by everything that needs device memory.

    data: [num_pages, page_numel]   (one tensor, allocated once)
           page 0 | page 1 | page 2 | ...
            KV      adapter  KV       <- the pool never knows which

Owners (the KV cache manager, the adapter manager) ask for page ids and give them back; each
views the rows it owns in its own layout. One owner may keep pages it no longer needs as a cache
(the KV cache keeps prefix blocks): it registers a reclaimer, and the pool takes such pages back
from it whenever an allocation would otherwise fail, before anyone is told there is no room.

The pool counts, and wipes what comes back: a page is handed out holding zeros, so what an owner
left in it (say, the NaN keys of a request that failed) can never reach the next owner, even
through slots the next owner only masks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loraplex.engine.device import zeros_in_huge_pages


class PagePool:
    """Free-list allocator over `num_pages` pages of `page_numel` elements each.

    Invariants: every page id in [0, num_pages) is either in the free list or held by exactly
    one owner; `num_free + num_used == num_pages` at all times; a free page holds only zeros.
    """

    def __init__(self, num_pages: int, page_numel: int, dtype: torch.dtype, device: str) -> None:
        if num_pages < 1:
            raise ValueError(f"the page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_numel = page_numel
        self.data = zeros_in_huge_pages((num_pages, page_numel), dtype, device)
        # Pop from the end: low page ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._reclaimable: Callable[[], int] = lambda: 0
        self._reclaim: Callable[[int], None] = lambda num_pages: None

    def set_reclaimer(self, reclaimable: Callable[[], int], reclaim: Callable[[int], None]):
        """`reclaimable()`: pages an owner holds only as a cache; `reclaim(n)`: free n of them."""
        self._reclaimable, self._reclaim = reclaimable, reclaim

    @property
    def page_bytes(self) -> int:
        return self.page_numel * self.data.element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def num_available(self) -> int:
        """Free pages, plus those a cache gives back on demand."""
        return len(self._free) + self._reclaimable()

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_available

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            self._reclaim(num_pages - len(self._free))
        if num_pages > len(self._free):
            raise MemoryError(f"asked for {num_pages} pages, {len(self._free)} free")
        taken = self._free[len(self._free) - num_pages :]
        del self._free[len(self._free) - num_pages :]
        return taken[::-1]

    def free(self, pages: list[int]) -> None:
        if pages:
            # one write per page, proportional to what was used: far cheaper than masking every
            # stale slot on every read (benchmarks/page_scrub_cost.py measures it)
            self.data.index_fill_(0, torch.tensor(pages, device=self.data.device), 0)
        self._free.extend(reversed(pages))
