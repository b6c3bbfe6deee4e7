"""Which adapters are resident in the page pool, who uses them, and which are pinned. Engine
thread only (but for `pinned_pages`, `plan_pages` and `pack`, which any thread may call).

An adapter is resident once, keyed by its content hash, whatever ids name it. Idle adapters (no
running user, not pinned) stay resident as a cache and are evicted least recently used first,
only when the pool needs their pages.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from loraplex.engine.adapters.catalog import AdapterRef
from loraplex.engine.adapters.layout import (
    Chunk,
    Matrix,
    PackedAdapter,
    PageLayout,
    chunk_rows,
    layout_for,
    pack,
)
from loraplex.engine.adapters.peft_format import MODULES, LoRAWeights
from loraplex.engine.config import ModelConfig
from loraplex.engine.errors import AdapterError, ErrorCode
from loraplex.engine.pool import PagePool

# one object per distinct set of (layer, module) targets, shared by the adapters that have it:
# the LoRA path looks its per-layer call plans up by targets every layer of every step, and an
# identical key is found without comparing two sets of a few hundred pairs. Bounded: tenants'
# adapters may each target other layers, and a miss only costs that comparison
_TARGET_SETS: dict[frozenset[tuple[int, str]], frozenset[tuple[int, str]]] = {}
_MAX_TARGET_SETS = 1024


def changed_modules(targets: frozenset[tuple[int, str]]) -> tuple[str, ...]:
    """The modules an adapter with these (layer, module) targets changes in some layer, in
    MODULES order."""
    names = {module for _, module in targets}
    return tuple(module for module in MODULES if module in names)


@dataclass(eq=False)
class ResidentAdapter:
    """An adapter's weights in pool pages, with row offsets ready for the kernels and views of its
    matrices for the torch path. Holds no host copy: the host cache alone bounds host memory.

    The only record of its state: `names` (ids it is served under, shown in snapshots),
    `pinned_by` (the ids that pinned it; a subset of `names`) and `num_users` (running
    sequences). Everything the manager counts is derived from these."""

    content_hash: str
    rank: int
    scale: float
    pages: list[int]
    pool: torch.Tensor  # the pool's pages, [num_pages, page_numel]
    layout: dict[Matrix, tuple[int, list[Chunk]]]  # PageLayout.matrices
    a_offsets: torch.Tensor  # [num_layers, num_modules, rank] flat pool offset of each A row
    b_offsets: torch.Tensor  # [num_layers, num_modules, rank]
    has_module: torch.Tensor  # [num_layers, num_modules] bool
    names: set[str] = field(default_factory=set)
    pinned_by: set[str] = field(default_factory=set)
    num_users: int = 0
    last_used: int = 0
    # the addresses of its rows each kind of LoRA call reads (lora_batch._row_addresses)
    row_addresses: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # the (layer, module) pairs it changes
        targets = frozenset(key for kind, key in self.layout if kind == "a")
        if len(_TARGET_SETS) >= _MAX_TARGET_SETS and targets not in _TARGET_SETS:
            _TARGET_SETS.clear()
        self.targets = _TARGET_SETS.setdefault(targets, targets)
        # orders adapters of equal shape next to each other in a step's batch; the same order in
        # every process (no hash() of strings, which Python salts per process). The targets go
        # in as a digest: the step sorts its sequences by this every step, and comparing two
        # equal sets of a few hundred pairs cost ~10 us a comparison (1.6 ms a 32-sequence step)
        shape = hashlib.sha256(repr(sorted(targets)).encode()).hexdigest()[:16]
        self.batch_order = (self.rank, shape, self.content_hash)
        # its A and B^T row offsets of the modules it changes alone, as a step's LoRA tables
        # stack them (lora_batch.RunGroup): for q,v adapters 2 of the 7 modules' rows;
        # [num_layers, modules changed, 2 (A, B^T), rank]
        rows = [MODULES.index(module) for module in changed_modules(self.targets)]
        self.changed_rows = torch.stack([self.a_offsets[:, rows], self.b_offsets[:, rows]], 2)

    @property
    def pinned(self) -> bool:
        return bool(self.pinned_by)

    @property
    def idle(self) -> bool:
        """Evictable: no running sequence uses it and nobody pinned it."""
        return self.num_users == 0 and not self.pinned_by

    @property
    def nbytes(self) -> int:
        """Bytes of its matrices in the pool."""
        elements = sum(w * sum(c.num_rows for c in cs) for w, cs in self.layout.values())
        return elements * self.pool.element_size()

    def a_matrix(self, layer: int, module: str) -> torch.Tensor:
        """[rank, in_features]: a view of the pool unless the matrix was split across pages."""
        return self._matrix(("a", (layer, module)))

    def b_matrix(self, layer: int, module: str) -> torch.Tensor:
        """[rank, out_features]."""
        return self._matrix(("b", (layer, module)))

    def _matrix(self, name: Matrix) -> torch.Tensor:
        width, chunks = self.layout[name]
        views = [chunk_rows(self.pool[self.pages[c.page]], c, width) for c in chunks]
        return views[0] if len(views) == 1 else torch.cat(views)


@dataclass(frozen=True)
class ResidentInfo:
    adapter_ids: tuple[str, ...]
    content_hash: str
    rank: int
    pages: int
    pinned: bool
    running_requests: int


@dataclass(frozen=True)
class PoolSnapshot:
    num_pages: int
    free_pages: int
    kv_pages: int  # held by requests
    adapter_pages: int
    resident: tuple[ResidentInfo, ...]
    cached_pages: int = 0  # KV kept for later prefixes, given back on demand


class AdapterManager:
    """Residency of adapters in the shared page pool.

    Invariants (`check_invariants` asserts them; a randomized test drives it):
    * `_idle_pages` == the pages of resident adapters that are idle: what `free_up` may reclaim;
    * `_pinned` == {content hash: pages} of the pinned resident adapters;
    * an adapter with no name is resident only while running sequences use it.
    """

    def __init__(self, pool: PagePool, model: ModelConfig) -> None:
        self.pool = pool
        self.model = model
        self.resident: dict[str, ResidentAdapter] = {}
        self._idle_pages = 0
        self.num_pages = 0  # held by resident adapters
        # replaced, never mutated, so that other threads may read it without a lock
        self._pinned: dict[str, int] = {}
        # by content hash: the question is asked every step
        self._layouts: dict[str, PageLayout] = {}
        self._packing = threading.Lock()  # two requests for one new adapter pack it once
        self._clock = itertools.count(1)
        self.num_loads = 0
        self.num_evictions = 0
        self.load_seconds = 0.0

    # -- questions the scheduler asks ------------------------------------------------------

    def pages_to_load(self, ref: AdapterRef | None) -> int:
        if ref is None or ref.content_hash in self.resident:
            return 0
        return self.plan_pages(ref.weights)

    def plan_pages(self, weights: LoRAWeights) -> int:
        """Pages the adapter occupies when resident. Safe from any thread."""
        return self._layout(weights).num_pages

    def pack(self, weights: LoRAWeights) -> PackedAdapter:
        """The adapter laid out as this pool's pages hold it, made once and kept with the weights
        (so in the host cache), so that loading it on the engine thread is one copy. Safe from
        any thread: the engine packs an adapter when a request for it arrives."""
        key = (self.pool.page_numel, self.pool.data.dtype)
        packed = weights.packed.get(key)
        if packed is not None:  # the engine thread's case: never waits on another's packing
            return packed
        with self._packing:
            packed = weights.packed.get(key)
            if packed is None:
                matrices = {("a", k): t for k, t in weights.a.items()}
                matrices.update({("b", k): t for k, t in weights.b.items()})
                packed = pack(matrices, self._layout(weights), *key)
                if next(iter(weights.a.values())).dtype == packed.image.dtype:
                    # the weights' matrices become views of the image, so the host copy is held
                    # once (but for a matrix split across pages, and the last page's tail)
                    for (kind, k), view in packed.views().items():
                        (weights.a if kind == "a" else weights.b)[k] = view
                weights.packed[key] = packed
        return packed

    def pinned_pages(self, besides: AdapterRef | None = None) -> int:
        """Pages held by pinned adapters other than `besides`. Safe from any thread."""
        pinned = self._pinned
        skipped = pinned.get(besides.content_hash, 0) if besides is not None else 0
        return sum(pinned.values()) - skipped

    def is_pinned(self, ref: AdapterRef) -> bool:
        """Safe from any thread."""
        return ref.content_hash in self._pinned

    def evictable_pages(self, keep: AdapterRef | None = None) -> int:
        kept = self.resident.get(keep.content_hash) if keep else None
        if kept is not None and kept.idle:
            return self._idle_pages - len(kept.pages)
        return self._idle_pages

    # -- changes the scheduler makes -------------------------------------------------------

    def free_up(self, num_pages: int, keep: AdapterRef | None = None) -> None:
        """Evict idle adapters, least recently used first, until `num_pages` pages are free."""
        if self.pool.can_allocate(num_pages):
            return
        keep_hash = keep.content_hash if keep else None
        idle = sorted(
            (r.last_used, h) for h, r in self.resident.items() if r.idle and h != keep_hash
        )
        for _, content_hash in idle:
            self._evict(content_hash)
            if self.pool.can_allocate(num_pages):
                return

    def acquire(self, ref: AdapterRef) -> ResidentAdapter:
        """Make `ref` resident (its pages must be free) and count one more user."""
        resident = self.resident.get(ref.content_hash) or self._load(ref.weights)
        with self._changing(resident):
            if ref.adapter_id is not None:
                resident.names.add(ref.adapter_id)
            resident.num_users += 1
        return resident

    def release(self, ref: AdapterRef) -> None:
        resident = self.resident[ref.content_hash]
        with self._changing(resident):
            resident.num_users -= 1
        self._evict_if_orphaned(resident)

    # -- operator actions ------------------------------------------------------------------

    def preload(self, ref: AdapterRef) -> None:
        """Bring `ref` into the pool if its pages are free right now (evicting nothing)."""
        resident = self.resident.get(ref.content_hash)
        if resident is None:
            if not self.pool.can_allocate(self.pages_to_load(ref)):
                return
            resident = self._load(ref.weights)
        with self._changing(resident):
            resident.names.add(ref.adapter_id)

    def pin(self, ref: AdapterRef) -> None:
        """Keep `ref` resident until unpinned; loads it now (evicting idle adapters if needed)."""
        needed = self.pages_to_load(ref)
        if needed:
            self.free_up(needed, keep=ref)
            if not self.pool.can_allocate(needed):  # busy with requests now: retry later
                raise AdapterError(
                    f"adapter {ref.adapter_id} needs {needed} pages to pin; "
                    f"{self.pool.num_free} are free while requests run",
                    code=ErrorCode.OVERLOADED,
                )
            self._load(ref.weights)
        resident = self.resident[ref.content_hash]
        with self._changing(resident):
            resident.names.add(ref.adapter_id)
            resident.pinned_by.add(ref.adapter_id)

    def unpin(self, adapter_id: str) -> None:
        for resident in list(self.resident.values()):
            if adapter_id in resident.pinned_by:
                with self._changing(resident):
                    resident.pinned_by.discard(adapter_id)

    def unload(self, adapter_id: str) -> None:
        """Forget `adapter_id`; its pages go as soon as no running sequence uses them."""
        for resident in list(self.resident.values()):
            if adapter_id in resident.names:
                with self._changing(resident):
                    resident.names.discard(adapter_id)
                    resident.pinned_by.discard(adapter_id)
                self._evict_if_orphaned(resident)

    def snapshot(self, kv_pages: int, cached_pages: int = 0) -> PoolSnapshot:
        return PoolSnapshot(
            cached_pages=cached_pages,
            num_pages=self.pool.num_pages,
            free_pages=self.pool.num_free,
            kv_pages=kv_pages,
            adapter_pages=self.num_pages,
            resident=tuple(
                ResidentInfo(
                    adapter_ids=tuple(sorted(r.names)),
                    content_hash=h,
                    rank=r.rank,
                    pages=len(r.pages),
                    pinned=r.pinned,
                    running_requests=r.num_users,
                )
                for h, r in self.resident.items()
            ),
        )

    def check_invariants(self) -> None:
        idle = sum(len(r.pages) for r in self.resident.values() if r.idle)
        assert self._idle_pages == idle, f"idle pages {self._idle_pages}, really {idle}"
        pinned = {h: len(r.pages) for h, r in self.resident.items() if r.pinned}
        assert self._pinned == pinned, f"pinned {self._pinned}, really {pinned}"
        for h, r in self.resident.items():
            assert r.num_users >= 0, f"{h}: {r.num_users} users"
            assert r.pinned_by <= r.names, f"{h}: pinned by unnamed ids"
            assert r.names or r.num_users, f"{h}: resident, unnamed and unused"
        pages = [p for r in self.resident.values() for p in r.pages]
        assert len(pages) == len(set(pages)), "two adapters share a page"
        assert self.num_pages == len(pages), f"{self.num_pages} adapter pages, really {len(pages)}"

    # -- internals -------------------------------------------------------------------------

    @contextmanager
    def _changing(self, resident: ResidentAdapter):
        """Every change of `names`, `pinned_by` or `num_users` happens inside this, which keeps
        the derived counts in step with them."""
        was_idle, was_pinned = resident.idle, resident.pinned
        yield
        resident.last_used = next(self._clock)
        self._idle_pages += (resident.idle - was_idle) * len(resident.pages)
        if resident.pinned != was_pinned:
            self._publish_pinned()

    def _publish_pinned(self) -> None:
        self._pinned = {h: len(r.pages) for h, r in self.resident.items() if r.pinned}

    def _evict_if_orphaned(self, resident: ResidentAdapter) -> None:
        if not resident.names and resident.idle:
            self._evict(resident.content_hash)

    def _evict(self, content_hash: str) -> None:
        resident = self.resident.pop(content_hash)
        self._idle_pages -= len(resident.pages) if resident.idle else 0
        if resident.pinned:
            self._publish_pinned()
        self.pool.free(resident.pages)
        self.num_pages -= len(resident.pages)
        self.num_evictions += 1

    def _layout(self, weights: LoRAWeights) -> PageLayout:
        layout = self._layouts.get(weights.content_hash)
        if layout is None:
            if len(self._layouts) > 4096:
                self._layouts.clear()
            packed = weights.packed.get((self.pool.page_numel, self.pool.data.dtype))
            if packed is not None:  # laid out as it was read (AdapterReader)
                layout = packed.layout
            else:
                layout = layout_for(
                    weights.a, weights.b, self.pool.page_numel, self.model.num_layers, MODULES
                )
            self._layouts[weights.content_hash] = layout
        return layout

    def _load(self, weights: LoRAWeights) -> ResidentAdapter:
        started = time.perf_counter()
        packed = self.pack(weights)  # packed already, unless it came by another way than a request
        pages = self.pool.allocate(packed.num_pages)
        page_ids = torch.tensor(pages, dtype=torch.long)  # host side: the offsets are
        device = self.pool.data.device
        self.pool.data.index_copy_(0, page_ids.to(device), packed.image.to(device))
        page_numel = self.pool.page_numel
        resident = ResidentAdapter(
            content_hash=weights.content_hash,
            rank=weights.rank,
            scale=weights.scale,
            pages=pages,
            pool=self.pool.data,
            layout=packed.layout.matrices,
            a_offsets=page_ids[packed.layout.a_page] * page_numel + packed.layout.a_within,
            b_offsets=page_ids[packed.layout.b_page] * page_numel + packed.layout.b_within,
            has_module=packed.layout.has_module,
        )
        self.resident[weights.content_hash] = resident
        self._idle_pages += len(pages)  # resident, no user yet
        self.num_pages += len(pages)
        self.num_loads += 1
        self.load_seconds += time.perf_counter() - started
        return resident
