"""Usage rows written off the request path: requests append a row in memory; a background task
inserts them in batches on a worker thread. A failed insert keeps its rows for the next try, and
`close` writes whatever is left, so that N requests leave N rows, also across a graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict, dataclass

from loraplex.platform import registry
from loraplex.platform.db.session import Database

logger = logging.getLogger(__name__)

MAX_BATCH = 1000


@dataclass(frozen=True)
class UsageRow:
    request_id: str
    tenant_id: str
    key_id: str
    adapter_id: str | None
    model: str
    prompt_tokens: int
    completion_tokens: int
    latency_ms: float
    status: int
    created_at: float
    batch_id: str | None = None  # the batch job whose request it was


class UsageWriter:
    def __init__(self, db: Database, interval: float) -> None:
        self.db = db
        self.interval = interval
        self._pending: list[UsageRow] = []
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self.num_written = 0

    def record(self, row: UsageRow) -> None:
        self._pending.append(row)
        if len(self._pending) >= MAX_BATCH:
            self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="loraplex-usage")

    async def close(self) -> None:
        """Stop the background task (never mid-write) and write every pending row."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        for _ in range(3):
            if await self.flush():
                return
            await asyncio.sleep(0.2)
        logger.error("%d usage rows could not be written", len(self._pending))

    async def flush(self) -> bool:
        """Write what is pending; False (rows kept) if the database refused."""
        if not self._pending:
            return True
        batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
        rows = [asdict(row) for row in batch]
        try:
            await self.db.run(lambda session: registry.add_usage(session, rows))
        except Exception:
            logger.exception("writing %d usage rows failed; will retry", len(batch))
            self._pending = batch + self._pending
            return False
        self.num_written += len(batch)
        return not self._pending or await self.flush()

    async def _run(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)
            self._wake.clear()
            started = time.monotonic()
            await self.flush()
            logger.debug("usage flush took %.1f ms", (time.monotonic() - started) * 1000)
