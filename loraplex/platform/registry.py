"""The registry's operations, one function per question or change, each on a given Session.

Routes stay thin: they call these through `Database.run`, which gives each call its own
transaction on a worker thread.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import case, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from loraplex.platform.db.models import (
    SHARED_SCOPE,
    Adapter,
    ApiKey,
    AuditEntry,
    RegistryRevision,
    Tenant,
    Usage,
)

KEY_PREFIX = "lpx-"
DISPLAY_PREFIX_LENGTH = 12  # "lpx-" and 8 characters of the secret


class Conflict(ValueError):
    """A name already taken."""


class NotFound(LookupError):
    pass


def hash_key(secret: str) -> str:
    """API keys are 32 random bytes: a plain SHA-256 is as strong as a slow hash here."""
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


# -- tenants ------------------------------------------------------------------------------


def create_tenant(session: Session, name: str, weight: float = 1.0) -> Tenant:
    tenant = Tenant(name=name, weight=weight)
    session.add(tenant)
    _flush_unique(session, f"a tenant named {name!r} exists")
    audit(session, "tenant.create", tenant.id, {"name": name})
    return tenant


def list_tenants(session: Session) -> list[Tenant]:
    return list(session.scalars(select(Tenant).order_by(Tenant.created_at)))


def get_tenant(session: Session, tenant_id: str) -> Tenant:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFound(f"no tenant {tenant_id}")
    return tenant


def find_tenant(session: Session, name: str) -> Tenant | None:
    return session.scalar(select(Tenant).where(Tenant.name == name))


def update_tenant(session: Session, tenant_id: str, **changes) -> Tenant:
    tenant = get_tenant(session, tenant_id)
    for field, value in changes.items():
        setattr(tenant, field, value)
    _flush_unique(session, f"a tenant named {changes.get('name')!r} exists")
    audit(session, "tenant.update", tenant_id, changes)
    return tenant


# -- keys ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    batch_tokens_per_day: int | None = None  # for its batch jobs, per UTC day


def create_key(
    session: Session,
    tenant_id: str,
    name: str,
    limits: KeyLimits = KeyLimits(),
    service_tier: str = "interactive",
) -> tuple[ApiKey, str]:
    """-> (the key's row, its secret). The secret exists only in this return value."""
    get_tenant(session, tenant_id)
    secret = new_secret()
    key = ApiKey(
        tenant_id=tenant_id,
        name=name,
        prefix=secret[:DISPLAY_PREFIX_LENGTH],
        key_hash=hash_key(secret),
        requests_per_minute=limits.requests_per_minute,
        tokens_per_minute=limits.tokens_per_minute,
        max_concurrent=limits.max_concurrent,
        batch_tokens_per_day=limits.batch_tokens_per_day,
        service_tier=service_tier,
    )
    session.add(key)
    session.flush()
    audit(session, "key.create", key.id, {"tenant_id": tenant_id, "prefix": key.prefix})
    return key, secret


def list_keys(session: Session, tenant_id: str | None = None) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at)
    if tenant_id is not None:
        query = query.where(ApiKey.tenant_id == tenant_id)
    return list(session.scalars(query))


def get_key(session: Session, key_id: str) -> ApiKey:
    key = session.get(ApiKey, key_id)
    if key is None:
        raise NotFound(f"no key {key_id}")
    return key


def revoke_key(session: Session, key_id: str) -> ApiKey:
    key = get_key(session, key_id)
    if key.revoked_at is None:
        key.revoked_at = time.time()
        audit(session, "key.revoke", key_id, {"prefix": key.prefix})
    return key


def key_with_tenant(
    session: Session, key_hash: str | None = None, key_id: str | None = None
) -> tuple[ApiKey, Tenant] | None:
    """The key with this hash (or id) and its tenant."""
    which = ApiKey.key_hash == key_hash if key_id is None else ApiKey.id == key_id
    row = session.execute(select(ApiKey, Tenant).join(Tenant).where(which)).first()
    return (row[0], row[1]) if row else None


# -- adapters -----------------------------------------------------------------------------


def scope_of(tenant_id: str | None) -> str:
    return tenant_id if tenant_id is not None else SHARED_SCOPE


def add_adapter(session: Session, adapter: Adapter) -> Adapter:
    if adapter.tenant_id is not None:
        get_tenant(session, adapter.tenant_id)
    adapter.scope = scope_of(adapter.tenant_id)
    session.add(adapter)
    owner = "shared" if adapter.tenant_id is None else f"tenant {adapter.tenant_id}"
    _flush_unique(session, f"{owner} already has an adapter named {adapter.name!r}")
    audit(
        session,
        "adapter.register",
        adapter.id,
        {"name": adapter.name, "tenant_id": adapter.tenant_id, "hash": adapter.content_hash},
    )
    return adapter


