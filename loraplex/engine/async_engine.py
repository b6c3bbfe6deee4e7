"""The engine for servers: the step loop runs on its own thread; callers stream with

    async for delta in engine.generate(prompt, params):
        ...

Requests, aborts and adapter operations cross into the loop through a queue; deltas and results
come back to each caller's event loop thread-safely. The engine thread is the only one touching
engine state; reading an adapter from disk happens on a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from loraplex.engine.adapters.manager import PoolSnapshot
from loraplex.engine.config import EngineConfig
from loraplex.engine.engine import LLMEngine, LoRARequest
from loraplex.engine.outputs import RequestDelta
from loraplex.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed; in-flight requests were dropped."""


@dataclass
class _Listener:
    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._inbox: queue.Queue = queue.Queue()
        self._listeners: dict[str, _Listener] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora: LoRARequest | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas until it finishes. Raises ValueError for bad input (or an
        unservable adapter) before anything runs. Leaving the loop early (client gone) aborts the
        request."""
        request = await asyncio.to_thread(
            self.engine.make_request, prompt, params, request_id, lora
        )
        if request.request_id in self._listeners:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        listener = _Listener(asyncio.get_running_loop(), asyncio.Queue())
        self._listeners[request.request_id] = listener
        self._inbox.put(("add", request))
        finished = False
        try:
            while not finished:
                delta = await listener.deltas.get()
                if isinstance(delta, Exception):
                    raise delta
                finished = delta.finished
                yield delta
        finally:
            self._listeners.pop(request.request_id, None)
            if not finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # -- adapters ---------------------------------------------------------------------------

    async def load_adapter(self, lora: LoRARequest, pin: bool = False) -> None:
        """Read and validate the adapter, and bring it into the pool if there is room (always,
        when pinned). Raises AdapterError naming the problem."""
        # read from disk on a worker thread; the engine thread then finds it in the host cache
        await asyncio.to_thread(self.engine.catalog.get, lora.adapter_id, lora.path)
        await self._on_engine_thread(self.engine.load_adapter, lora, pin)

    async def unpin_adapter(self, adapter_id: str) -> None:
        await self._on_engine_thread(self.engine.unpin_adapter, adapter_id)

    async def unload_adapter(self, adapter_id: str) -> None:
        """Forget the adapter; requests in flight with it still finish."""
        await self._on_engine_thread(self.engine.unload_adapter, adapter_id)

    async def pool_snapshot(self) -> PoolSnapshot:
        return await self._on_engine_thread(self.engine.pool_snapshot)

    async def _on_engine_thread(self, fn: Callable, *args):
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", (fn, args, future)))
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        self._stopped = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout=30)

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped:
            self._take_inbox(block=not self.engine.has_unfinished())
            if not self.engine.has_unfinished():
                continue
            try:
                deltas = self.engine.step()
            except Exception as error:  # an engine bug: fail what is in flight, keep serving
                logger.exception("engine step failed")
                self._fail_all(EngineDeadError(f"engine step failed: {error}"))
                continue
            for delta in deltas:
                self._deliver(delta.request_id, delta)

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block)
            while True:
                self._handle(*item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            try:
                self.engine.add_request(payload)
            except ValueError as error:
                self._deliver(payload.request_id, error)
        elif kind == "abort":
            self.engine.abort_request(payload)
        elif kind == "call":
            fn, args, future = payload
            try:
                future.set_result(fn(*args))
            except Exception as error:  # handed to the caller, who raises it
                future.set_exception(error)

    def _deliver(self, request_id: str, item: RequestDelta | Exception) -> None:
        listener = self._listeners.get(request_id)
        if listener is None:
            return
        try:
            listener.loop.call_soon_threadsafe(listener.deltas.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone: nobody is listening
            self._listeners.pop(request_id, None)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            self._deliver(request_id, error)
