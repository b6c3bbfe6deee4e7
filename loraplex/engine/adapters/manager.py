"""Adapters on their way disk -> host cache -> pool pages, and back out again.

Two halves with different threads:

* `AdapterCatalog` (any thread, locked): adapter id -> path -> validated host copy, kept in a
  byte-bounded LRU. A sequence holds its adapter's host copy for as long as it lives, so a host
  eviction never strands a request.
* `AdapterManager` (engine thread only): which adapters are resident in the page pool, keyed by
  content hash; how many running sequences use each; which are pinned. Idle, unpinned adapters are
  evicted least recently used first, and only when the pool needs their pages.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from loraplex.engine.adapters.layout import Chunk, plan
from loraplex.engine.adapters.peft_format import (
    MODULES,
    AdapterError,
    LoRAWeights,
    load_peft_adapter,
)
from loraplex.engine.config import ModelConfig
from loraplex.engine.pool import PagePool


@dataclass(frozen=True)
class AdapterRef:
    """What a sequence carries: the adapter's id and its validated host copy."""

    adapter_id: str
    weights: LoRAWeights

    @property
    def content_hash(self) -> str:
        return self.weights.content_hash


class AdapterCatalog:
    def __init__(
        self,
        model: ModelConfig,
        dtype: torch.dtype,
        max_rank: int,
        roots: tuple[str, ...] | None,
        host_cache_bytes: int,
    ) -> None:
        self._model, self._dtype = model, dtype
        self.max_rank, self.roots = max_rank, roots
        self._budget = host_cache_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[str, LoRAWeights]] = OrderedDict()

    def get(self, adapter_id: str, path: str) -> AdapterRef:
        """The adapter, read and validated from `path` unless cached under the same path."""
        with self._lock:
            cached = self._cache.get(adapter_id)
            if cached is not None and cached[0] == str(path):
                self._cache.move_to_end(adapter_id)
                return AdapterRef(adapter_id, cached[1])
        weights = load_peft_adapter(path, self._model, self.max_rank, self._dtype, self.roots)
        with self._lock:
            self._cache[adapter_id] = (str(path), weights)
            self._cache.move_to_end(adapter_id)
            self._shrink()
        return AdapterRef(adapter_id, weights)

    def forget(self, adapter_id: str) -> None:
        with self._lock:
            self._cache.pop(adapter_id, None)

    def _shrink(self) -> None:
        total = sum(w.nbytes for _, w in self._cache.values())
        while total > self._budget and len(self._cache) > 1:
            _, (_, dropped) = self._cache.popitem(last=False)
            total -= dropped.nbytes


@dataclass(eq=False)
class ResidentAdapter:
    """An adapter's weights in pool pages, with views ready for the torch path and row offsets
    ready for the kernels. Holds no host copy: the host cache alone bounds host memory."""

    content_hash: str
    rank: int
    scale: float
    pages: list[int]
    # (layer, module) -> views of the matrix's rows in the pool, in order (one unless split)
    a_chunks: dict[tuple[int, str], list[torch.Tensor]]
    b_chunks: dict[tuple[int, str], list[torch.Tensor]]
    a_offsets: torch.Tensor  # [num_layers, num_modules, rank] flat pool offset of each A row
    b_offsets: torch.Tensor  # [num_layers, num_modules, rank]
    has_module: torch.Tensor  # [num_layers, num_modules] bool
    adapter_ids: set[str] = field(default_factory=set)
    num_users: int = 0  # running sequences
    pinned: bool = False
    last_used: int = 0

    def __post_init__(self) -> None:
        self.targets = frozenset(self.a_chunks)  # the (layer, module) pairs it changes
        # orders adapters of equal shape next to each other in a step's batch
        self.batch_order = (self.rank, hash(self.targets), self.content_hash)

    def a_matrix(self, layer: int, module: str) -> torch.Tensor:
        """[rank, in_features]: a view of the pool unless the matrix was split across pages."""
        return _joined(self.a_chunks[(layer, module)])

    def b_matrix(self, layer: int, module: str) -> torch.Tensor:
        """[rank, out_features]."""
        return _joined(self.b_chunks[(layer, module)])


def _joined(chunks: list[torch.Tensor]) -> torch.Tensor:
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


@dataclass(frozen=True)
class PoolSnapshot:
    num_pages: int
    free_pages: int
    kv_pages: int
    adapter_pages: int
    resident: list[dict]


