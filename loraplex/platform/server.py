"""`loraplex serve`: the platform on uvicorn, one process, the engine on its own thread."""

from __future__ import annotations

import logging
import signal
import sys

import uvicorn

from loraplex.platform.app import create_app
from loraplex.platform.demo import set_up_demo
from loraplex.platform.settings import Settings, admin_token
from loraplex.platform.state import Platform

logger = logging.getLogger(__name__)


def serve(settings: Settings, demo: bool = False) -> int:
    """Run until stopped (SIGINT/SIGTERM drain in-flight requests first). -> exit status."""
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

    app = create_app(settings, token, on_ready, on_failure)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.shutdown_grace_seconds) + 5,
    )
    server = uvicorn.Server(config)
    # uvicorn drains on SIGTERM/SIGINT, then raises the signal again into the handlers it found:
    # quiet ones make a drained stop exit 0, as orchestrators expect
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 1 if failed else 0