def list_adapters(session: Session, tenant_id: str | None = None) -> list[Adapter]:
    query = select(Adapter).order_by(Adapter.created_at)
    if tenant_id is not None:
        query = query.where(Adapter.tenant_id == tenant_id)
    return list(session.scalars(query))


def get_adapter(session: Session, adapter_id: str) -> Adapter:
    adapter = session.get(Adapter, adapter_id)
    if adapter is None:
        raise NotFound(f"no adapter {adapter_id}")
    return adapter


def find_adapter(session: Session, scope: str, name: str) -> Adapter | None:
    return session.scalar(select(Adapter).where(Adapter.scope == scope, Adapter.name == name))


def visible_adapter(session: Session, tenant_id: str, name: str) -> Adapter | None:
    """The adapter `name` as the tenant sees it: its own first, else a shared one. The same
    query whether or not another tenant has an adapter of that name."""
    candidates = session.scalars(
        select(Adapter).where(
            Adapter.name == name, or_(Adapter.scope == tenant_id, Adapter.scope == SHARED_SCOPE)
        )
    ).all()
    return min(candidates, key=lambda a: a.scope == SHARED_SCOPE, default=None)


def visible_adapters(session: Session, tenant_id: str) -> list[Adapter]:
    rows = session.scalars(
        select(Adapter)
        .where(or_(Adapter.scope == tenant_id, Adapter.scope == SHARED_SCOPE))
        .order_by(Adapter.name)
    ).all()
    own = {a.name for a in rows if a.scope == tenant_id}
    return [a for a in rows if a.scope == tenant_id or a.name not in own]


def delete_adapter(session: Session, adapter_id: str) -> Adapter:
    adapter = get_adapter(session, adapter_id)
    session.delete(adapter)
    audit(session, "adapter.delete", adapter_id, {"name": adapter.name})
    return adapter


def set_pinned(session: Session, adapter_id: str, pinned: bool) -> Adapter:
    adapter = get_adapter(session, adapter_id)
    adapter.pinned = pinned
    audit(session, "adapter.pin" if pinned else "adapter.unpin", adapter_id, {})
    return adapter


# -- usage --------------------------------------------------------------------------------


def add_usage(session: Session, rows: list[dict]) -> None:
    session.execute(Usage.__table__.insert(), rows)


@dataclass(frozen=True)
class UsageTotal:
    group: str | None  # tenant id or adapter id (None: the base model)
    requests: int
    prompt_tokens: int
    completion_tokens: int
    errors: int


def usage_summary(
    session: Session, since: float, by: str, tenant_id: str | None = None
) -> list[UsageTotal]:
    column = {"tenant": Usage.tenant_id, "adapter": Usage.adapter_id}[by]
    query = (
        select(
            column,
            func.count(),
            func.coalesce(func.sum(Usage.prompt_tokens), 0),
            func.coalesce(func.sum(Usage.completion_tokens), 0),
            func.coalesce(func.sum(case((Usage.status >= 400, 1), else_=0)), 0),
        )
        .where(Usage.created_at >= since)
        .group_by(column)
    )
    if tenant_id is not None:
        query = query.where(Usage.tenant_id == tenant_id)
    return [UsageTotal(*row) for row in session.execute(query)]


def usage_series(
    session: Session, since: float, bucket_seconds: int, by: str
) -> list[tuple[float, str | None, int, int]]:
    """(bucket start, group, requests, tokens) for a chart."""
    column = {"tenant": Usage.tenant_id, "adapter": Usage.adapter_id}[by]
    bucket = func.floor(Usage.created_at / bucket_seconds) * bucket_seconds
    query = (
        select(
            bucket,
            column,
            func.count(),
            func.coalesce(func.sum(Usage.prompt_tokens + Usage.completion_tokens), 0),
        )
        .where(Usage.created_at >= since)
        .group_by(bucket, column)
        .order_by(bucket)
    )
    return [(float(b), g, int(n), int(t)) for b, g, n, t in session.execute(query)]


# -- audit --------------------------------------------------------------------------------


def audit(
    session: Session, action: str, target_id: str | None, detail: dict, actor: str = "admin"
) -> None:
    """Record an admin change; every change passes here, so this also bumps the revision that
    other server processes watch (same transaction: they see the change and the bump together)."""
    session.add(AuditEntry(action=action, target_id=target_id, detail=detail, actor=actor))
    session.execute(update(RegistryRevision).values(value=RegistryRevision.value + 1))


def revision(session: Session) -> int:
    """How many changes the registry has committed (see tenancy.Directory.watch)."""
    return session.scalar(select(RegistryRevision.value)) or 0


def list_audit(session: Session, limit: int = 100) -> list[AuditEntry]:
    return list(session.scalars(select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)))


def _flush_unique(session: Session, message: str) -> None:
    try:
        session.flush()
    except IntegrityError:
        raise Conflict(message) from None
