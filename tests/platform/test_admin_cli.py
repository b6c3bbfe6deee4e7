"""`loraplex admin ...` against a running server, as an operator's script would use it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from openai import OpenAI

from tests.platform.servers import ADMIN_TOKEN


def admin(server, *args: str, token: str = ADMIN_TOKEN) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update(LORAPLEX_ADMIN_URL=server.url, LORAPLEX_ADMIN_TOKEN=token)
    return subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "admin", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def admin_json(server, *args: str):
    done = admin(server, "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_operator_workflow_from_the_command_line(server, adapter_root):
    tenant = admin_json(server, "tenants", "create", "cli-corp")
    assert tenant["name"] == "cli-corp"
    key = admin_json(server, "keys", "create", "--tenant", "cli-corp", "--rpm", "100")
    assert key["key"].startswith("lpx-") and key["requests_per_minute"] == 100
    adapter = admin_json(
        server,
        "adapters",
        "register",
        "cli-adapter",
        str(adapter_root / "alpha"),
        "--tenant",
        "cli-corp",
    )
    assert adapter["rank"] == 4 and adapter["tenant_id"] == tenant["id"]

    sdk = OpenAI(base_url=server.api, api_key=key["key"], max_retries=0)
    assert "cli-adapter" in {m.id for m in sdk.models.list()}

    table = admin(server, "adapters", "list", "--tenant", "cli-corp")
    assert table.returncode == 0
    header, row = table.stdout.splitlines()[:2]
    assert header.split()[:3] == ["id", "name", "tenant_id"]
    assert adapter["id"] in row and "cli-adapter" in row

    keys = admin(server, "keys", "list", "--tenant", tenant["id"])
    assert key["prefix"] in keys.stdout and key["key"] not in keys.stdout

    assert admin_json(server, "adapters", "delete", adapter["id"])["id"] == adapter["id"]
    assert admin_json(server, "keys", "revoke", key["id"])["revoked"] is True
    assert admin_json(server, "tenants", "disable", "cli-corp")["disabled"] is True


def test_errors_are_reported_readably(server, adapter_root):
    refused = admin(server, "adapters", "register", "x", str(adapter_root / "pickled"))
    assert refused.returncode == 2 and "400: " in refused.stderr
    assert "never unpickles" in refused.stderr
    wrong_token = admin(server, "tenants", "list", token="not-the-admin-token")
    assert wrong_token.returncode == 2 and "401" in wrong_token.stderr
    unknown = admin(server, "keys", "create", "--tenant", "nobody-of-that-name")
    assert "no tenant named 'nobody-of-that-name'" in unknown.stderr