class AdapterManager:
    """Residency of adapters in the shared page pool. Engine thread only.

    Invariant: `_idle_pages` is the number of pages held by resident adapters that no running
    sequence uses and nobody pinned, i.e. what `free_up` may reclaim.
    """

    def __init__(self, pool: PagePool, model: ModelConfig) -> None:
        self.pool = pool
        self.model = model
        self.resident: dict[str, ResidentAdapter] = {}
        self._pinned_ids: set[str] = set()
        self._idle_pages = 0
        self._pinned_pages: dict[str, int] = {}  # content hash -> pages, of pinned adapters
        self._plans: dict[str, tuple[int, list[list[Chunk]]]] = {}
        self._clock = itertools.count(1)
        self.num_loads = 0
        self.num_evictions = 0

    # -- questions the scheduler asks ------------------------------------------------------

    def pages_to_load(self, ref: AdapterRef | None) -> int:
        if ref is None or ref.content_hash in self.resident:
            return 0
        return self.plan_pages(ref.weights)

    def plan_pages(self, weights: LoRAWeights) -> int:
        """Pages the adapter occupies when resident. Safe from any thread."""
        return self._plan(weights)[0]

    def pinned_pages(self, besides: AdapterRef | None = None) -> int:
        """Pages held by pinned adapters other than `besides`. Safe from any thread."""
        pinned = self._pinned_pages.copy()  # one atomic copy: the engine thread may change it
        if besides is not None:
            pinned.pop(besides.content_hash, None)
        return sum(pinned.values())

    def evictable_pages(self, keep: AdapterRef | None = None) -> int:
        kept = self.resident.get(keep.content_hash) if keep else None
        if kept is not None and self._evictable(kept):
            return self._idle_pages - len(kept.pages)
        return self._idle_pages

    @property
    def num_pages(self) -> int:
        return sum(len(r.pages) for r in self.resident.values())

    # -- changes the scheduler makes -------------------------------------------------------

    def free_up(self, num_pages: int, keep: AdapterRef | None = None) -> None:
        """Evict idle adapters, least recently used first, until `num_pages` pages are free."""
        if self.pool.can_allocate(num_pages):
            return
        keep_hash = keep.content_hash if keep else None
        idle = sorted(
            (r.last_used, h)
            for h, r in self.resident.items()
            if self._evictable(r) and h != keep_hash
        )
        for _, content_hash in idle:
            self._evict(content_hash)
            if self.pool.can_allocate(num_pages):
                return

    def acquire(self, ref: AdapterRef) -> ResidentAdapter:
        """Make `ref` resident (its pages must be free) and count one more user."""
        resident = self.resident.get(ref.content_hash) or self._load(ref.weights)
        resident.adapter_ids.add(ref.adapter_id)
        self._change(resident, users=+1)
        return resident

    def release(self, ref: AdapterRef) -> None:
        resident = self.resident[ref.content_hash]
        self._change(resident, users=-1)
        if not resident.adapter_ids and self._evictable(resident):
            self._evict(ref.content_hash)  # unloaded while it was in use

    # -- operator actions ------------------------------------------------------------------

    def preload(self, ref: AdapterRef) -> None:
        """Bring `ref` into the pool if its pages are free right now (evicting nothing)."""
        if ref.content_hash not in self.resident:
            if not self.pool.can_allocate(self.pages_to_load(ref)):
                return
            self._load(ref.weights)
        self.resident[ref.content_hash].adapter_ids.add(ref.adapter_id)

    def pin(self, ref: AdapterRef) -> None:
        """Keep `ref` resident until unpinned; loads it now (evicting idle adapters if needed)."""
        needed = self.pages_to_load(ref)
        if needed:
            self.free_up(needed, keep=ref)
            if not self.pool.can_allocate(needed):
                raise AdapterError(
                    f"adapter {ref.adapter_id} needs {needed} pages to pin; "
                    f"{self.pool.num_free} are free"
                )
            self._load(ref.weights)
        resident = self.resident[ref.content_hash]
        resident.adapter_ids.add(ref.adapter_id)
        self._pinned_ids.add(ref.adapter_id)
        self._change(resident, pinned=True)

    def unpin(self, adapter_id: str) -> None:
        self._pinned_ids.discard(adapter_id)
        for resident in self.resident.values():
            if adapter_id in resident.adapter_ids:
                self._change(resident, pinned=bool(resident.adapter_ids & self._pinned_ids))

    def unload(self, adapter_id: str) -> None:
        """Forget `adapter_id`; its pages go as soon as no running sequence uses them."""
        self.unpin(adapter_id)
        for content_hash, resident in list(self.resident.items()):
            resident.adapter_ids.discard(adapter_id)
            if not resident.adapter_ids and self._evictable(resident):
                self._evict(content_hash)

    def snapshot(self, kv_pages: int) -> PoolSnapshot:
        return PoolSnapshot(
            num_pages=self.pool.num_pages,
            free_pages=self.pool.num_free,
            kv_pages=kv_pages,
            adapter_pages=self.num_pages,
            resident=[
                {
                    "adapter_ids": sorted(r.adapter_ids),
                    "content_hash": h,
                    "rank": r.rank,
                    "pages": len(r.pages),
                    "pinned": r.pinned,
                    "running_requests": r.num_users,
                }
                for h, r in self.resident.items()
            ],
        )

    # -- internals -------------------------------------------------------------------------

    @staticmethod
    def _evictable(resident: ResidentAdapter) -> bool:
        return resident.num_users == 0 and not resident.pinned

    def _change(self, resident: ResidentAdapter, users: int = 0, pinned: bool | None = None):
        was_idle = self._evictable(resident)
        resident.num_users += users
        if pinned is not None:
            resident.pinned = pinned
            if pinned:
                self._pinned_pages[resident.content_hash] = len(resident.pages)
            else:
                self._pinned_pages.pop(resident.content_hash, None)
        resident.last_used = next(self._clock)
        self._idle_pages += (self._evictable(resident) - was_idle) * len(resident.pages)

    def _evict(self, content_hash: str) -> None:
        resident = self.resident.pop(content_hash)
        self._idle_pages -= len(resident.pages) if self._evictable(resident) else 0
        self.pool.free(resident.pages)
        self.num_evictions += 1

    def _matrices(self, weights: LoRAWeights) -> list[tuple[str, tuple[int, str], torch.Tensor]]:
        return [
            (kind, key, table[key])
            for key in sorted(weights.a)
            for kind, table in (("a", weights.a), ("b", weights.b))
        ]

    def _plan(self, weights: LoRAWeights):
        cached = self._plans.get(weights.content_hash)
        if cached is None:
            if len(self._plans) > 4096:
                self._plans.clear()
            shapes = [tuple(t.shape) for _, _, t in self._matrices(weights)]
            cached = self._plans[weights.content_hash] = plan(shapes, self.pool.page_numel)
        return cached

    def _load(self, weights: LoRAWeights) -> ResidentAdapter:
        num_pages, placements = self._plan(weights)
        pages = self.pool.allocate(num_pages)
        flat = self.pool.data.view(-1)
        chunks: dict[str, dict] = {"a": {}, "b": {}}
        offsets = {
            "a": torch.zeros(self.model.num_layers, len(MODULES), weights.rank, dtype=torch.long),
            "b": torch.zeros(self.model.num_layers, len(MODULES), weights.rank, dtype=torch.long),
        }
        has_module = torch.zeros(self.model.num_layers, len(MODULES), dtype=torch.bool)
        for (kind, key, tensor), placement in zip(self._matrices(weights), placements, strict=True):
            views = [self._place(flat, pages, chunk, tensor) for chunk in placement]
            chunks[kind][key] = views
            layer, module_index = key[0], MODULES.index(key[1])
            offsets[kind][layer, module_index] = _row_offsets(
                pages, placement, tensor, self.pool.page_numel
            )
            has_module[layer, module_index] = True
        resident = ResidentAdapter(
            content_hash=weights.content_hash,
            rank=weights.rank,
            scale=weights.scale,
            pages=pages,
            a_chunks=chunks["a"],
            b_chunks=chunks["b"],
            a_offsets=offsets["a"],
            b_offsets=offsets["b"],
            has_module=has_module,
        )
        self.resident[weights.content_hash] = resident
        self._idle_pages += len(pages)  # resident, no user yet
        self.num_loads += 1
        return resident

    def _place(
        self, flat: torch.Tensor, pages: list[int], chunk: Chunk, tensor: torch.Tensor
    ) -> torch.Tensor:
        """Copy the chunk's rows of `tensor` into their pages; -> the view of them there."""
        width = tensor.shape[1]
        start = pages[chunk.page] * self.pool.page_numel + chunk.offset
        view = flat[start : start + chunk.num_rows * width].view(chunk.num_rows, width)
        view.copy_(tensor[chunk.first_row : chunk.first_row + chunk.num_rows])
        return view


def _row_offsets(
    pages: list[int], placement: list[Chunk], tensor: torch.Tensor, page_numel: int
) -> torch.Tensor:
    width = tensor.shape[1]
    rows = [
        pages[c.page] * page_numel + c.offset + i * width
        for c in placement
        for i in range(c.num_rows)
    ]
    return torch.tensor(rows, dtype=torch.long)
