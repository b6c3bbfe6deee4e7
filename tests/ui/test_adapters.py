"""Adapters on the page: uploaded with a progress bar, refused with the reason next to the form,
registered from a path, pinned, unpinned and deleted."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.ui.admin_page import open_view, sign_in, upload_adapter


@pytest.fixture(scope="module")
def owner(server) -> str:
    server.tenant("wayne")
    return "wayne"


@pytest.fixture
def adapters_view(page, owner):
    sign_in(page)
    open_view(page, "adapters")
    return page


def test_upload_shows_progress_and_lists_the_adapter(adapters_view, owner, server, adapter_files):
    page = adapters_view
    page.locator("#upload-form").get_by_label("Owner").select_option(label=owner)
    upload_adapter(page, "uploaded-one", adapter_files / "good")

    row = page.locator("#adapter-rows tr", has_text="uploaded-one")
    expect(row).to_contain_text(owner)
    expect(row).to_contain_text("registered")
    expect(page.get_by_label("Upload", exact=True)).to_have_js_property("value", 100)
    expect(page.locator("#upload-percent")).to_have_text("100%")
    expect(page.locator("#upload-form").get_by_role("alert")).to_be_hidden()
    listed = {a["name"]: a for a in server.admin_ok("GET", "/adapters")["data"]}
    assert listed["uploaded-one"]["source_path"] == "upload"
    assert listed["uploaded-one"]["rank"] == 4


@pytest.mark.parametrize(
    ("directory", "reason"),
    [("corrupt", "not a readable safetensors file"), ("wrong-base", "the base model needs")],
)
def test_a_refused_upload_says_why_next_to_the_form(
    adapters_view, server, adapter_files, directory, reason
):
    page = adapters_view
    upload_adapter(page, f"refused-{directory}", adapter_files / directory)
    expect(page.locator("#upload-form").get_by_role("alert")).to_contain_text(reason)
    expect(page.locator("#adapter-rows")).not_to_contain_text(f"refused-{directory}")
    names = [a["name"] for a in server.admin_ok("GET", "/adapters")["data"]]
    assert f"refused-{directory}" not in names


def test_register_from_a_path_pin_unpin_and_delete(adapters_view, server, adapter_files):
    page = adapters_view
    form = page.locator("#path-form")
    form.get_by_label("Name").fill("from-path")
    form.get_by_label("Directory").fill(str(adapter_files / "missing"))
    form.get_by_role("button", name="Register").click()
    expect(form.get_by_role("alert")).to_contain_text("is not a directory")

    form.get_by_label("Directory").fill(str(adapter_files / "good"))
    form.get_by_role("button", name="Register").click()
    row = page.locator("#adapter-rows tr", has_text="from-path")
    expect(row).to_contain_text("shared")
    expect(form.get_by_role("alert")).to_be_hidden()

    page.get_by_role("button", name="Pin from-path").click()
    expect(row).to_contain_text("pinned")
    adapter = next(
        a for a in server.admin_ok("GET", "/adapters")["data"] if a["name"] == "from-path"
    )
    assert adapter["pinned"] and adapter["status"] == "pinned"

    page.get_by_role("button", name="Unpin from-path").click()
    expect(page.get_by_role("button", name="Pin from-path")).to_be_visible()
    expect(row).not_to_contain_text("pinned")

    page.get_by_role("button", name="Delete from-path").click()  # the confirmation is accepted
    expect(row).to_have_count(0)
    assert "from-path" not in [a["name"] for a in server.admin_ok("GET", "/adapters")["data"]]
