"""Around every HTTP request (pure ASGI, no per-request objects beyond a closure): a request id,
the client's `x-request-id` if it sent a sane one or a new one, echoed in the reply's header;
the request's line in the log and its count in the metrics once the last byte is sent; and the
count of requests in flight that a graceful stop waits for."""

from __future__ import annotations

import logging
import re
import time
import uuid

from loraplex.platform.logs import REQUEST_LOGGER
from loraplex.platform.metrics import UNRESOLVED
from loraplex.platform.state import Platform

request_log = logging.getLogger(REQUEST_LOGGER)
SANE_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
ADMIN_PAGE = "/admin/"


class RequestMiddleware:
    def __init__(self, app, platform: Platform) -> None:
        self.app = app
        self.platform = platform

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrived = time.perf_counter()
        request_id = _request_id(scope)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["arrived"] = arrived
        header = (b"x-request-id", request_id.encode())
        status = 500  # if nothing was sent at all

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        platform = self.platform
        platform.in_flight += 1
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            platform.in_flight -= 1
            self._record(scope, state, status, time.perf_counter() - arrived)

    def _record(self, scope, state: dict, status: int, seconds: float) -> None:
        route = getattr(scope.get("route"), "path", None)
        if route is None:
            route = ADMIN_PAGE if scope["path"].startswith(ADMIN_PAGE) else "unmatched"
        call = state.get("call")
        model = call.model_label if call is not None else UNRESOLVED
        self.platform.metrics.requests.labels(route, model, str(status)).inc()
        if not self.platform.settings.log_requests:
            return
        fields = {
            "request_id": state["request_id"],
            "method": scope["method"],
            "route": route,
            "status": status,
            "latency_ms": round(seconds * 1000, 2),
        }
        if call is not None:
            fields |= call.log_fields()
        request_log.info("request", extra=fields)


def _request_id(scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id" and SANE_REQUEST_ID.fullmatch(value):
            return value.decode()
    return uuid.uuid4().hex
