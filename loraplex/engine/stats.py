"""The engine's counters: updated by the engine thread after each step, read as frozen
snapshots (`EngineStats`)."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.adapters.catalog import AdapterCatalog
from loraplex.engine.adapters.manager import AdapterManager
from loraplex.engine.info import EngineStats
from loraplex.engine.kv_cache import KVCacheManager
from loraplex.engine.pool import PagePool


@dataclass
class StepCounters:
    num_steps: int = 0
    step_seconds: float = 0.0
    last_step_seconds: float = 0.0
    last_batch_size: int = 0
    last_batch_tokens: int = 0
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    num_failed_requests: int = 0

    def snapshot(
        self,
        num_running_requests: int,
        num_waiting_requests: int,
        num_preemptions: int,
        adapters: AdapterManager,
        catalog: AdapterCatalog,
        pool: PagePool,
        kv: KVCacheManager,
    ) -> EngineStats:
        return EngineStats(
            num_running_requests=num_running_requests,
            num_waiting_requests=num_waiting_requests,
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
            last_step_seconds=self.last_step_seconds,
            last_batch_size=self.last_batch_size,
            last_batch_tokens=self.last_batch_tokens,
            num_computed_tokens=self.num_computed_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_preemptions=num_preemptions,
            num_failed_requests=self.num_failed_requests,
            num_adapter_loads=adapters.num_loads,
            num_adapter_evictions=adapters.num_evictions,
            adapter_load_seconds=adapters.load_seconds,
            num_adapter_disk_reads=catalog.num_disk_reads,
            adapter_disk_read_seconds=catalog.disk_read_seconds,
            num_pages=pool.num_pages,
            free_pages=pool.num_free,
            kv_pages=pool.num_used - adapters.num_pages - kv.num_cached_pages,
            cached_pages=kv.num_cached_pages,
            num_prefix_hit_tokens=kv.num_hit_tokens,
            adapter_pages=adapters.num_pages,
            num_resident_adapters=len(adapters.resident),
        )
