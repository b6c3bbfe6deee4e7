"""The admin page in a real browser (Debian's Chromium driven by Playwright) against a real
server on the tiny model: one server per test module, one browser per session, a fresh browser
context (so a fresh sessionStorage) per test, which fails on any script error the page makes
(see `open_page`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.factories import build_adapter
from tests.platform.servers import start_server
from tests.ui.admin_page import DESKTOP, open_page

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
DEMO_ADAPTERS = Path(__file__).resolve().parents[2] / "demo" / "adapters"

expect.set_options(timeout=15_000)  # two busy cores: leave room, the waits end as soon as met


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():  # Playwright's own browser download is not used
        pytest.fail(f"the UI tests need Chromium at {CHROMIUM}: apt-get install chromium")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def adapter_files(tmp_path_factory, tiny_llama) -> Path:
    """Adapter directories for the tiny model: a good one, a corrupt one, one for another base."""
    root = tmp_path_factory.mktemp("ui-adapters")
    build_adapter(tiny_llama, root / "good", rank=4, seed=21)
    shutil.copytree(root / "good", root / "corrupt")
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"\x07garbage" * 100)
    shutil.copytree(DEMO_ADAPTERS / "ahoy", root / "wrong-base")  # made for SmolLM2
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama, adapter_files):
    server = start_server(
        tiny_llama,
        tmp_path_factory.mktemp("ui-server"),
        adapter_roots=adapter_files,
        served_model_name="llama",
    )
    yield server
    server.stop()


@pytest.fixture
def page(browser, server) -> Iterator[Page]:
    yield from open_page(browser, server, DESKTOP)
