"""Everything a running server holds, started and stopped in order.

The HTTP server answers `/health` at once; the engine (the model load takes seconds) and the
database come up in the background, and `/ready` turns 200 when both have. Until then, and once
draining has begun, requests that need them get a 503.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.engine.api import AsyncEngine, LoRARequest
from loraplex.platform import registry
from loraplex.platform.db import migrate
from loraplex.platform.db.session import Database
from loraplex.platform.errors import SERVER_ERROR, APIError
from loraplex.platform.limits import Limiter, make_limiter
from loraplex.platform.metrics import Metrics
from loraplex.platform.settings import Settings
from loraplex.platform.tenancy import Directory
from loraplex.platform.usage import UsageWriter

logger = logging.getLogger(__name__)


def served_model_name(settings: Settings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    if settings.model == "default":
        return "SmolLM2-135M-Instruct"
    return Path(settings.model).name


EngineFactory = Callable[[Settings], Awaitable[AsyncEngine]]


async def local_engine(settings: Settings) -> AsyncEngine:
    """The engine in this process, on its own thread (the default)."""
    return await asyncio.to_thread(AsyncEngine, settings.engine_config())


@dataclass
class Platform:
    settings: Settings
    admin_token: str
    # the engine: in this process, or remote replicas behind the same surface (ray_serve.py)
    engine_factory: EngineFactory = local_engine
    base_model: str = ""
    db: Database | None = None
    engine: AsyncEngine | None = None
    directory: Directory | None = None
    limiter: Limiter | None = None
    usage: UsageWriter | None = None
    batches: Any = None  # the Batch API's runner (batches.BatchRunner), made with the app
    fingerprint: str = ""
    started_at: float = field(default_factory=time.time)
    draining: bool = False
    in_flight: int = 0  # HTTP requests being served (see middleware)
    metrics: Metrics = field(init=False)
    startup_error: str | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.metrics = Metrics(
            lambda: self.engine.stats() if self.engine is not None else None,
            self.replica_reports,
        )

    def replica_reports(self) -> list | None:
        """Each engine replica's last report (ray_serve.ReplicaReport) when the engine is
        remote; None for the engine in this process."""
        reports = getattr(self.engine, "replica_reports", None)
        return reports() if reports is not None else None

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self.draining

    def require_engine(self) -> AsyncEngine:
        """The engine, or a 503 while starting or draining."""
        if self.draining:
            raise APIError(503, "The server is shutting down.", SERVER_ERROR, "shutting_down")
        if not self._ready.is_set() or self.engine is None:
            message = self.startup_error or "The server is starting; retry shortly."
            raise APIError(503, message, SERVER_ERROR, "starting")
        return self.engine

    async def start(self) -> None:
        """Database (migrated to head), limits, usage writer, then the engine."""
        settings = self.settings
        self.base_model = served_model_name(settings)
        self.db = Database(settings.database)
        await asyncio.to_thread(migrate.upgrade, settings.database)
        self.directory = Directory(self.db, self.base_model, settings.registry_poll_seconds)
        self.directory.start()
        self.limiter = make_limiter(settings.redis_url)
        self.usage = UsageWriter(self.db, settings.usage_flush_seconds)
        self.usage.start()
        self.engine = await self.engine_factory(settings)
        info = self.engine.model_info()
        self.fingerprint = "fp_" + hashlib.sha256(info.model.encode()).hexdigest()[:10]
        await self._restore_pins()
        self._ready.set()
        logger.info("ready: %s on %s", self.base_model, info.model)

    async def _restore_pins(self) -> None:
        pinned = await self.db.run(lambda s: [a for a in registry.list_adapters(s) if a.pinned])
        for adapter in pinned:
            try:
                await self.engine.load_adapter(
                    LoRARequest(adapter.id, adapter.storage_path), pin=True
                )
            except Exception as error:  # one bad pin must not stop the server
                logger.error("could not pin adapter %s again: %s", adapter.id, error)

    async def stop(self) -> None:
        """Drain: refuse new work, let the engine finish in-flight requests within the grace
        period, write every usage row, close connections."""
        self.draining = True
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown, self.settings.shutdown_grace_seconds)
        if self.usage is not None:
            await self.usage.close()
        if self.directory is not None:
            await self.directory.close()
        if self.limiter is not None:
            await self.limiter.close()
        if self.db is not None:
            self.db.close()

    async def check_ready(self) -> None:
        """Raises APIError 503 unless the engine steps and the database answers."""
        engine = self.require_engine()
        try:
            await engine.check_health(timeout=2.0)
            await asyncio.wait_for(asyncio.to_thread(self.db.ping), 2.0)
        except Exception as error:
            raise APIError(503, f"not ready: {error}", SERVER_ERROR, "not_ready") from None
