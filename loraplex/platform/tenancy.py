"""Who is calling (API key -> tenant) and what `model` means to them (base model or adapter).

Both answers are cached in memory, so that the hot path does not touch the database, and kept
honest by a watcher: every registry change bumps one revision counter in the database (see
registry.audit), each server process polls it every `poll_seconds` and drops its caches when it
moves. So a revoked key, a disabled tenant or a deleted adapter is refused by every process
within one poll, and at once by the process that made the change (it calls `forget`). If the
watcher cannot read the revision, cached answers stop being used after two missed polls and
every request asks the database. Misses are cached too: an unknown key or name costs a query
once per change, not once per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from loraplex.engine.api import LoRARequest
from loraplex.platform import registry
from loraplex.platform.db.models import Adapter
from loraplex.platform.db.session import Database
from loraplex.platform.errors import APIError, invalid_api_key, model_not_found

logger = logging.getLogger(__name__)
_MISSING = object()
MAX_CACHED = 100_000  # per cache; past it the cache starts over (a flood of unknown keys)


@dataclass(frozen=True)
class Caller:
    key_id: str
    tenant_id: str
    tenant_name: str
    weight: float
    limits: registry.KeyLimits
    service_tier: str = "interactive"  # the key's default tier


@dataclass(frozen=True)
class Target:
    """What a request's `model` resolved to."""

    model: str  # as the caller named it
    adapter_id: str | None  # None: the base model
    lora: LoRARequest | None


class Directory:
    def __init__(self, db: Database, base_model: str, poll_seconds: float) -> None:
        self.db = db
        self.base_model = base_model
        self.poll_seconds = poll_seconds
        self._callers: dict[str, Any] = {}
        self._targets: dict[tuple[str, str], Any] = {}
        self._epoch = 0  # bumped each time the caches are dropped
        self._revision: int | None = None
        self._confirmed_at = float("-inf")  # when the watcher last read the revision
        self._watcher: asyncio.Task | None = None

    def start(self) -> None:
        self._watcher = asyncio.create_task(self._watch(), name="registry-watcher")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    def forget(self) -> None:
        """Drop every cached answer (after an admin change in this process)."""
        self._callers.clear()
        self._targets.clear()
        self._epoch += 1

    async def _watch(self) -> None:
        while True:
            try:
                revision = await self.db.run(registry.revision)
            except Exception as error:  # the database is away: lookups go to it (and fail)
                logger.warning("cannot read the registry revision: %s", error)
            else:
                if revision != self._revision:
                    self.forget()
                    self._revision = revision
                self._confirmed_at = time.monotonic()
            await asyncio.sleep(self.poll_seconds)

    async def _lookup(self, cache: dict, key, query: Callable[[Session], Any]) -> Any:
        if time.monotonic() - self._confirmed_at < 2 * self.poll_seconds:
            found = cache.get(key, _MISSING)
            if found is not _MISSING:
                return found
        epoch = self._epoch
        found = await self.db.run(query)
        # A change seen while the query ran may have come after it read: keep nothing then.
        if epoch == self._epoch:
            if len(cache) >= MAX_CACHED:
                cache.clear()
            cache[key] = found
        return found

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
        found = await self._lookup(self._callers, key_hash, lambda s: _caller(s, key_hash))
        if found is None:
            raise invalid_api_key()
        if found == "disabled":
            raise APIError(403, "This tenant is disabled.", code="tenant_disabled")
        return found

    async def resolve(self, caller: Caller, model: str) -> Target:
        """Raises APIError 404 (the same for another tenant's adapter as for a missing one)."""
        if model == self.base_model:
            return Target(model, None, None)
        tenant_id = caller.tenant_id
        adapter = await self._lookup(
            self._targets, (tenant_id, model), lambda s: _adapter(s, tenant_id, model)
        )
        if adapter is None:
            raise model_not_found(model)
        return Target(model, adapter.id, LoRARequest(adapter.id, adapter.storage_path))


def _bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return (value.strip() or None) if scheme.lower() == "bearer" else None


def _caller(session, key_hash: str) -> Caller | str | None:
    return caller_of(registry.key_with_tenant(session, key_hash))


def caller_by_key_id(session, key_id: str) -> Caller | str | None:
    """The caller a key stands for now: None if it is gone or revoked, "disabled" if its tenant
    is (for work done on its behalf later, such as a batch job)."""
    return caller_of(registry.key_with_tenant(session, key_id=key_id))


def caller_of(found) -> Caller | str | None:
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
            key.requests_per_minute,
            key.tokens_per_minute,
            key.max_concurrent,
            key.batch_tokens_per_day,
        ),
        service_tier=key.service_tier,
    )


def _adapter(session, tenant_id: str, name: str) -> Adapter | None:
    return registry.visible_adapter(session, tenant_id, name)
