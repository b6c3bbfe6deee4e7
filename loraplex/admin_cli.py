"""`loraplex admin ...`: the admin REST API from the command line, against a running server.

The server's URL comes from --url or LORAPLEX_ADMIN_URL (default http://127.0.0.1:8000), the
token from --token, LORAPLEX_ADMIN_TOKEN, or the token file in the data dir. Replies print as
tables, or as the API's JSON with --json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


class AdminError(ValueError):
    """The server refused, or could not be reached; the message says which."""


def add_admin_commands(commands) -> None:
    admin = commands.add_parser("admin", help="administer a running server")
    admin.add_argument("--url", help=f"server URL (LORAPLEX_ADMIN_URL, default {DEFAULT_URL})")
    admin.add_argument("--token", help="admin token (LORAPLEX_ADMIN_TOKEN, or the token file)")
    admin.add_argument("--json", action="store_true", help="print the API's JSON")
    groups = admin.add_subparsers(required=True, metavar="what")
    _tenant_commands(groups)
    _key_commands(groups)
    _adapter_commands(groups)
    usage = groups.add_parser("usage", help="requests and tokens per tenant or adapter")
    usage.add_argument("--window", type=int, default=3600, help="seconds back (default 3600)")
    usage.add_argument("--by", choices=["tenant", "adapter"], default="tenant")
    usage.set_defaults(func=_usage)
    engine = groups.add_parser("engine", help="engine and pool statistics")
    engine.set_defaults(func=lambda a: _show(a, _call(a, "GET", "/engine")))


def _tenant_commands(groups) -> None:
    tenants = groups.add_parser("tenants", help="tenants").add_subparsers(
        required=True, metavar="action"
    )
    create = tenants.add_parser("create", help="create a tenant")
    create.add_argument("name")
    create.add_argument("--weight", type=float, help="share of the engine under load")
    create.set_defaults(
        func=lambda a: _show(
            a, _call(a, "POST", "/tenants", _body(name=a.name, weight=a.weight)), _TENANT
        )
    )
    tenants.add_parser("list", help="list tenants").set_defaults(
        func=lambda a: _show(a, _call(a, "GET", "/tenants"), _TENANT)
    )
    for action, disabled in (("disable", True), ("enable", False)):
        command = tenants.add_parser(action, help=f"{action} a tenant (id or name)")
        command.add_argument("tenant")
        command.set_defaults(
            func=lambda a, d=disabled: _show(
                a,
                _call(a, "PATCH", f"/tenants/{_tenant_id(a, a.tenant)}", {"disabled": d}),
                _TENANT,
            )
        )


def _key_commands(groups) -> None:
    keys = groups.add_parser("keys", help="API keys").add_subparsers(
        required=True, metavar="action"
    )
    create = keys.add_parser("create", help="create a key (its secret is shown once)")
    create.add_argument("--tenant", required=True, help="tenant id or name")
    create.add_argument("--name", default="default")
    create.add_argument("--rpm", type=int, help="requests per minute")
    create.add_argument("--tpm", type=int, help="tokens per minute")
    create.add_argument("--concurrency", type=int, help="concurrent requests")
    create.add_argument(
        "--service-tier",
        choices=("interactive", "batch"),
        help="the tier its requests run at unless they say otherwise (default interactive)",
    )
    create.add_argument(
        "--batch-tokens-per-day", type=int, help="tokens its batch jobs may use per UTC day"
    )
    create.set_defaults(func=_create_key)
    listing = keys.add_parser("list", help="list keys (by display prefix)")
    listing.add_argument("--tenant", help="tenant id or name")
    listing.set_defaults(func=_list_keys)
    revoke = keys.add_parser("revoke", help="revoke a key")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=lambda a: _show(a, _call(a, "DELETE", f"/keys/{a.key_id}"), _KEY))


def _adapter_commands(groups) -> None:
    adapters = groups.add_parser("adapters", help="LoRA adapters").add_subparsers(
        required=True, metavar="action"
    )
    register = adapters.add_parser("register", help="register an adapter from a server path")
    register.add_argument("name")
    register.add_argument("path")
    register.add_argument("--tenant", help="owner (id or name); shared when left out")
    register.set_defaults(func=_register)
    upload = adapters.add_parser("upload", help="upload a local adapter directory")
    upload.add_argument("name")
    upload.add_argument("directory", type=Path)
    upload.add_argument("--tenant", help="owner (id or name); shared when left out")
    upload.set_defaults(func=_upload)
    listing = adapters.add_parser("list", help="list adapters with their residency")
    listing.add_argument("--tenant", help="tenant id or name")
    listing.set_defaults(func=_list_adapters)
    for action, method, suffix in (
        ("get", "GET", ""),
        ("delete", "DELETE", ""),
        ("pin", "POST", "/pin"),
        ("unpin", "POST", "/unpin"),
    ):
        command = adapters.add_parser(action, help=f"{action} an adapter by id")
        command.add_argument("adapter_id")
        command.set_defaults(
            func=lambda a, m=method, s=suffix: _show(
                a, _call(a, m, f"/adapters/{a.adapter_id}{s}"), _ADAPTER
            )
        )


# -- actions -----------------------------------------------------------------------------------

_TENANT = ("id", "name", "disabled", "weight")
_KEY = (
    "id",
    "tenant_id",
    "name",
    "prefix",
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent",
    "service_tier",
    "revoked",
)
_ADAPTER = ("id", "name", "tenant_id", "rank", "status", "pinned", "content_hash")


def _create_key(args) -> int:
    body = _body(
        name=args.name,
        requests_per_minute=args.rpm,
        tokens_per_minute=args.tpm,
        max_concurrent=args.concurrency,
        batch_tokens_per_day=args.batch_tokens_per_day,
        service_tier=args.service_tier,
    )
    key = _call(args, "POST", f"/tenants/{_tenant_id(args, args.tenant)}/keys", body)
    if args.json:
        return _show(args, key)
    _show(args, key, _KEY)
    print(f"\nsecret (shown once, store it now): {key['key']}")
    return 0


def _list_keys(args) -> int:
    query = {"tenant_id": _tenant_id(args, args.tenant)} if args.tenant else None
    return _show(args, _call(args, "GET", "/keys", params=query), _KEY)


def _register(args) -> int:
    tenant = _tenant_id(args, args.tenant) if args.tenant else None
    body = {"name": args.name, "path": args.path, "tenant_id": tenant}
    return _show(args, _call(args, "POST", "/adapters", body), _ADAPTER)


def _upload(args) -> int:
    tenant = _tenant_id(args, args.tenant) if args.tenant else ""
    files = {
        name: (name + ext, (args.directory / (name + ext)).read_bytes())
        for name, ext in (("adapter_config", ".json"), ("adapter_model", ".safetensors"))
    }
    reply = _call(
        args, "POST", "/adapters/upload", data={"name": args.name, "tenant_id": tenant}, files=files
    )
    return _show(args, reply, _ADAPTER)


def _list_adapters(args) -> int:
    query = {"tenant_id": _tenant_id(args, args.tenant)} if args.tenant else None
    return _show(args, _call(args, "GET", "/adapters", params=query), _ADAPTER)


def _usage(args) -> int:
    reply = _call(args, "GET", "/usage", params={"window": args.window, "group_by": args.by})
    if args.json:
        return _show(args, reply)
    return _show(
        args,
        {"data": reply["totals"]},
        ("id", "requests", "prompt_tokens", "completion_tokens", "errors"),
    )


# -- plumbing ----------------------------------------------------------------------------------


def _body(**fields) -> dict:
    return {k: v for k, v in fields.items() if v is not None}


def _tenant_id(args, tenant: str) -> str:
    if tenant.startswith("tnt_"):
        return tenant
    for row in _call(args, "GET", "/tenants")["data"]:
        if row["name"] == tenant:
            return row["id"]
    raise AdminError(f"no tenant named {tenant!r}")


def _token(args) -> str:
    token = args.token or os.environ.get("LORAPLEX_ADMIN_TOKEN")
    if token:
        return token
    from loraplex.platform.settings import TOKEN_FILE, load_settings

    path = load_settings().data_dir / TOKEN_FILE
    if path.is_file():
        return path.read_text().strip()
    raise AdminError("no admin token: pass --token or set LORAPLEX_ADMIN_TOKEN")


def _call(args, method: str, path: str, json_body=None, **kwargs) -> dict:
    url = (args.url or os.environ.get("LORAPLEX_ADMIN_URL") or DEFAULT_URL).rstrip("/")
    try:
        reply = httpx.request(
            method,
            f"{url}/admin/v1{path}",
            json=json_body,
            headers={"Authorization": f"Bearer {_token(args)}"},
            timeout=60,
            **kwargs,
        )
    except httpx.HTTPError as error:
        raise AdminError(f"cannot reach {url}: {error}") from None
    if reply.status_code >= 400:
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text
        raise AdminError(f"{reply.status_code}: {message}")
    return reply.json()


def _show(args, reply: dict, columns: tuple[str, ...] = ()) -> int:
    if args.json or not columns:
        print(json.dumps(reply, indent=2))
        return 0
    rows = reply.get("data", [reply])
    table = [list(columns)] + [
        ["" if r.get(c) is None else str(r.get(c)) for c in columns] for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    for row in table:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    return 0
