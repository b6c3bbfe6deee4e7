"""Adapter id -> path -> validated host copy, kept in a byte-bounded LRU. Any thread (locked).

Reading an adapter from disk is slow (hashing and validating every tensor), so the async engine
always does it on a worker thread; the engine thread only ever takes host copies already read.
A sequence holds its adapter's host copy for as long as it lives, so a host eviction never strands
a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from loraplex.engine.adapters.peft_format import AdapterReader, LoRAWeights
from loraplex.engine.config import ModelConfig
from loraplex.engine.errors import AdapterError, ErrorCode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterRef:
    """What a sequence carries: the adapter's id and its validated host copy. A retired ref
    (`adapter_id` None) still serves the requests that hold it, but names no adapter: its
    adapter was unloaded while they waited or ran. `generation` tells refs read before an
    unload from those read after it."""

    adapter_id: str | None
    weights: LoRAWeights
    generation: int = 0

    @property
    def content_hash(self) -> str:
        return self.weights.content_hash

    def retired(self) -> AdapterRef:
        return replace(self, adapter_id=None)


class AdapterCatalog:
    def __init__(
        self,
        model: ModelConfig,
        dtype: torch.dtype,
        max_rank: int,
        roots: tuple[str, ...] | None,
        host_cache_bytes: int,
        page_numel: int | None = None,
    ) -> None:
        self.max_rank, self.roots = max_rank, roots
        # given the pool's page size, it reads a file of a known header straight into pool pages
        self._reader = AdapterReader(model, max_rank, dtype, roots, page_numel)
        self._budget = host_cache_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[str, LoRAWeights]] = OrderedDict()
        self._generations: dict[str, int] = {}  # bumped when an id is forgotten (unloaded)
        self.num_disk_reads = 0
        self.disk_read_seconds = 0.0

    def get(self, adapter_id: str, path: str) -> AdapterRef:
        """The adapter, read and validated from `path` unless cached under the same path.
        Raises AdapterError."""
        cached = self.cached(adapter_id, path)
        if cached is not None:
            return cached
        weights = self.read(path)
        with self._lock:
            self._cache[adapter_id] = (str(path), weights)
            self._cache.move_to_end(adapter_id)
            self._shrink()
            return AdapterRef(adapter_id, weights, self._generations.get(adapter_id, 0))

    def cached(self, adapter_id: str, path: str) -> AdapterRef | None:
        """The host copy if it is cached under this path; never touches the disk."""
        with self._lock:
            hit = self._cache.get(adapter_id)
            if hit is None or hit[0] != str(path):
                return None
            self._cache.move_to_end(adapter_id)
            return AdapterRef(adapter_id, hit[1], self._generations.get(adapter_id, 0))

    def read(self, path: str) -> LoRAWeights:
        """Read and validate from disk, caching nothing. Raises AdapterError."""
        started = time.perf_counter()
        try:
            weights = self._reader.read(path)
        except AdapterError:
            raise
        except Exception as error:  # a case the checks did not foresee: still the adapter's fault
            logger.exception("reading adapter %s failed unexpectedly", path)
            raise AdapterError(
                f"the adapter at {str(path)[:200]} could not be read: {error}",
                code=ErrorCode.ADAPTER_CORRUPT,
            ) from None
        with self._lock:
            self.num_disk_reads += 1
            self.disk_read_seconds += time.perf_counter() - started
        return weights

    def forget(self, adapter_id: str) -> None:
        with self._lock:
            self._cache.pop(adapter_id, None)
            self._generations[adapter_id] = self._generations.get(adapter_id, 0) + 1

    def is_current(self, ref: AdapterRef) -> bool:
        """False once the ref's id was forgotten after the ref was read."""
        with self._lock:
            return ref.generation == self._generations.get(ref.adapter_id, 0)

    def cached_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._cache)

    def _shrink(self) -> None:
        total = sum(w.nbytes for _, w in self._cache.values())
        while total > self._budget and len(self._cache) > 1:
            _, (_, dropped) = self._cache.popitem(last=False)
            total -= dropped.nbytes
