"""Signing in with the admin token, which lives in the tab's sessionStorage only."""

from __future__ import annotations

from playwright.sync_api import expect

from tests.platform.servers import ADMIN_TOKEN
from tests.ui.admin_page import open_view, sign_in

WRONG_TOKEN = "not-the-admin-token-at-all"


def test_sign_in_keeps_the_token_in_this_tab_only(page, server):
    server.tenant("visible-after-sign-in")
    page.goto("/admin")  # redirected to /admin/
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    expect(page.get_by_role("navigation", name="Views")).to_be_hidden()

    sign_in(page)
    expect(page.get_by_role("heading", name="Tenants", exact=True)).to_be_visible()
    expect(page.locator("#tenant-rows")).to_contain_text("visible-after-sign-in")
    stored = page.evaluate("[sessionStorage.length, localStorage.length, document.cookie]")
    assert stored == [1, 0, ""]
    assert page.evaluate("Object.values(sessionStorage)") == [ADMIN_TOKEN]
    assert page.context.cookies() == []

    page.reload()  # the same tab keeps its session
    expect(page.locator("#tenant-rows")).to_contain_text("visible-after-sign-in")

    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    assert page.evaluate("sessionStorage.length") == 0


def test_a_wrong_token_shows_the_error_and_no_data(page, server):
    server.tenant("must-stay-hidden")
    sign_in(page, WRONG_TOKEN)
    error = page.locator("#sign-in-form").get_by_role("alert")
    expect(error).to_have_text("A valid admin token is required.")
    expect(page.get_by_role("navigation", name="Views")).to_be_hidden()
    expect(page.locator("#view-tenants")).to_be_hidden()
    assert "must-stay-hidden" not in page.content()
    assert page.evaluate("sessionStorage.length") == 0


def test_a_token_that_stops_working_brings_back_the_sign_in_form(page, server):
    sign_in(page)
    expect(page.get_by_role("heading", name="Tenants", exact=True)).to_be_visible()
    # as if the server's admin token were changed while the page is open
    page.evaluate(f"sessionStorage.setItem(sessionStorage.key(0), '{WRONG_TOKEN}')")
    page.get_by_role("navigation", name="Views").get_by_role("link", name="API keys").click()
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    expect(page.locator("#sign-in-error")).to_have_text("A valid admin token is required.")

    sign_in(page)
    open_view(page, "keys")
