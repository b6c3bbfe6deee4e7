"""What the UI tests do on the admin page, as a user would: sign in, open a view, look."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

from openai import OpenAI
from playwright.sync_api import Browser, Page, expect

from tests.platform.servers import ADMIN_TOKEN

DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
SCREENSHOTS = Path(__file__).resolve().parents[2] / "test-output" / "ui"
VIEW_TITLES = {
    "tenants": "Tenants",
    "keys": "API keys",
    "adapters": "Adapters",
    "engine": "Engine",
    "usage": "Usage",
}


def open_page(browser: Browser, server, viewport: dict, **options) -> Iterator[Page]:
    """A page in a fresh context (so a fresh sessionStorage) that accepts confirmations; the
    test fails on any uncaught script error and on any console error other than the browser's
    notice of a 4xx reply, which the page shows by design. So a Content-Security-Policy
    violation fails it too."""
    context = browser.new_context(base_url=server.url, viewport=viewport, **options)
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"uncaught: {error}"))
    page.on("console", lambda message: _note_console_error(message, problems))
    page.on("dialog", lambda dialog: dialog.accept())
    yield page
    context.close()
    assert not problems, problems


def _note_console_error(message, problems: list[str]) -> None:
    if message.type == "error" and not message.text.startswith("Failed to load resource"):
        problems.append(message.text)


def sign_in(page: Page, token: str = ADMIN_TOKEN) -> None:
    page.goto("/admin/")
    page.get_by_label("Admin token").fill(token)
    page.get_by_role("button", name="Sign in").click()


def open_view(page: Page, view: str) -> None:
    page.get_by_role("navigation", name="Views").get_by_role("link", name=VIEW_TITLES[view]).click()
    expect(page.get_by_role("heading", name=VIEW_TITLES[view], exact=True)).to_be_visible()


def upload_adapter(page: Page, name: str, directory: Path) -> None:
    form = page.locator("#upload-form")
    form.get_by_label("Name").fill(name)
    form.get_by_label("adapter_config.json").set_input_files(directory / "adapter_config.json")
    model_file = directory / "adapter_model.safetensors"
    form.get_by_label("adapter_model.safetensors").set_input_files(model_file)
    form.get_by_role("button", name="Upload and register").click()


def page_scrolls_sideways(page: Page) -> bool:
    return page.evaluate(
        "document.documentElement.scrollWidth > document.documentElement.clientWidth"
    )


def unlabelled_controls(page: Page) -> list[str]:
    """The visible form controls and buttons that have no accessible name."""
    return page.evaluate(
        """() => [...document.querySelectorAll("input, select, textarea, button, progress")]
            .filter((control) => control.checkVisibility())
            .filter((control) => {
              const label = [...(control.labels ?? [])].map((l) => l.textContent).join("")
                || control.getAttribute("aria-label")
                || (control.tagName === "BUTTON" ? control.textContent : "");
              return !label.trim();
            })
            .map((control) => control.outerHTML.slice(0, 120))"""
    )


def screenshot(page: Page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=SCREENSHOTS / f"{name}.png", full_page=True)


def wait_for_usage(server, tenant_id: str, requests: int, timeout: float = 10) -> None:
    """Until the server's usage rows (written in the background) count `requests` of a tenant."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        totals = server.admin_ok("GET", f"/usage?tenant_id={tenant_id}")["totals"]
        if sum(row["requests"] for row in totals) >= requests:
            return
        time.sleep(0.2)
    raise AssertionError(f"fewer than {requests} requests in the usage after {timeout} s")


class Load:
    """Completions sent back to back from a few threads until stopped (a context manager)."""

    def __init__(self, server, key: str, models: list[str], max_tokens: int = 400) -> None:
        self.sdk = OpenAI(base_url=server.api, api_key=key, max_retries=0)
        self.max_tokens = max_tokens
        self.stopping = threading.Event()
        self.failures: list[Exception] = []
        self.threads = [threading.Thread(target=self._run, args=(m,)) for m in models]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()
        for thread in self.threads:
            thread.join(timeout=60)
        assert not self.failures, self.failures

    def stop(self) -> None:
        """No new requests from now on; the ones running finish."""
        self.stopping.set()

    def _run(self, model: str) -> None:
        while not self.stopping.is_set():
            try:
                self.sdk.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": "the river runs"}],
                    max_tokens=self.max_tokens,
                    extra_body={"ignore_eos": True},
                )
            except Exception as error:  # reported by __exit__, in the test's thread
                self.failures.append(error)
                return
