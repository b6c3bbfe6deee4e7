"""The engine for servers: the step loop runs on its own thread; callers stream with

    async for delta in engine.generate(prompt, params):
        ...

Requests, aborts and adapter operations cross into the loop through a queue; deltas and results
come back to each caller's event loop thread-safely. The engine thread is the only one touching
engine state, and it never reads from disk: tokenizing, reading and validating adapters happen on
worker threads, off the event loop too.

Which call raises what (all are EngineError subclasses, each with a `code`):

    generate        InvalidRequestError / AdapterError before anything runs (bad input);
                    OverloadedError at once when too many requests wait for their first token;
                    RequestFailedError mid-stream when the request's output turns non-finite;
                    EngineShutdownError when shutting down (also mid-stream, past the grace);
                    EngineDeadError when the engine thread has failed
    load_adapter    AdapterError (unreadable, unservable, or no room to pin it)
    validate_adapter  AdapterError
    unpin_adapter, unload_adapter, pool_snapshot   EngineShutdownError, EngineDeadError
    check_health    EngineDeadError when the engine thread is gone or does not answer
    encode_chat     InvalidRequestError (no chat template, malformed messages)
    stats, model_info   nothing
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from loraplex.engine.adapters.manager import PoolSnapshot
from loraplex.engine.config import EngineConfig
from loraplex.engine.engine import LLMEngine, LoRARequest
from loraplex.engine.errors import (
    EngineDeadError,
    EngineError,
    EngineShutdownError,
    InvalidRequestError,
    OverloadedError,
)
from loraplex.engine.info import AdapterInfo, EngineStats, ModelInfo
from loraplex.engine.outputs import RequestDelta
from loraplex.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _Listener:
    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self._engine = LLMEngine(config)
        self._max_waiting = config.max_waiting_requests
        self._model_info = self._engine.model_info()
        self._stats = self._engine.stats()
        self._inbox: queue.Queue = queue.Queue()
        self._listeners: dict[str, _Listener] = {}
        self._lock = threading.Lock()  # guards the counters and flags below
        self._num_waiting = 0  # accepted, no output yet
        self._accepting = True
        self._closed = False  # the engine thread has stopped taking work
        self._dead: EngineDeadError | None = None
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    # -- requests ---------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora: LoRARequest | None = None,
        tag: object = None,
    ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas until it finishes; `tag` comes back on every delta.
        Leaving the loop early (client gone) aborts the request."""
        self._admit()
        waiting = True
        try:
            request = await asyncio.to_thread(
                self._engine.make_request, prompt, params, request_id, lora, tag
            )
            if request.request_id in self._listeners:
                raise InvalidRequestError(
                    f"request id {request.request_id!r} is already in flight", param="request_id"
                )
            listener = _Listener(asyncio.get_running_loop(), asyncio.Queue())
            self._listeners[request.request_id] = listener
            self._put("add", request)
            finished = False
            try:
                while not finished:
                    delta = await listener.deltas.get()
                    if isinstance(delta, Exception):
                        raise delta
                    if waiting:
                        self._stop_waiting()
                        waiting = False
                    if delta.error is not None:
                        finished = True
                        raise delta.error
                    finished = delta.finished
                    yield delta
            finally:
                self._listeners.pop(request.request_id, None)
                if not finished:
                    self.abort(request.request_id)
        finally:
            if waiting:
                self._stop_waiting()

    def _admit(self) -> None:
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if not self._accepting:
                raise EngineShutdownError("the engine is shutting down and takes no new requests")
            if self._max_waiting is not None and self._num_waiting >= self._max_waiting:
                raise OverloadedError(
                    f"{self._num_waiting} requests are waiting to start, the configured "
                    f"maximum ({self._max_waiting}): retry later"
                )
            self._num_waiting += 1

    def _stop_waiting(self) -> None:
        with self._lock:
            self._num_waiting -= 1

    def abort(self, request_id: str) -> None:
        self._put("abort", request_id, quiet=True)

    # -- adapters ---------------------------------------------------------------------------

    async def load_adapter(self, lora: LoRARequest, pin: bool = False) -> None:
        """Read and validate the adapter, and bring it into the pool if there is room (always,
        when pinned)."""
        ref = await asyncio.to_thread(self._engine.catalog.get, lora.adapter_id, lora.path)
        await self._on_engine_thread(self._engine.load_adapter_ref, ref, pin)

    async def validate_adapter(self, lora: LoRARequest) -> AdapterInfo:
        """Read and check the adapter; changes nothing."""
        return await asyncio.to_thread(self._engine.validate_adapter, lora)

    async def unpin_adapter(self, adapter_id: str) -> None:
        await self._on_engine_thread(self._engine.unpin_adapter, adapter_id)

    async def unload_adapter(self, adapter_id: str) -> None:
        """Forget the adapter; requests in flight with it still finish."""
        await self._on_engine_thread(self._engine.unload_adapter, adapter_id)

    async def pool_snapshot(self) -> PoolSnapshot:
        return await self._on_engine_thread(self._engine.pool_snapshot)

    # -- for the server ---------------------------------------------------------------------

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """The conversation through the model's chat template, as token ids. Any thread."""
        return self._engine.tokenizer.encode_chat(messages)

    def model_info(self) -> ModelInfo:
        return self._model_info

    def stats(self) -> EngineStats:
        """The counters as of the last step (never waits for the engine thread)."""
        return self._stats

    async def check_health(self, timeout: float = 5.0) -> None:
        """Returns once the engine thread has answered between two steps; raises
        EngineDeadError if it is gone, or wedged for `timeout` seconds."""
        if self._dead is not None or not self._thread.is_alive():
            raise self._dead or EngineDeadError("the engine thread is not running")
        try:
            await asyncio.wait_for(self._on_engine_thread(time.monotonic), timeout)
        except TimeoutError:
            raise EngineDeadError(
                f"the engine thread has not answered for {timeout:g} s: it is wedged"
            ) from None

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Stop taking requests; let those in flight finish for up to `grace_seconds`, then
        fail the rest (and pending adapter calls) with EngineShutdownError. Blocks; safe to call
        twice."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + grace_seconds
        while self._listeners and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        self._put("stop", None, quiet=True)
        self._thread.join(timeout=30)

    # -- crossing into the engine thread ----------------------------------------------------

    def _put(self, kind: str, payload, quiet: bool = False) -> None:
        with self._lock:
            if self._closed:
                if quiet:
                    return
                raise self._dead or EngineShutdownError("the engine has shut down")
            self._inbox.put((kind, payload))

    async def _on_engine_thread(self, fn: Callable, *args):
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put("call", (fn, args, future))
        return await asyncio.wrap_future(future)

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        error: EngineError = EngineShutdownError("the engine shut down before this finished")
        try:
            while self._take_inbox(block=not self._engine.has_unfinished()):
                if self._engine.has_unfinished():
                    self._step()
                self._stats = self._engine.stats()
        except Exception as failure:  # a bug outside the step: nothing can be trusted now
            logger.exception("the engine loop failed")
            error = EngineDeadError(f"the engine loop failed: {failure}")
            self._dead = error
        finally:
            self._close(error)

    def _step(self) -> None:
        try:
            deltas = self._engine.step()
        except Exception as failure:  # an engine bug: fail what is in flight, keep serving
            logger.exception("engine step failed")
            self._fail_all(EngineDeadError(f"engine step failed: {failure}"))
            return
        for delta in deltas:
            self._deliver(delta.request_id, delta)

    def _take_inbox(self, block: bool) -> bool:
        """Handle what arrived; False once asked to stop."""
        try:
            item = self._inbox.get(block=block)
            while True:
                if item[0] == "stop":
                    return False
                self._handle(*item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _handle(self, kind: str, payload) -> None:
        if kind == "add":
            try:
                self._engine.add_request(payload)
            except EngineError as error:
                self._deliver(payload.request_id, error)
        elif kind == "abort":
            self._engine.abort_request(payload)
        elif kind == "call":
            fn, args, future = payload
            if not future.set_running_or_notify_cancel():
                return  # the caller gave up waiting
            try:
                future.set_result(fn(*args))
            except Exception as error:  # handed to the caller, who raises it
                future.set_exception(error)

    def _close(self, error: EngineError) -> None:
        """Fail everything in flight or still queued: nobody is left to serve it."""
        with self._lock:
            self._closed = True
            self._accepting = False
        self._fail_all(error)
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._deliver(payload.request_id, error)
            elif kind == "call" and payload[2].set_running_or_notify_cancel():
                payload[2].set_exception(error)

    def _deliver(self, request_id: str, item: RequestDelta | Exception) -> None:
        listener = self._listeners.get(request_id)
        if listener is None:
            return
        try:
            listener.loop.call_soon_threadsafe(listener.deltas.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone: nobody is listening
            self._listeners.pop(request_id, None)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._engine.requests):
            self._engine.abort_request(request_id)
            self._deliver(request_id, error)
