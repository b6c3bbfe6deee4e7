"""The engine for servers: the step loop runs on its own thread; callers stream with

    async for delta in engine.generate(prompt, params):
        ...

Requests and aborts cross into the loop through a queue; deltas come back to each caller's event
loop with `call_soon_threadsafe`. The engine thread is the only one touching engine state.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from loraplex.engine.config import EngineConfig
from loraplex.engine.engine import LLMEngine
from loraplex.engine.outputs import Request, RequestDelta
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
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestDelta]:
        """Stream the request's deltas until it finishes. Raises ValueError for bad input before
        anything runs. Leaving the loop early (client gone) aborts the request."""
        request = self.engine.make_request(prompt, params, request_id)
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

    def _handle(self, kind: str, payload: Request | str | None) -> None:
        if kind == "add":
            try:
                self.engine.add_request(payload)
            except ValueError as error:
                self._deliver(payload.request_id, error)
        elif kind == "abort":
            self.engine.abort_request(payload)

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
