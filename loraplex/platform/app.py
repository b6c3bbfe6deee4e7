"""The FastAPI application: routes, error handlers, and the platform's life cycle."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

import loraplex.admin_ui
from loraplex.platform import openapi
from loraplex.platform.batches import CHAT, LEGACY, BatchRunner
from loraplex.platform.deps import PlatformDep
from loraplex.platform.errors import APIError, install_handlers
from loraplex.platform.metrics import CONTENT_TYPE
from loraplex.platform.middleware import RequestMiddleware
from loraplex.platform.routes import admin, batches, openai
from loraplex.platform.settings import Settings
from loraplex.platform.state import EngineFactory, Platform, local_engine

logger = logging.getLogger(__name__)

OnReady = Callable[[Platform], Awaitable[None]]
ADMIN_UI = Path(loraplex.admin_ui.__file__).parent  # static files, shipped in the wheel
# The page runs only its own files: no inline script, nothing from elsewhere.
ADMIN_PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


class App(FastAPI):
    """FastAPI with the request middleware outermost, around even the 500 handler, so that
    every reply carries its request id and every request is logged and counted."""

    def build_middleware_stack(self):
        return RequestMiddleware(super().build_middleware_stack(), self.state.platform)


class AdminPage(StaticFiles):
    """The admin page's static files, with headers that keep it to itself."""

    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers.update(ADMIN_PAGE_HEADERS)
        return response


def create_app(
    settings: Settings,
    admin_token: str,
    on_ready: OnReady | None = None,
    on_failure: Callable[[], None] | None = None,
    engine_factory: EngineFactory = local_engine,
    start_before_serving: bool = False,
) -> FastAPI:
    """`on_ready` runs once the engine and database are up; `on_failure` if they cannot be;
    `engine_factory` makes the engine (by default in this process). The app answers `/health`
    while they start, unless `start_before_serving` (for a host that routes to it only once
    its start-up is over, such as a Ray Serve replica)."""
    platform = Platform(settings=settings, admin_token=admin_token, engine_factory=engine_factory)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        starting = asyncio.create_task(_start(platform, on_ready, on_failure))
        if start_before_serving:
            await starting
        try:
            yield
        finally:
            await asyncio.gather(starting, return_exceptions=True)
            await platform.batches.close()  # its requests in flight run again on restart
            await platform.stop()

    app = App(
        title="loraplex",
        summary="Multi-tenant LoRA serving with an OpenAI-compatible API",
        lifespan=lifespan,
    )
    app.state.platform = platform
    platform.batches = BatchRunner(
        app,
        {CHAT: openai.chat_completions, LEGACY: openai.completions},
        settings.batch_concurrency,
        settings.batch_poll_seconds,
    )
    install_handlers(app)
    app.include_router(openai.router)
    app.include_router(batches.router)
    app.include_router(admin.router)
    app.include_router(admin.vllm_router)
    app.add_api_route("/health", health, methods=["GET"], tags=["operations"])
    app.add_api_route("/ready", ready, methods=["GET"], tags=["operations"])
    app.add_api_route(
        "/metrics",
        metrics,
        methods=["GET"],
        tags=["operations"],
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE: {}}, "description": "Prometheus metrics"}},
    )
    app.add_api_route("/admin", to_admin_page, methods=["GET"], include_in_schema=False)
    app.mount("/admin/", AdminPage(directory=ADMIN_UI, html=True), name="admin-page")
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        app.openapi_schema = openapi.build(app)
    return app.openapi_schema


async def _start(platform: Platform, on_ready: OnReady | None, on_failure) -> None:
    try:
        await platform.start()
        platform.batches.start()
        if on_ready is not None:
            await on_ready(platform)
    except Exception as error:
        logger.exception("start-up failed")
        platform.startup_error = f"start-up failed: {error}"
        if on_failure is not None:
            on_failure()


async def to_admin_page() -> RedirectResponse:
    return RedirectResponse("/admin/", status_code=308)


async def metrics(platform: PlatformDep) -> Response:
    """Prometheus metrics (text format)."""
    return Response(platform.metrics.render(), media_type=CONTENT_TYPE)


async def health() -> dict:
    """The process is alive (it may still be loading the model)."""
    return {"status": "ok"}


async def ready(platform: PlatformDep):
    """200 once the model is loaded, the engine steps and the database answers; 503 before,
    and while draining."""
    try:
        await platform.check_ready()
    except APIError as error:
        return error.response()
    return JSONResponse({"status": "ready", "model": platform.base_model})
