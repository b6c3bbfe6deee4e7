"""Every view at a desktop's 1280 px and a phone's 390 px: nothing scrolls the page sideways
(wide tables scroll inside their own box) and every control has a name a screen reader can say.
Screenshots go to test-output/ui/."""

from __future__ import annotations

import pytest
from openai import OpenAI
from playwright.sync_api import expect

from tests.ui.admin_page import (
    DESKTOP,
    PHONE,
    VIEW_TITLES,
    open_page,
    open_view,
    page_scrolls_sideways,
    screenshot,
    sign_in,
    unlabelled_controls,
    wait_for_usage,
)


@pytest.fixture(scope="module")
def seeded(server, adapter_files):
    """Rows in every table: tenants, keys with and without limits, a pinned adapter, usage."""
    tenant = server.tenant("acme-corporation-with-a-long-name")
    server.tenant("globex")
    key = server.key(tenant, requests_per_minute=600, tokens_per_minute=100_000, max_concurrent=8)
    server.key(tenant)
    adapter = server.register("acme/support-assistant-v2", adapter_files / "good", tenant)
    server.admin_ok("POST", f"/adapters/{adapter['id']}/pin")
    sdk = OpenAI(base_url=server.api, api_key=key, max_retries=0)
    for model in ("llama", "acme/support-assistant-v2"):
        sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8
        )
    wait_for_usage(server, tenant, requests=2)
    return server


@pytest.fixture(params=[DESKTOP, PHONE], ids=["1280", "390"])
def sized_page(request, browser, seeded):
    options = {"is_mobile": True, "has_touch": True} if request.param == PHONE else {}
    yield from open_page(browser, seeded, request.param, **options)


def test_every_view_fits_the_width(sized_page):
    page = sized_page
    width = page.viewport_size["width"]
    page.goto("/admin/")
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    assert not page_scrolls_sideways(page)
    assert unlabelled_controls(page) == []
    screenshot(page, f"sign-in-{width}")

    sign_in(page)
    for view in VIEW_TITLES:
        open_view(page, view)
        expect(page.locator(f"#view-{view} tbody tr").first).to_be_visible()
        if view == "engine":
            expect(page.locator("#engine-rate")).not_to_have_text("–")  # two polls done
        if view == "usage":
            expect(page.locator("#usage-rows")).to_contain_text("acme-corporation")
            expect(page.locator("#usage-chart canvas").first).to_be_visible()
        assert not page_scrolls_sideways(page), f"{view} scrolls sideways at {width} px"
        assert unlabelled_controls(page) == [], view
        screenshot(page, f"{view}-{width}")

    open_view(page, "keys")  # with the one-time secret on show
    form = page.locator("#key-form")
    form.get_by_label("Tenant").select_option(label="globex")
    form.get_by_role("button", name="Create key").click()
    expect(page.get_by_label("The new API key")).to_be_visible()
    assert not page_scrolls_sideways(page)
    screenshot(page, f"keys-secret-{width}")
