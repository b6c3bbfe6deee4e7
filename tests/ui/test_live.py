"""The live engine view follows requests as they run, and the usage view charts them after."""

from __future__ import annotations

import re

from playwright.sync_api import expect

from tests.ui.admin_page import Load, open_view, sign_in, wait_for_usage

NONZERO = re.compile(r"^[1-9]")  # a formatted number that is not 0 (nor "–", nothing yet)


def test_the_engine_view_follows_running_requests(page, server, adapter_files):
    tenant = server.tenant("stark")
    key = server.key(tenant)
    server.register("stark-voice", adapter_files / "good", tenant)
    sign_in(page)
    open_view(page, "engine")
    running, rate = page.locator("#engine-running"), page.locator("#engine-rate")
    generated = page.locator("#engine-generated")
    expect(running).to_have_text("0")
    expect(rate).to_have_text("0")  # a second poll: the rate needs two
    before = generated.inner_text()

    with Load(server, key, ["llama", "llama", "stark-voice"]):
        expect(running).to_have_text(NONZERO)
        expect(rate).to_have_text(NONZERO)
        expect(generated).not_to_have_text(before)
        expect(page.locator("#pool-kv")).to_have_text(NONZERO)
        expect(page.locator("#pool-adapters")).to_have_text(NONZERO)
        expect(page.locator("#resident-rows")).to_contain_text("stark-voice")
        expect(page.locator("#engine-chart canvas").first).to_be_visible()

    expect(running).to_have_text("0")
    expect(rate).to_have_text("0")


def test_usage_per_tenant_and_per_adapter(page, server, adapter_files):
    tenant = server.tenant("wonka")
    key = server.key(tenant)
    server.register("wonka-bar", adapter_files / "good", tenant)
    with Load(server, key, ["wonka-bar"], max_tokens=5) as load:
        wait_for_usage(server, tenant, requests=3)
        load.stop()
    sign_in(page)
    open_view(page, "usage")
    wonka = page.locator("#usage-rows tr", has_text="wonka")
    expect(wonka.locator("td").nth(1)).to_have_text(NONZERO)  # requests
    expect(page.locator("#usage-chart canvas").first).to_be_visible()
    expect(page.locator("#usage-chart")).to_contain_text("wonka")  # the chart's legend

    page.get_by_label("Per", exact=True).select_option("adapter")
    expect(page.get_by_role("columnheader", name="Adapter")).to_be_visible()
    expect(page.locator("#usage-rows tr", has_text="wonka-bar")).to_be_visible()
    page.get_by_label("Over the", exact=True).select_option(label="last day")
    page.get_by_label("Show", exact=True).select_option("requests")
    expect(page.locator("#usage-rows tr", has_text="wonka-bar")).to_be_visible()
    expect(page.locator("#usage-error")).to_be_hidden()
