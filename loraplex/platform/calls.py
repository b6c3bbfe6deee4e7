"""One API call's bookkeeping, from admission to its usage row: the rate-limit grant it holds and
settles, the tokens it used, and the status it ended with. `finish` runs exactly once, whether the
call ended in the handler (a JSON reply, an error) or at the end of its stream."""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import Request

from loraplex.engine.api import Fairness, RequestDelta, Tier
from loraplex.platform.errors import ClientDisconnected
from loraplex.platform.limits import Grant
from loraplex.platform.metrics import UNRESOLVED
from loraplex.platform.sampling import service_tier
from loraplex.platform.state import Platform
from loraplex.platform.tenancy import Caller
from loraplex.platform.usage import UsageRow


def _nothing() -> None:
    pass


class Call:
    def __init__(
        self, platform: Platform, caller: Caller, model: str, id_prefix: str, request: Request
    ) -> None:
        self.platform = platform
        self.caller = caller
        self.model = model
        self.resolved = False  # whether `model` named something this caller may use
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.adapter_id: str | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.grant: Grant | None = None
        state = request.scope.setdefault("state", {})
        origin = state.get("batch")  # set only for a batch job's request, made in-process
        self.batch_id: str | None = origin.batch_id if origin is not None else None
        self.tier = Tier.BATCH if origin is not None else Tier.INTERACTIVE
        self.status: int | None = None
        state["call"] = self  # for the request's log line and metrics (see middleware)
        self._started = state.get("arrived") or time.perf_counter()
        self._last_output: float | None = None
        self._finished = False
        # background work waits while it is prepared (see AsyncEngine.hold_background)
        self._release = (
            platform.engine.hold_background() if self.tier == Tier.INTERACTIVE else _nothing
        )

    def started(self) -> None:
        """Its first output is out (or it ended): background work need not wait for it."""
        self._release()

    def choose_tier(self, body) -> None:
        """The tier the request asks for (service_tier) or its key's default; a batch job's
        request stays at the batch tier."""
        if self.batch_id is None:
            self.tier = service_tier(body, self.caller.service_tier)
            if self.tier != Tier.INTERACTIVE:
                self.started()

    @property
    def fairness(self) -> Fairness:
        """Whom the engine serves it for: the tenant, at its weight, at the call's tier."""
        return Fairness(self.caller.tenant_id, self.caller.weight, self.tier)

    @property
    def headers(self) -> dict[str, str]:
        return dict(self.grant.headers) if self.grant else {}

    @property
    def model_label(self) -> str:
        """`model` for the metrics: only names that resolved, so unknown ones mint no series."""
        return self.model if self.resolved else UNRESOLVED

    def log_fields(self) -> dict:
        return {
            "completion_id": self.id,
            "tenant_id": self.caller.tenant_id,
            "key_id": self.caller.key_id,
            "model": self.model_label,
            "adapter_id": self.adapter_id,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "call_status": self.status,
        }

    def output(self, delta: RequestDelta) -> None:
        """Count a delta's tokens and time it (first token, gaps between outputs)."""
        tokens = sum(len(out.token_ids) for out in delta.outputs)
        if not tokens:
            return
        self.completion_tokens += tokens
        now = time.perf_counter()
        metrics = self.platform.metrics
        if self._last_output is None:
            metrics.time_to_first_token.observe(now - self._started)
        else:
            metrics.inter_token_latency.observe(now - self._last_output)
        self._last_output = now

    async def admit(self, estimated_tokens: int) -> None:
        """Take the rate-limit grant; raises APIError 429."""
        self.grant = await self.platform.limiter.acquire(self.caller, estimated_tokens)

    async def finish(self, status: int) -> None:
        if self._finished:
            return
        self._finished = True
        self.started()
        self.status = status
        seconds = time.perf_counter() - self._started
        if self.grant is not None:
            used = self.prompt_tokens + self.completion_tokens
            await self.platform.limiter.settle(self.caller, self.grant, used)
        metrics = self.platform.metrics
        if status == 200:
            metrics.e2e_latency.observe(seconds)
        tenant = self.caller.tenant_id
        if self.prompt_tokens:
            metrics.prompt_tokens.labels(tenant).inc(self.prompt_tokens)
        if self.completion_tokens:
            metrics.generation_tokens.labels(tenant).inc(self.completion_tokens)
        self.platform.usage.record(
            UsageRow(
                request_id=self.id,
                tenant_id=tenant,
                key_id=self.caller.key_id,
                adapter_id=self.adapter_id,
                model=self.model,
                prompt_tokens=self.prompt_tokens,
                completion_tokens=self.completion_tokens,
                latency_ms=seconds * 1000,
                status=status,
                created_at=time.time(),
                batch_id=self.batch_id,
            )
        )


async def authenticate(request: Request, platform: Platform) -> Caller:
    """The caller: the key of the Authorization header, or for a batch job's request (made
    in-process, see batches.py) the job's key."""
    origin = request.scope.get("state", {}).get("batch")
    if origin is not None:
        return origin.caller
    return await platform.directory.authenticate(request.headers.get("authorization"))


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
