"""One API call's bookkeeping, from admission to its usage row: the rate-limit grant it holds and
settles, the tokens it used, and the status it ended with. `finish` runs exactly once, whether the
call ended in the handler (a JSON reply, an error) or at the end of its stream."""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Request

from loraplex.platform.errors import ClientDisconnected
from loraplex.platform.limits import Grant
from loraplex.platform.state import Platform
from loraplex.platform.tenancy import Caller
from loraplex.platform.usage import UsageRow


class Call:
    def __init__(self, platform: Platform, caller: Caller, model: str, id_prefix: str) -> None:
        self.platform = platform
        self.caller = caller
        self.model = model
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.adapter_id: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.grant: Grant | None = None
        self._started = time.perf_counter()
        self._finished = False

    @property
    def headers(self) -> dict[str, str]:
        return dict(self.grant.headers) if self.grant else {}

    async def admit(self, estimated_tokens: int) -> None:
        """Take the rate-limit grant; raises APIError 429."""
        self.grant = await self.platform.limiter.acquire(self.caller, estimated_tokens)

    async def finish(self, status: int) -> None:
        if self._finished:
            return
        self._finished = True
        if self.grant is not None:
            used = self.prompt_tokens + self.completion_tokens
            await self.platform.limiter.settle(self.caller, self.grant, used)
        self.platform.usage.record(
            UsageRow(
                request_id=self.id,
                tenant_id=self.caller.tenant_id,
                key_id=self.caller.key_id,
                adapter_id=self.adapter_id,
                model=self.model,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                latency_ms=(time.perf_counter() - self._started) * 1000,
                status=status,
                created_at=time.time(),
            )
        )


@asynccontextmanager
async def cancelled_on_disconnect(request: Request):
    """Run the block; if the client goes away meanwhile, cancel it (its engine requests are
    aborted) and raise ClientDisconnected. One watcher task per request."""
    task = asyncio.current_task()
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not gone:
            raise
        task.uncancel()
        raise ClientDisconnected from None
    finally:
        watcher.cancel()
