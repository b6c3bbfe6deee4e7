"""The engine for servers: the step loop runs on its own thread; callers stream with

    async for delta in engine.generate(prompt, params):
        ...

Requests, aborts and adapter operations cross into the loop through a queue; deltas and results
come back to each caller's event loop thread-safely. The engine thread is the only one touching
engine state, and it never reads from disk: tokenizing, reading and validating adapters happen on
worker threads, off the event loop too.

Which call raises what (all are EngineError subclasses, each with a `code`):

    AsyncEngine(config)  ValueError / UnsupportedModelError for a bad config or checkpoint
    generate        InvalidRequestError / AdapterError before anything runs (bad input);
                    OverloadedError at once when too many requests wait for their first token;
                    RequestFailedError mid-stream when the request's output turns non-finite
                    (code non_finite_output) or an engine step failed (code engine_error);
                    EngineShutdownError when shutting down (also mid-stream, past the grace);
                    EngineDeadError when the engine thread has failed
    load_adapter    AdapterError (unreadable, unservable, too large to pin, pool busy:
                    code overloaded); EngineShutdownError, EngineDeadError
    validate_adapter  AdapterError
    unpin_adapter, unload_adapter, pool_snapshot   EngineShutdownError, EngineDeadError
    check_health    EngineDeadError when the engine thread is gone or does not answer;
                    EngineShutdownError after shutdown
    encode_chat, encode   InvalidRequestError (no chat template, malformed messages or text)
    stats, model_info, token_bytes, host_cached_adapters   nothing
    shutdown, aclose      nothing (what is in flight fails with EngineShutdownError)
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
    ErrorCode,
    InvalidRequestError,
    OverloadedError,
    RequestFailedError,
    fresh,
)
from loraplex.engine.fairness import Fairness
from loraplex.engine.front import Front, FrontMethods
from loraplex.engine.info import AdapterInfo, EngineStats, ModelInfo
from loraplex.engine.outputs import RequestDelta, merge_deltas
from loraplex.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

QUICK_PROMPT_TOKENS = 2048  # checked on the caller's thread up to this length
# how long an interactive request on its way in holds back steps of background work only
HOLD_SECONDS = 0.05


@dataclass
class _Listener:
    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue
    # set by the caller once it has the first delta of a request it does not stream: the engine
    # thread then adds the deltas up and wakes it once, when the request ends
    coalesce: bool = False
    held: RequestDelta | None = None  # the engine thread's sum so far (engine thread only)


class AsyncEngine(FrontMethods):
    """See the module's doc. Templating and tokenizing (`encode_chat`, `encode`, `prompt_ids`,
    `token_bytes`, any thread) come from FrontMethods, over the engine's own tokenizer."""

    def __init__(self, config: EngineConfig) -> None:
        self._engine = LLMEngine(config)
        self._max_waiting = config.max_waiting_requests
        self._model_info = self._engine.model_info()
        self.front = Front(self._engine.tokenizer, self._engine.model_config.vocab_size)
        self._stats = self._engine.stats()
        self._inbox: queue.Queue = queue.Queue()
        self._listeners: dict[str, _Listener] = {}
        self._lock = threading.Lock()  # guards the counters and flags below
        self._holds: dict[object, float] = {}  # see `hold_background`: token -> until
        self._num_waiting = 0  # accepted, no output yet
        self._accepting = True
        self._closed = False  # the engine thread has stopped taking work
        self._dead: EngineDeadError | None = None
        self._admitted: set[str] = set()  # requests the engine took and has not finished
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
        fairness: Fairness | None = None,
        stream: bool = True,
    ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas until it finishes; `tag` comes back on every delta;
        `fairness` says whom it is served for (engine/fairness.py). With `stream=False` the
        first delta comes as soon as it exists and the rest, added up, at the end (one wake-up
        of the caller's event loop instead of one a token). Leaving the loop early (client
        gone) aborts the request."""
        self._admit()
        waiting = True
        try:
            request = await self._make_request(prompt, params, request_id, lora, tag, fairness)
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
                    listener.coalesce = not stream
                    yield delta
            finally:
                self._listeners.pop(request.request_id, None)
                if not finished:
                    self.abort(request.request_id)
        finally:
            if waiting:
                self._stop_waiting()

    async def _make_request(self, prompt, params, request_id, lora, tag, fairness):
        """On a worker thread, unless it is quick: token ids (no tokenizing) and an adapter
        already in host memory (no disk read) are checked on the spot, sparing a thread hop."""
        adapter = self._engine.catalog.cached(lora.adapter_id, lora.path) if lora else None
        quick = isinstance(prompt, list) and len(prompt) <= QUICK_PROMPT_TOKENS
        constraint = params.structured_outputs if isinstance(params, SamplingParams) else None
        if constraint is not None:  # a compile may take long: not on the event loop
            quick = quick and self._engine.is_compiled(constraint)
        if quick and (lora is None or adapter is not None):
            return self._engine.make_request(
                prompt, params, request_id, lora, tag, adapter, fairness
            )
        return await asyncio.to_thread(
            self._engine.make_request, prompt, params, request_id, lora, tag, None, fairness
        )

    def _admit(self) -> None:
        with self._lock:
            if self._dead is not None:
                raise fresh(self._dead)
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

    def hold_background(self) -> Callable[[], None]:
        """For an interactive request being prepared (parsed, templated, tokenized): steps
        that would run background work only (the batch tier) wait until the returned release
        is called (its first token is out) or HOLD_SECONDS have passed, whichever is first.
        The cap keeps a slow or stuck caller from stopping background work."""
        token = object()
        with self._lock:
            self._holds[token] = time.monotonic() + HOLD_SECONDS

        def release() -> None:
            with self._lock:
                held = self._holds.pop(token, None)
            if held is not None and not self._closed:
                self._inbox.put(("wake", None))

        return release

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

    def host_cached_adapters(self) -> frozenset[str]:
        """Ids of the adapters held in host memory (read, not necessarily in the pool)."""
        return self._engine.catalog.cached_ids()

    # -- for the server ---------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        return self._model_info

    def stats(self) -> EngineStats:
        """The counters as of the last step (never waits for the engine thread)."""
        return self._stats

    async def check_health(self, timeout: float = 5.0) -> None:
        """Returns once the engine thread has answered between two steps; raises
        EngineDeadError if it is gone, or wedged for `timeout` seconds."""
        if self._dead is not None:
            raise fresh(self._dead)
        if not self._thread.is_alive():
            raise EngineDeadError("the engine thread is not running")
        try:
            await asyncio.wait_for(self._on_engine_thread(time.monotonic), timeout)
        except TimeoutError:
            raise EngineDeadError(
                f"the engine thread has not answered for {timeout:g} s: it is wedged"
            ) from None

    def shutdown(self, grace_seconds: float = 0.0) -> None:
        """Stop taking requests; let those in flight finish for up to `grace_seconds`, then
        fail the rest (and pending adapter calls) with EngineShutdownError. Blocks the calling
        thread (from an event loop, use `aclose`); safe to call twice."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + grace_seconds
        while self._busy() and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        self._put("stop", None, quiet=True)
        self._thread.join(timeout=30)

    async def aclose(self, grace_seconds: float = 0.0) -> None:
        """`shutdown` without blocking the event loop (streams keep flowing meanwhile)."""
        await asyncio.to_thread(self.shutdown, grace_seconds)

    def _busy(self) -> bool:
        return bool(self._admitted) or not self._inbox.empty()

    # -- crossing into the engine thread ----------------------------------------------------

    def _put(self, kind: str, payload, quiet: bool = False) -> None:
        with self._lock:
            if self._closed:
                if quiet:
                    return
                if self._dead is not None:
                    raise fresh(self._dead)
                raise EngineShutdownError("the engine has shut down")
            self._inbox.put((kind, payload))

    async def _on_engine_thread(self, fn: Callable, *args):
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put("call", (fn, args, future))
        return await asyncio.wrap_future(future)

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        error: EngineError = EngineShutdownError("the engine shut down before this finished")
        try:
            while True:
                hold = self._hold_left()
                if not self._take_inbox(hold > 0 or not self._engine.has_unfinished(), hold):
                    break
                if hold <= 0 and self._engine.has_unfinished():
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
            self._fail_all(
                RequestFailedError(f"an engine step failed: {failure}", ErrorCode.STEP_FAILED)
            )
            return
        for delta in deltas:
            self._deliver(delta.request_id, delta)
            if delta.finished:
                self._admitted.discard(delta.request_id)

    def _hold_left(self) -> float:
        """Seconds background work should still wait for an interactive arrival; 0 if none."""
        with self._lock:
            if not self._holds:
                return 0.0
            left = max(self._holds.values()) - time.monotonic()
            if left <= 0:
                self._holds.clear()  # all past their time (a release never called leaks none)
                return 0.0
        return left if self._engine.only_background() else 0.0

    def _take_inbox(self, block: bool, timeout: float = 0.0) -> bool:
        """Handle what arrived (waiting up to `timeout` if blocking, or for ever with 0); False
        once asked to stop."""
        try:
            item = self._inbox.get(block=block, timeout=timeout or None)
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
                return
            self._admitted.add(payload.request_id)
        elif kind == "abort":
            self._engine.abort_request(payload)
            self._admitted.discard(payload)
        elif kind == "wake":
            pass  # an arrival ended: look again at what may run
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
        try:
            self._fail_all(error)
        finally:
            while True:
                try:
                    kind, payload = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    self._deliver(payload.request_id, fresh(error))
                elif kind == "call" and payload[2].set_running_or_notify_cancel():
                    payload[2].set_exception(fresh(error))

    def _deliver(self, request_id: str, item: RequestDelta | Exception) -> None:
        listener = self._listeners.get(request_id)
        if listener is None:
            return
        if isinstance(item, RequestDelta):
            if listener.held is not None:
                item, listener.held = merge_deltas(listener.held, item), None
            if listener.coalesce and not item.finished and item.error is None:
                listener.held = item
                return
        try:
            listener.loop.call_soon_threadsafe(listener.deltas.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone: nobody is listening
            self._listeners.pop(request_id, None)

    def _fail_all(self, error: EngineError) -> None:
        """Every request the engine took and has not finished fails with (a copy of) `error`,
        even if aborting one of them fails too."""
        for request_id in list(self._admitted):
            try:
                self._engine.abort_request(request_id)
            except Exception:
                logger.exception("aborting request %s failed", request_id)
            self._deliver(request_id, fresh(error))
        self._admitted.clear()
