"""The FastAPI application: routes, error handlers, and the platform's life cycle."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema

from loraplex.platform.deps import PlatformDep
from loraplex.platform.errors import APIError, install_handlers
from loraplex.platform.routes import admin, openai
from loraplex.platform.settings import Settings
from loraplex.platform.state import Platform

logger = logging.getLogger(__name__)

OnReady = Callable[[Platform], Awaitable[None]]


def create_app(
    settings: Settings,
    admin_token: str,
    on_ready: OnReady | None = None,
    on_failure: Callable[[], None] | None = None,
) -> FastAPI:
    """`on_ready` runs once the engine and database are up; `on_failure` if they cannot be."""
    platform = Platform(settings=settings, admin_token=admin_token)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        starting = asyncio.create_task(_start(platform, on_ready, on_failure))
        try:
            yield
        finally:
            await asyncio.gather(starting, return_exceptions=True)
            await platform.stop()

    app = FastAPI(
        title="loraplex",
        summary="Multi-tenant LoRA serving with an OpenAI-compatible API",
        lifespan=lifespan,
    )
    app.state.platform = platform
    install_handlers(app)
    app.include_router(openai.router)
    app.include_router(admin.router)
    app.include_router(admin.vllm_router)
    app.add_api_route("/health", health, methods=["GET"], tags=["operations"])
    app.add_api_route("/ready", ready, methods=["GET"], tags=["operations"])
    app.openapi = lambda: _openapi(app)
    return app


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema, plus the bodies the hot routes parse themselves."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, definitions = models_json_schema(
            [(model, "validation") for model in openai.BODY_MODELS],
            ref_template="#/components/schemas/{model}",
        )
        schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema


async def _start(platform: Platform, on_ready: OnReady | None, on_failure) -> None:
    try:
        await platform.start()
        if on_ready is not None:
            await on_ready(platform)
    except Exception as error:
        logger.exception("start-up failed")
        platform.startup_error = f"start-up failed: {error}"
        if on_failure is not None:
            on_failure()


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
