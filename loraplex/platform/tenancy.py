"""Who is calling (API key -> tenant) and what `model` means to them (base model or adapter).

Both answers are cached for at most `ttl` seconds (under a second): a revoked key, a disabled
tenant or a deleted adapter is refused by every server process within that time, and at once by
the process that made the change (it clears its caches). Misses are cached too, so that unknown
keys and names cost a database query at most once per `ttl`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from loraplex.engine.api import LoRARequest
from loraplex.platform import registry
from loraplex.platform.db.models import Adapter
from loraplex.platform.db.session import Database
from loraplex.platform.errors import APIError, invalid_api_key, model_not_found

_MISSING = object()


@dataclass(frozen=True)
class Caller:
    key_id: str
    tenant_id: str
    tenant_name: str
    weight: float
    limits: registry.KeyLimits


@dataclass(frozen=True)
class Target:
    """What a request's `model` resolved to."""

    model: str  # as the caller named it
    adapter_id: str | None  # None: the base model
    lora: LoRARequest | None


class TtlCache:
    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._entries: dict[Any, tuple[float, Any]] = {}

    def get(self, key) -> Any:
        entry = self._entries.get(key)
        if entry is None or entry[0] < time.monotonic():
            return _MISSING
        return entry[1]

    def put(self, key, value) -> None:
        if len(self._entries) > 100_000:
            self._entries.clear()
        self._entries[key] = (time.monotonic() + self.ttl, value)

    def clear(self) -> None:
        self._entries.clear()


class Directory:
    def __init__(self, db: Database, base_model: str, ttl: float) -> None:
        self.db = db
        self.base_model = base_model
        self._callers = TtlCache(ttl)
        self._targets = TtlCache(ttl)

    def forget(self) -> None:
        """Drop every cached answer (after an admin change in this process)."""
        self._callers.clear()
        self._targets.clear()

    async def authenticate(self, authorization: str | None) -> Caller:
        """Raises APIError: 401 for a missing, unknown or revoked key; 403 for a disabled
        tenant."""
        secret = _bearer(authorization)
        if secret is None:
            raise APIError(
                401,
                "You didn't provide an API key. Provide it in the Authorization header "
                "(Authorization: Bearer YOUR_KEY).",
                code="missing_api_key",
            )
        key_hash = registry.hash_key(secret)
        found = self._callers.get(key_hash)
        if found is _MISSING:
            found = await self.db.run(lambda s: _caller(s, key_hash))
            self._callers.put(key_hash, found)
        if found is None:
            raise invalid_api_key()
        if found == "disabled":
            raise APIError(403, "This tenant is disabled.", code="tenant_disabled")
        return found

    async def resolve(self, caller: Caller, model: str) -> Target:
        """Raises APIError 404 (the same for another tenant's adapter as for a missing one)."""
        if model == self.base_model:
            return Target(model, None, None)
        cache_key = (caller.tenant_id, model)
        adapter = self._targets.get(cache_key)
        if adapter is _MISSING:
            adapter = await self.db.run(lambda s: _adapter(s, caller.tenant_id, model))
            self._targets.put(cache_key, adapter)
        if adapter is None:
            raise model_not_found(model)
        return Target(model, adapter.id, LoRARequest(adapter.id, adapter.storage_path))


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return (value.strip() or None) if scheme.lower() == "bearer" else None


def _caller(session, key_hash: str) -> Caller | str | None:
    found = registry.key_with_tenant(session, key_hash)
    if found is None or found[0].revoked_at is not None:
        return None
    key, tenant = found
    if tenant.disabled:
        return "disabled"
    return Caller(
        key_id=key.id,
        tenant_id=tenant.id,
        tenant_name=tenant.name,
        weight=tenant.weight,
        limits=registry.KeyLimits(
            key.requests_per_minute, key.tokens_per_minute, key.max_concurrent
        ),
    )


def _adapter(session, tenant_id: str, name: str) -> Adapter | None:
    return registry.visible_adapter(session, tenant_id, name)
