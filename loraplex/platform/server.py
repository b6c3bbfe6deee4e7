"""`loraplex serve`: the platform on uvicorn, one process, the engine on its own thread.

A graceful stop (SIGTERM or SIGINT): the server keeps listening but refuses new work with 503
(and `/ready` turns 503, so a load balancer stops sending), lets the requests in flight finish
for up to `shutdown_grace_seconds`, then closes, writes every usage row and exits 0. A second
signal stops at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
import time

import uvicorn

from loraplex.platform.app import create_app
from loraplex.platform.demo import set_up_demo
from loraplex.platform.logs import configure as configure_logs
from loraplex.platform.settings import Settings, admin_token
from loraplex.platform.state import Platform

logger = logging.getLogger(__name__)


DRAIN_POLL_SECONDS = 0.05


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, platform: Platform) -> None:
        super().__init__(config)
        self.platform = platform
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.platform.draining:  # a second signal: stop now
            self.force_exit = True
        if self.platform.draining or self.loop is None or not self.platform.ready:
            super().handle_exit(sig, frame)
            return
        self.platform.draining = True
        logger.info("draining: %d requests in flight", self.platform.in_flight)
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.platform.settings.shutdown_grace_seconds
        while self.platform.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_SECONDS)
        if self.platform.in_flight:
            logger.warning("grace period over: %d requests cut", self.platform.in_flight)
        self.should_exit = True


def serve(settings: Settings, demo: bool = False) -> int:
    """Run until stopped (see the module's doc). -> exit status."""
    configure_logs("info" if demo else settings.log_level, settings.log_format)
    token, token_file = admin_token(settings, create=demo)
    failed = False

    def on_failure() -> None:
        nonlocal failed
        failed = True
        server.should_exit = True

    async def on_ready(platform: Platform) -> None:
        url = f"http://{settings.host}:{server.config.port}"
        lines = [f"loraplex is serving {platform.base_model} at {url}/v1"]
        lines.append(
            f"admin token: in {token_file}" if token_file else "admin token: from the settings"
        )
        if demo:
            info = await set_up_demo(platform)
            lines += [
                f"demo tenant '{info.tenant}', adapters: {', '.join(info.adapters) or 'none'}",
                f"demo API key (shown once): {info.key}",
            ]
        sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()
        # what start-up built (weights, tokenizer, imported modules) lives as long as this
        # process: frozen out of the collector, a full collection no longer walks it (one took
        # 200-280 ms with the tiny model, a stall for every request and the engine alike)
        gc.collect()
        gc.freeze()

    app = create_app(settings, token, on_ready, on_failure)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.shutdown_grace_seconds) + 5,
    )
    server = DrainingServer(config, app.state.platform)
    # uvicorn raises a signal it handled again into the handlers it found when it started:
    # quiet ones make a drained stop exit 0, as orchestrators expect
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 1 if failed else 0
