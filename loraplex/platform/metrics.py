"""Prometheus metrics at `GET /metrics` (prometheus-client), one registry per app.

Two kinds: what the platform counts on the request path (requests by route, model and status;
latency histograms; tokens by tenant), and what the engine already counts, read at scrape time
from `AsyncEngine.stats()` (queue depths, batch size, pool pages by use, adapter loads), so the
engine thread never touches a metric. On Ray Serve the engine figures are summed over the engine
replicas, and each replica's own figures come as `loraplex_replica_*{replica=...}`.

Label values stay bounded: `route` is the route's template (not the raw path), `model` is the
name a request resolved to (base model or a visible adapter; "-" when it did not resolve, so an
unknown name cannot mint series), `tenant` a tenant id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from loraplex.engine.api import EngineStats

disable_created_metrics()  # no `_created` series: scrapers do not need them

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "loraplex_"
UNRESOLVED = "-"  # the model label of a request whose model did not resolve

# Seconds, from a fraction of a millisecond (an idle tiny model) to minutes (a long generation
# behind a queue).
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120, 300)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1, 2.5, 5)


class Metrics:
    def __init__(
        self,
        engine_stats: Callable[[], EngineStats | None],
        replicas: Callable[[], list | None] = lambda: None,
    ) -> None:
        """`engine_stats` as of the engine's last step (summed over replicas when remote);
        `replicas` each engine replica's last report (ray_serve.ReplicaReport), or None."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests",
            "HTTP requests served, by route, model and status.",
            ["route", "model", "status"],
            registry=r,
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "From a completion request's arrival to its first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Between successive outputs of one completion, after the first.",
            buckets=TOKEN_GAP_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "From a completion request's arrival to its end (last byte of its stream).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens",
            "Prompt tokens of completions, by tenant.",
            ["tenant"],
            registry=r,
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens",
            "Generated tokens of completions, by tenant.",
            ["tenant"],
            registry=r,
        )
        r.register(_EngineCollector(engine_stats))
        r.register(_ReplicaCollector(replicas))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """The engine's own counters and gauges, as of its last step."""

    def __init__(self, engine_stats: Callable[[], EngineStats | None]) -> None:
        self.engine_stats = engine_stats

    def describe(self) -> list:
        return []  # names known only once the engine is up: nothing to check at registration

    def collect(self) -> Iterator:
        stats = self.engine_stats()
        if stats is None:  # still loading
            return
        yield _gauge(
            "num_requests_running", "Requests in the running batch.", stats.num_running_requests
        )
        yield _gauge(
            "num_requests_waiting", "Requests waiting to be admitted.", stats.num_waiting_requests
        )
        yield _gauge("batch_size", "Sequences in the last engine step.", stats.last_batch_size)
        yield _gauge(
            "batch_tokens", "Tokens computed in the last engine step.", stats.last_batch_tokens
        )
        pages = GaugeMetricFamily(
            PREFIX + "pool_pages", "Pages of the unified pool, by use.", labels=["use"]
        )
        pages.add_metric(["kv"], stats.kv_pages)
        pages.add_metric(["cached"], stats.cached_pages)
        pages.add_metric(["adapter"], stats.adapter_pages)
        pages.add_metric(["free"], stats.free_pages)
        yield pages
        yield _gauge(
            "resident_adapters", "Adapters resident in the pool.", stats.num_resident_adapters
        )
        yield _counter("engine_steps", "Engine steps run.", stats.num_steps)
        yield _counter(
            "prefix_cache_hit_tokens",
            "Prompt tokens whose KV came from the prefix cache.",
            stats.num_prefix_hit_tokens,
        )
        yield _counter("preemptions", "Sequences preempted for room.", stats.num_preemptions)
        yield _counter("failed_requests", "Requests the engine failed.", stats.num_failed_requests)
        yield _counter("adapter_loads", "Adapters loaded into the pool.", stats.num_adapter_loads)
        yield _counter(
            "adapter_evictions", "Adapters evicted from the pool.", stats.num_adapter_evictions
        )
        yield SummaryMetricFamily(
            PREFIX + "adapter_load_seconds",
            "Time to load an adapter into the pool (from the host cache).",
            count_value=stats.num_adapter_loads,
            sum_value=stats.adapter_load_seconds,
        )
        yield SummaryMetricFamily(
            PREFIX + "adapter_disk_read_seconds",
            "Time to read and validate an adapter from disk into the host cache.",
            count_value=stats.num_adapter_disk_reads,
            sum_value=stats.adapter_disk_read_seconds,
        )


class _ReplicaCollector(Collector):
    """Per engine replica, when the engine is remote (Ray Serve): load, pool, affinity."""

    GAUGES = (
        ("requests_running", "Requests in the replica's running batch."),
        ("requests_waiting", "Requests waiting on the replica."),
        ("free_pages", "Free pages of the replica's pool."),
        ("kv_pages", "Pages of the replica's pool held by requests."),
        ("adapter_pages", "Pages of the replica's pool held by adapters."),
        ("resident_adapters", "Adapters resident in the replica's pool."),
        ("routed_adapters", "Adapters Ray routes to the replica (its multiplexed models)."),
    )
    COUNTERS = (
        ("adapter_requests", "Requests for an adapter the replica served."),
        ("affinity_hits", "... of which the replica already held the adapter."),
    )

    def __init__(self, replicas: Callable[[], list | None]) -> None:
        self.replicas = replicas

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        reports = self.replicas()
        if reports is None:
            return
        name = PREFIX + "replica_"
        families = {g: GaugeMetricFamily(name + g, d, labels=["replica"]) for g, d in self.GAUGES}
        families |= {
            c: CounterMetricFamily(name + c, d, labels=["replica"]) for c, d in self.COUNTERS
        }
        for report in reports:
            stats = report.stats
            values = {
                "requests_running": stats.num_running_requests,
                "requests_waiting": stats.num_waiting_requests,
                "free_pages": stats.free_pages,
                "kv_pages": stats.kv_pages,
                "adapter_pages": stats.adapter_pages,
                "resident_adapters": stats.num_resident_adapters,
                "routed_adapters": report.routed,
                "adapter_requests": report.adapter_requests,
                "affinity_hits": report.affinity_hits,
            }
            for key, family in families.items():
                family.add_metric([report.replica], values[key])
        yield from families.values()


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, documentation, value=value)
