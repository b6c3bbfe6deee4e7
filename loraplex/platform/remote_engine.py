"""The engine as the ingress of a Ray Serve deployment sees it: `AsyncEngine`'s surface, served by
engine replicas (ray_serve.EngineReplica) behind a deployment handle.

- `generate` calls the replica that holds the request's adapter: the handle's multiplexed model
  id is the adapter's content hash, so Ray routes to a replica that has it (a base-model request
  goes to any). A replica that dies before the request's first delta is not the caller's
  problem: the same request goes again, to another replica, up to `retries` times. Once output
  has flowed, a replica's death ends the request with RequestFailedError (code engine_error),
  which the server turns into an OpenAI error event.
- Templating, tokenizing and logprob spelling happen here (`Front`, no weights loaded).
- Adapter changes reach every replica through the shared registry: each replica watches it, pins
  what is pinned and drops what was deleted (ray_serve.py). So `unpin_adapter` and
  `unload_adapter` have nothing to do here; `load_adapter` checks the adapter on one replica,
  so that an adapter that cannot be pinned is refused at once.
- `stats`, `pool_snapshot` and `host_cached_adapters` add up what the replicas last reported to
  the board (ray_serve.Board), every half second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from ray.exceptions import RayError, RayTaskError

from loraplex.engine.api import (
    EngineDeadError,
    EngineError,
    EngineStats,
    ErrorCode,
    Fairness,
    Front,
    FrontMethods,
    LoRARequest,
    ModelInfo,
    PoolSnapshot,
    RequestDelta,
    RequestFailedError,
    SamplingParams,
)

logger = logging.getLogger(__name__)

REPORTS_SECONDS = 0.5  # how often the replicas' reports are read from the board


def adapter_key(lora: LoRARequest | None) -> str:
    """The multiplexed model id of a request: the adapter's content hash, which names the
    directory the registry stores it in (platform/adapters.py); "" for the base model."""
    return Path(lora.path).name if lora is not None else ""


def retry_pause(attempt: int) -> float:
    """Seconds before the `attempt`-th retry (from 0): Ray needs a moment to see a replica
    gone and route around it."""
    return min(0.25 * 2**attempt, 2.0)


class RemoteEngine(FrontMethods):
    def __init__(self, handle, board, front: Front, info: ModelInfo, retries: int) -> None:
        self._handle = handle
        self._board = board
        self.front = front
        self._info = info
        self._retries = retries
        self._reports: list = []
        self._watcher: asyncio.Task | None = None

    @classmethod
    async def connect(cls, handle, board, model: str, retries: int) -> RemoteEngine:
        """Load the tokenizer of `model` and ask a replica for the model's facts (waits until
        one is up)."""
        front = await asyncio.to_thread(Front.load, model)
        info = await _unwrapped(handle.model_info.remote())
        engine = cls(handle, board, front, info, retries)
        engine._watcher = asyncio.create_task(engine._read_reports(), name="replica-reports")
        return engine

    # -- requests ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora: LoRARequest | None = None,
        tag: object = None,
        fairness: Fairness | None = None,
        stream: bool = True,
    ) -> AsyncIterator[RequestDelta]:
        """As AsyncEngine.generate, on the replica holding the adapter."""
        handle = self._handle.options(stream=True, multiplexed_model_id=adapter_key(lora))
        args = (prompt, params, request_id, lora, tag, fairness, stream)
        attempt = 0
        while True:
            responses = handle.generate.remote(*args)
            try:
                first = await _next(responses)
                break
            except _ReplicaGone as gone:
                responses.cancel()
                if attempt >= self._retries:
                    message = f"no engine replica could take the request: {gone}"
                    raise EngineDeadError(message) from None
                logger.warning("engine replica lost before the request started; retrying")
                await asyncio.sleep(retry_pause(attempt))
                attempt += 1
            except BaseException:  # refused, or the caller left (cancelled) before any output
                responses.cancel()
                raise
        finished = first.finished
        try:
            yield first
            while not finished:
                try:
                    delta = await _next(responses)
                except _ReplicaGone:
                    raise RequestFailedError(
                        "the engine replica serving this request failed", ErrorCode.STEP_FAILED
                    ) from None
                finished = delta.finished
                yield delta
        finally:
            if not finished:  # left early (client gone): the replica aborts the request
                responses.cancel()

    def hold_background(self) -> Callable[[], None]:
        """Nothing to hold here: each replica schedules its own batch-tier work."""
        return _nothing

    # -- adapters ---------------------------------------------------------------------------

    async def validate_adapter(self, lora: LoRARequest):
        return await _unwrapped(self._handle.validate_adapter.remote(lora))

    async def load_adapter(self, lora: LoRARequest, pin: bool = False) -> None:
        """Checked (and, if `pin`, pinned) on one replica; the others pin it once the registry
        says so."""
        await _unwrapped(self._handle.load_adapter.remote(lora, pin))

    async def unpin_adapter(self, adapter_id: str) -> None:
        """Every replica unpins it once the registry says so."""

    async def unload_adapter(self, adapter_id: str) -> None:
        """Every replica drops it once the registry no longer has it."""

    async def pool_snapshot(self) -> PoolSnapshot:
        """Every replica's pool, added up; `resident` lists each replica's adapters."""
        pools = [report.pool for report in self._reports]
        total = {
            name: sum(getattr(p, name) for p in pools)
            for name in ("num_pages", "free_pages", "kv_pages", "adapter_pages", "cached_pages")
        }
        return PoolSnapshot(resident=tuple(r for p in pools for r in p.resident), **total)

    def host_cached_adapters(self) -> frozenset[str]:
        return frozenset().union(*(report.host_cached for report in self._reports))

    # -- for the server ---------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        return self._info

    def stats(self) -> EngineStats:
        """The replicas' counters and gauges, added up."""
        names = [field.name for field in dataclasses.fields(EngineStats)]
        return EngineStats(
            **{name: sum(getattr(r.stats, name) for r in self._reports) for name in names}
        )

    def replica_reports(self) -> list:
        """Each live replica's last report (ray_serve.ReplicaReport), by replica id."""
        return sorted(self._reports, key=lambda report: report.replica)

    async def check_health(self, timeout: float = 5.0) -> None:
        """A replica answers between two of its steps; raises EngineDeadError otherwise."""
        try:
            await asyncio.wait_for(_unwrapped(self._handle.check_health.remote()), timeout)
        except (TimeoutError, RayError, EngineError) as error:
            raise EngineDeadError(f"no engine replica answers: {error}") from None

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        """The replicas are Ray's to stop; only the report reader ends here."""
        if self._watcher is not None:
            self._watcher.get_loop().call_soon_threadsafe(self._watcher.cancel)

    async def _read_reports(self) -> None:
        while True:
            try:
                self._reports = await self._board.reports.remote()
            except Exception as error:  # the board away for a moment: figures go stale
                logger.warning("cannot read the engine replicas' reports: %r", error)
            await asyncio.sleep(REPORTS_SECONDS)


class _ReplicaGone(Exception):
    """The replica died or could not be reached (not an error of the request)."""


async def _next(responses) -> RequestDelta:
    try:
        return await anext(responses)
    except RayTaskError as error:
        raise _cause(error) from None
    except RayError as error:
        raise _ReplicaGone(str(error).splitlines()[0]) from None


async def _unwrapped(call):
    """Await a replica's answer; an engine error raised there is raised here as it was."""
    try:
        return await call
    except RayTaskError as error:
        raise _cause(error) from None


def _cause(error: RayTaskError) -> Exception:
    cause = error.cause
    if isinstance(cause, EngineError):
        return cause
    return RequestFailedError(f"the engine replica failed: {cause}", ErrorCode.STEP_FAILED)


def _nothing() -> None:
    pass
