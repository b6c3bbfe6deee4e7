"""Tenants and their API keys: created on the page, the secret shown once, then only a prefix."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI
from playwright.sync_api import expect

from tests.ui.admin_page import open_view, sign_in


def test_create_and_disable_a_tenant(page, server):
    sign_in(page)
    form = page.locator("#tenant-form")
    form.get_by_label("Name").fill("initech")
    form.get_by_role("button", name="Create tenant").click()
    row = page.locator("#tenant-rows tr", has_text="initech")
    expect(row).to_contain_text("active")
    assert "initech" in [t["name"] for t in server.admin_ok("GET", "/tenants")["data"]]

    page.get_by_role("button", name="Disable tenant initech").click()
    expect(row).to_contain_text("disabled")
    expect(page.get_by_role("button", name="Enable tenant initech")).to_be_visible()

    form.get_by_label("Name").fill("initech")  # taken: the server refuses, the page says why
    form.get_by_role("button", name="Create tenant").click()
    expect(form.get_by_role("alert")).to_contain_text("initech")
    expect(form.get_by_label("Name")).to_have_attribute("aria-invalid", "true")


def test_a_key_is_shown_once_and_then_listed_by_prefix(page, server):
    tenant_id = server.tenant("hooli")
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    sign_in(page)
    open_view(page, "keys")
    form = page.locator("#key-form")
    form.get_by_label("Tenant").select_option(label="hooli")
    form.get_by_label("Key name").fill("ci")
    form.get_by_label("Requests per minute").fill("120")
    form.get_by_label("Concurrent requests").fill("4")
    form.get_by_label("Tier").select_option("batch")
    form.get_by_label("Batch tokens per day").fill("50000")
    form.get_by_role("button", name="Create key").click()

    secret_box = page.get_by_label("The new API key")
    expect(secret_box).to_be_visible()
    secret = secret_box.input_value()
    assert secret.startswith("lpx-")
    page.get_by_role("button", name="Copy").click()
    expect(page.locator("#key-secret-status")).to_have_text("Copied to the clipboard.")
    assert page.evaluate("navigator.clipboard.readText()") == secret
    assert OpenAI(base_url=server.api, api_key=secret, max_retries=0).models.list().data

    prefix = secret[:12]
    row = page.locator("#key-rows tr", has_text=prefix)
    expect(row).to_contain_text("hooli")
    expect(row).to_contain_text("120 requests/min, 4 at once, 50,000 batch tokens/day, batch tier")

    open_view(page, "tenants")  # leaving the view drops the secret
    open_view(page, "keys")
    expect(secret_box).to_be_hidden()
    expect(row).to_be_visible()
    assert secret not in page.content()
    page.reload()
    expect(row).to_be_visible()
    assert secret not in page.content()

    page.locator("#key-filter").select_option(label="hooli")
    expect(page.locator("#key-rows tr")).to_have_count(1)
    page.get_by_role("button", name=f"Revoke key {prefix}").click()
    expect(row).to_contain_text("revoked")
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=server.api, api_key=secret, max_retries=0).models.list()
    assert server.admin_ok("GET", f"/keys?tenant_id={tenant_id}")["data"][0]["revoked"]


def test_a_refused_key_shows_the_reason_next_to_the_form(page, server):
    server.tenant("umbrella")
    sign_in(page)
    open_view(page, "keys")
    form = page.locator("#key-form")
    form.get_by_label("Tenant").select_option(label="umbrella")
    # past the server's 128 characters, with the field's own limit lifted
    form.get_by_label("Key name").evaluate("field => field.removeAttribute('maxlength')")
    form.get_by_label("Key name").fill("x" * 129)
    form.get_by_role("button", name="Create key").click()
    expect(form.get_by_role("alert")).to_contain_text("name")
    expect(page.get_by_label("The new API key")).to_be_hidden()
