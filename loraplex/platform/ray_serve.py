"""loraplex on Ray Serve: the platform's HTTP front as the ingress deployment, engine replicas as
a multiplexed deployment keyed by the adapter's content hash (docs/scaling.md).

    Ray's HTTP proxy -> Ingress (create_app: auth, limits, resolution, SSE, usage)
                          -> RemoteEngine -> handle(multiplexed_model_id=content hash)
                                              -> EngineReplica (AsyncEngine) on the replica
                                                 that holds the adapter

Each replica watches the shared registry as every server process does (one revision counter):
adapters pinned there are pinned on every replica, adapters deleted there are dropped by every
replica within one poll. Replicas report their figures (queue depth, pool pages, resident
adapters, affinity) to Ray's autoscaler (`record_autoscaling_stats`) and to a small named actor,
the board, which the ingress reads for `/metrics` and the admin API.

Entry points: `loraplex serve --ray` (`run`), or Ray's own `serve run configs/ray-serve.yaml`
(`build`). Only this module and remote_engine.py import Ray; the default server never does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import serve

from loraplex.engine.api import (
    AsyncEngine,
    EngineStats,
    LoRARequest,
    PoolSnapshot,
)
from loraplex.engine.default_model import resolve_model
from loraplex.platform import registry
from loraplex.platform.app import create_app
from loraplex.platform.db import migrate
from loraplex.platform.db.session import Database
from loraplex.platform.logs import configure as configure_logs
from loraplex.platform.remote_engine import RemoteEngine, adapter_key
from loraplex.platform.settings import Settings, admin_token, load_settings

logger = logging.getLogger(__name__)

APP_NAME = "loraplex"
NAMESPACE = "loraplex"
BOARD_NAME = "loraplex-replicas"
REPORT_SECONDS = 0.5  # how often a replica reports to the board
STALE_SECONDS = 3.0  # a replica silent this long (dead) is left out of the figures
LOCAL_OBJECT_STORE_BYTES = 256 << 20  # deltas are small; Ray's default takes 30% of RAM


@dataclass(frozen=True)
class ReplicaReport:
    """What one engine replica last said about itself."""

    replica: str
    stats: EngineStats
    pool: PoolSnapshot
    host_cached: frozenset[str]
    routed: int  # adapters Ray routes to it (its multiplexed models)
    adapter_requests: int  # requests for an adapter it has served
    affinity_hits: int  # ... of which it already held the adapter
    at: float  # time.time() of the report


@ray.remote(num_cpus=0)
class Board:
    """Where replicas leave their reports and the ingress reads them."""

    def __init__(self) -> None:
        self._reports: dict[str, ReplicaReport] = {}

    def report(self, report: ReplicaReport) -> None:
        self._reports[report.replica] = report

    def reports(self) -> list[ReplicaReport]:
        now = time.time()
        self._reports = {k: r for k, r in self._reports.items() if now - r.at < STALE_SECONDS}
        return list(self._reports.values())


def board():
    return Board.options(
        name=BOARD_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()


class _Routed:
    """An adapter Ray routes to this replica (a multiplexed "model"). When Ray's LRU lets it go
    (it calls `__del__`), the replica's engine forgets it too, at its next registry poll, so
    what Ray routes here and what the replica holds stay alike."""

    def __init__(self, replica: EngineReplica, key: str) -> None:
        self.replica = replica
        self.key = key
        self.adapter_ids: set[str] = set()  # rows registered with these weights

    def __del__(self) -> None:  # from Ray's executor thread, or the collector: no awaiting
        if self.replica.routed.get(self.key) is self:
            del self.replica.routed[self.key]
        self.replica.let_go |= self.adapter_ids


class EngineReplica:
    """One engine (AsyncEngine, its own thread) in a Ray Serve replica. Ray calls its
    `check_health` every `health_check_period_s` and replaces a replica whose engine thread is
    gone or wedged, and `record_autoscaling_stats` for the autoscaler."""

    async def __init__(self, config: str | None, overrides: dict) -> None:
        settings = load_settings(Path(config) if config else None, **overrides)
        configure_logs(settings.log_level, settings.log_format)
        self.settings = settings
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.engine = await asyncio.to_thread(AsyncEngine, settings.engine_config())
        self.db = Database(settings.database)
        self.board = board()
        self.routed: dict[str, _Routed] = {}
        self.pinned: set[str] = set()  # adapter ids this replica pinned for the registry
        self.let_go: set[str] = set()  # adapter ids Ray no longer routes here
        self.adapter_requests = 0
        self.affinity_hits = 0

        async def hold(key: str) -> _Routed:  # a function: Ray keeps its LRU on the function
            routed = _Routed(self, key)
            self.routed[key] = routed
            return routed

        limit = settings.ray.adapters_per_replica
        self._route = serve.multiplexed(max_num_models_per_replica=limit)(hold)
        self._tasks = [
            asyncio.create_task(self._follow_registry(), name="registry"),
            asyncio.create_task(self._report(), name="report"),
        ]

    async def generate(
        self,
        prompt,
        params,
        request_id: str | None,
        lora: LoRARequest | None,
        tag,
        fairness,
        stream: bool,
    ):
        if lora is not None:
            key = serve.get_multiplexed_model_id() or adapter_key(lora)
            self.adapter_requests += 1
            self.affinity_hits += key in self.routed
            routed = await self._route(key)
            routed.adapter_ids.add(lora.adapter_id)
        async for delta in self.engine.generate(
            prompt, params, request_id, lora, tag, fairness, stream
        ):
            yield delta

    async def validate_adapter(self, lora: LoRARequest):
        return await self.engine.validate_adapter(lora)

    async def load_adapter(self, lora: LoRARequest, pin: bool) -> None:
        await self.engine.load_adapter(lora, pin=pin)

    def model_info(self):
        return self.engine.model_info()

    async def check_health(self) -> None:
        await self.engine.check_health(timeout=5.0)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """For Ray's autoscaler (a custom policy may scale on these)."""
        stats = self.engine.stats()
        return {
            "waiting_requests": stats.num_waiting_requests,
            "running_requests": stats.num_running_requests,
            "free_pages": stats.free_pages,
            "resident_adapters": stats.num_resident_adapters,
        }

    async def __del__(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.engine.aclose(self.settings.shutdown_grace_seconds)
        self.db.close()

    # -- the registry, as every replica sees it ---------------------------------------------

    async def _follow_registry(self) -> None:
        seen = None
        while True:
            try:
                revision = await self.db.run(registry.revision)
                if revision != seen:
                    await self._apply_registry()
                    seen = revision
                await self._let_go()
            except Exception as error:  # the database away: try again at the next poll
                logger.warning("cannot follow the registry: %s", error)
            await asyncio.sleep(self.settings.registry_poll_seconds)

    async def _apply_registry(self) -> None:
        """Pin what is pinned, unpin what no longer is, drop what was deleted."""
        rows = await self.db.run(
            lambda s: {a.id: (a.storage_path, a.pinned) for a in registry.list_adapters(s)}
        )
        snapshot = await self.engine.pool_snapshot()
        held = set(self.engine.host_cached_adapters())
        held.update(i for resident in snapshot.resident for i in resident.adapter_ids)
        for routed in list(self.routed.values()):  # Ray may let one go meanwhile
            held |= routed.adapter_ids
        for adapter_id in held - rows.keys():
            self.pinned.discard(adapter_id)
            await self.engine.unload_adapter(adapter_id)
            for routed in list(self.routed.values()):
                routed.adapter_ids.discard(adapter_id)
        for adapter_id in self.pinned - {i for i, (_, pinned) in rows.items() if pinned}:
            self.pinned.discard(adapter_id)
            await self.engine.unpin_adapter(adapter_id)
        for adapter_id, (path, pinned) in rows.items():
            if pinned and adapter_id not in self.pinned:
                lora = LoRARequest(adapter_id, path)
                try:
                    await self.engine.load_adapter(lora, pin=True)
                except Exception as error:  # one bad pin must not stop the others
                    logger.error("could not pin adapter %s: %s", adapter_id, error)
                    continue
                self.pinned.add(adapter_id)
                routed = await self._route(adapter_key(lora))  # pinned: routed here too
                routed.adapter_ids.add(adapter_id)

    async def _let_go(self) -> None:
        """Forget the adapters Ray stopped routing here (unless pinned, or routed again)."""
        still = {i for routed in list(self.routed.values()) for i in routed.adapter_ids}
        let_go, self.let_go = self.let_go, set()
        for adapter_id in let_go - still - self.pinned:
            await self.engine.unload_adapter(adapter_id)

    async def _report(self) -> None:
        while True:
            try:
                report = ReplicaReport(
                    replica=self.replica,
                    stats=self.engine.stats(),
                    pool=await self.engine.pool_snapshot(),
                    host_cached=self.engine.host_cached_adapters(),
                    routed=len(self.routed),
                    adapter_requests=self.adapter_requests,
                    affinity_hits=self.affinity_hits,
                    at=time.time(),
                )
                self.board.report.remote(report)
            except Exception as error:
                logger.warning("cannot report to the board: %s", error)
            await asyncio.sleep(REPORT_SECONDS)


@serve.ingress()
class Ingress:
    """The platform's HTTP front (create_app) with its engine on the replicas."""

    def __init__(self, engine_handle, config: str | None, overrides: dict) -> None:
        self.settings = load_settings(Path(config) if config else None, **overrides)
        configure_logs(self.settings.log_level, self.settings.log_format)
        self.engine_handle = engine_handle

    def __serve_build_asgi_app__(self):
        token, _ = admin_token(self.settings)

        async def remote_engine(settings: Settings) -> RemoteEngine:
            return await RemoteEngine.connect(
                self.engine_handle, board(), settings.model, settings.ray.retries
            )

        # Ray routes to a replica once its app has started: only once it can serve, then
        return create_app(
            self.settings, token, engine_factory=remote_engine, start_before_serving=True
        )


def application(settings: Settings, config: str | None = None, overrides: dict | None = None):
    """The Serve application: an ingress bound to the engine deployment. Each deployment reads
    the settings itself (file and environment): no secret travels in its arguments."""
    overrides = overrides or {}
    scale = settings.ray
    engine_options: dict = {
        "max_ongoing_requests": scale.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": scale.engine_cpus, "num_gpus": scale.engine_gpus},
        "graceful_shutdown_timeout_s": settings.shutdown_grace_seconds,
        "health_check_period_s": 2,
        "logging_config": {"enable_access_log": False},
    }
    if scale.max_engine_replicas and scale.max_engine_replicas > scale.engine_replicas:
        engine_options["autoscaling_config"] = {
            "min_replicas": scale.engine_replicas,
            "initial_replicas": scale.engine_replicas,
            "max_replicas": scale.max_engine_replicas,
            "target_ongoing_requests": scale.target_ongoing_requests,
        }
    else:
        engine_options["num_replicas"] = scale.engine_replicas
    engine = serve.deployment(EngineReplica, name="EngineReplica").options(**engine_options)
    ingress = serve.deployment(Ingress, name="Ingress").options(
        num_replicas=scale.ingress_replicas,
        max_ongoing_requests=settings.max_waiting_requests * 4,
        ray_actor_options={"num_cpus": scale.ingress_cpus},
        logging_config={"enable_access_log": False},  # the platform logs its own requests
        graceful_shutdown_timeout_s=settings.shutdown_grace_seconds,
    )
    return ingress.bind(engine.bind(config, overrides), config, overrides)


def build(args: dict):
    """For `serve run` (configs/ray-serve.yaml): args `config` (a settings file) and
    `settings` (values over it, as flags would be)."""
    config = args.get("config")
    overrides = dict(args.get("settings") or {})
    settings = load_settings(Path(config) if config else None, **overrides)
    return application(settings, config, overrides)


def run(settings: Settings, config: Path | None, overrides: dict) -> int:
    """`loraplex serve --ray`: start (or join) Ray, deploy, serve until SIGTERM or SIGINT."""
    configure_logs(settings.log_level, settings.log_format)
    _, token_file = admin_token(settings, create=True)  # the ingress reads it there too
    resolve_model(settings.model)  # prepare the default model once, before the replicas look
    migrate.upgrade(settings.database)  # once, before ingress replicas start side by side
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    scale = settings.ray
    if scale.address:
        ray.init(address=scale.address, namespace=NAMESPACE)
    else:
        ray.init(
            num_cpus=scale.num_cpus,
            namespace=NAMESPACE,
            include_dashboard=False,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
        )
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        config_path = str(config) if config else None
        serve.run(application(settings, config_path, overrides), name=APP_NAME, route_prefix="/")
        url = f"http://{settings.host}:{settings.port}/v1"
        token = f"in {token_file}" if token_file else "from the settings"
        sys.stdout.write(
            f"loraplex is serving on Ray Serve at {url}: {scale.engine_replicas} engine "
            f"replicas, {scale.ingress_replicas} ingress\nadmin token: {token}\n"
        )
        sys.stdout.flush()
        while not stop.wait(0.5):
            pass
        logger.info("stopping the Serve application")
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
