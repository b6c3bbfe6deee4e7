"""Settings: one object from flags, environment and file; bad values stop start-up by name."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from loraplex.platform.settings import SettingsError, admin_token, load_settings
from tests.platform.servers import start_server, wait_ready


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("LORAPLEX_"):
            monkeypatch.delenv(name)


def test_flags_beat_environment_beat_file(tmp_path, monkeypatch):
    config = tmp_path / "settings.toml"
    config.write_text('model = "from-file"\nport = 7000\n[engine]\nmax_num_seqs = 8\n')
    monkeypatch.setenv("LORAPLEX_MODEL", "from-env")
    monkeypatch.setenv("LORAPLEX_ENGINE__DTYPE", "bfloat16")
    monkeypatch.setenv("LORAPLEX_ADAPTER_ROOTS", "/a:/b")
    settings = load_settings(config, port=7100)
    assert (settings.model, settings.port) == ("from-env", 7100)
    assert (settings.engine.max_num_seqs, settings.engine.dtype) == (8, "bfloat16")
    assert settings.adapter_roots == ["/a", "/b"]


@pytest.mark.parametrize(
    ("file_text", "variables", "message"),
    [
        ("bogus = 1\n", {}, "bogus: unknown setting"),
        ("[engine]\npage_sise = 4\n", {}, "engine.page_sise: unknown setting"),
        ('port = "eighty"\n', {}, "port: Input should be a valid integer"),
        ("", {"LORAPLEX_PORTT": "80"}, "unknown environment variables: LORAPLEX_PORTT"),
        ("", {"LORAPLEX_MAX_WAITING_REQUESTS": "0"}, "max_waiting_requests"),
    ],
)
def test_unknown_keys_and_bad_values_name_themselves(
    tmp_path, monkeypatch, file_text, variables, message
):
    config = tmp_path / "settings.toml"
    config.write_text(file_text)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=message):
        load_settings(config)


@pytest.mark.parametrize("token", ["", "changeme", "short-token"])
def test_weak_admin_tokens_are_refused_outside_dev_mode(tmp_path, token):
    settings = load_settings(admin_token=token, data_dir=tmp_path)
    with pytest.raises(SettingsError, match="admin token"):
        admin_token(settings)
    assert admin_token(load_settings(admin_token=token, data_dir=tmp_path, dev_mode=True))


def test_demo_mode_generates_a_token_file_and_says_where(tmp_path):
    settings = load_settings(data_dir=tmp_path)
    with pytest.raises(SettingsError, match="no admin token"):
        admin_token(settings)
    token, source = admin_token(settings, create=True)
    assert source == tmp_path / "admin_token" and source.read_text().strip() == token
    assert source.stat().st_mode & 0o077 == 0  # readable by the owner only
    assert admin_token(settings) == (token, source)


def test_serve_refuses_to_start_with_a_bad_setting(tmp_path):
    env = {"LORAPLEX_DATA_DIR": str(tmp_path), "LORAPLEX_ENGINE__PAGE_SISE": "4", "PATH": ""}
    done = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "LORAPLEX_ENGINE__PAGE_SISE" in done.stderr


@pytest.mark.smollm2
def test_health_answers_at_once_and_ready_once_loaded(tmp_path, smollm2_dir):
    server = start_server(smollm2_dir, tmp_path, wait=False)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        loading = httpx.get(f"{server.url}/ready", timeout=2)  # SmolLM2 takes seconds to load
        assert loading.status_code == 503
        assert loading.json()["error"]["code"] == "starting"
        wait_ready(server)
        assert httpx.get(f"{server.url}/ready").json()["status"] == "ready"
    finally:
        assert server.stop() == 0
