"""Real servers for the platform tests: `loraplex serve` in a subprocess on 127.0.0.1, configured
through the environment as an operator would, and a small admin client for it."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg

ADMIN_TOKEN = "test-admin-" + secrets.token_hex(12)
POSTGRES_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_URL = "redis://127.0.0.1:6379/0"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    data_dir: Path
    log: Path
    env: dict = field(default_factory=dict)

    @property
    def api(self) -> str:
        return f"{self.url}/v1"

    def admin(self, method: str, path: str, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        return httpx.request(
            method, f"{self.url}/admin/v1{path}", headers=headers, timeout=60, **kwargs
        )

    def admin_ok(self, method: str, path: str, **kwargs) -> dict:
        reply = self.admin(method, path, **kwargs)
        assert reply.status_code < 300, reply.text
        return reply.json()

    def tenant(self, name: str) -> str:
        return self.admin_ok("POST", "/tenants", json={"name": name})["id"]

    def key(self, tenant_id: str, **limits) -> str:
        return self.admin_ok("POST", f"/tenants/{tenant_id}/keys", json=limits)["key"]

    def register(self, name: str, path, tenant_id: str | None) -> dict:
        body = {"name": name, "path": str(path), "tenant_id": tenant_id}
        return self.admin_ok("POST", "/adapters", json=body)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(
    model_dir: Path,
    data_dir: Path,
    *,
    port: int | None = None,
    wait: bool = True,
    extra_args: tuple[str, ...] = (),
    **settings,
) -> Server:
    """Start `loraplex serve`; `settings` become LORAPLEX_* variables (engine__x for engine)."""
    port = port or free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update(
        LORAPLEX_MODEL=str(model_dir),
        LORAPLEX_DATA_DIR=str(data_dir),
        LORAPLEX_PORT=str(port),
        LORAPLEX_ADMIN_TOKEN=ADMIN_TOKEN,
        LORAPLEX_ENGINE__MEMORY_BUDGET="64MiB",
        LORAPLEX_ENGINE__DTYPE="float32",  # outputs compared with the float32 engine
    )
    env.update({f"LORAPLEX_{k.upper()}": str(v) for k, v in settings.items()})
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / f"server-{port}.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "loraplex.cli", "serve", *extra_args],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    server = Server(process, f"http://127.0.0.1:{port}", data_dir, log, env)
    if wait:
        wait_ready(server)
    return server


def wait_ready(server: Server, timeout: float = 300) -> None:
    """Until /ready answers 200; generous, for a machine slowed by its neighbours (a Ray
    cluster of four replicas on two cores takes most of a minute even on a quiet one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited:\n{server.output()[-3000:]}")
        try:
            if httpx.get(f"{server.url}/ready", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"the server did not get ready:\n{server.output()[-3000:]}")


def create_database() -> tuple[str, callable]:
    """A fresh PostgreSQL database on the local server -> (its URL, a function dropping it)."""
    name = f"loraplex_test_{os.getpid()}_{secrets.token_hex(4)}"
    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"postgresql://postgres@127.0.0.1:5432/{name}", drop
