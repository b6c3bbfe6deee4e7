"""The SQL registry: tenants, their API keys and adapters, per-request usage, an audit log, and
the Batch API's files and jobs.

Times are Unix seconds (floats): the same in SQLite and PostgreSQL, and what OpenAI-shaped
objects show. Ids are prefixed random strings ("tnt_…", "key_…", "adp_…"). Usage rows keep ids
as plain strings, not foreign keys, so that deleting an adapter keeps its history.
"""

from __future__ import annotations

import secrets
import time

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Constraint names fixed by convention, so that migrations can refer to them on any database.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
SHARED_SCOPE = "shared"  # the scope of adapters no tenant owns


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("tnt"))
    name: Mapped[str] = mapped_column(String(128), unique=True)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    weight: Mapped[float] = mapped_column(Float, default=1.0)  # share of the engine under load
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    updated_at: Mapped[float] = mapped_column(Float, default=time.time, onupdate=time.time)


class ApiKey(Base):
    """Only a SHA-256 of the secret and a short display prefix are stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("key"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(128))
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_concurrent: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # the tier its requests run at unless they say otherwise: "interactive" or "batch"
    service_tier: Mapped[str] = mapped_column(String(16), default="interactive")
    # tokens its batch jobs may use per UTC day (None: no bound)
    batch_tokens_per_day: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    revoked_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Adapter(Base):
    """A LoRA adapter servable under `name` by its owner's keys, or by every key when shared
    (tenant_id NULL). `scope` is the tenant id or "shared", so that names are unique per owner
    on every database (NULLs never collide in a unique constraint)."""

    __tablename__ = "adapters"
    __table_args__ = (UniqueConstraint("scope", "name", name="uq_adapters_scope_name"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("adp"))
    tenant_id: Mapped[str | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), nullable=True, index=True
    )
    scope: Mapped[str] = mapped_column(String(32))
    name: Mapped[str] = mapped_column(String(128))
    source_path: Mapped[str] = mapped_column(String(1024))  # as registered ("upload" for uploads)
    storage_path: Mapped[str] = mapped_column(String(1024))  # the copy served, by content hash
    content_hash: Mapped[str] = mapped_column(String(64))
    rank: Mapped[int] = mapped_column(Integer)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    base_model: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16), default="ready")
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    updated_at: Mapped[float] = mapped_column(Float, default=time.time, onupdate=time.time)

    @property
    def shared(self) -> bool:
        return self.tenant_id is None


class Usage(Base):
    __tablename__ = "usage"
    __table_args__ = (Index("ix_usage_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(64))
    tenant_id: Mapped[str] = mapped_column(String(32))
    key_id: Mapped[str] = mapped_column(String(32))
    adapter_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    model: Mapped[str] = mapped_column(String(128))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    latency_ms: Mapped[float] = mapped_column(Float, default=0.0)
    status: Mapped[int] = mapped_column(Integer)  # the HTTP status of the response
    created_at: Mapped[float] = mapped_column(Float, default=time.time, index=True)
    batch_id: Mapped[str | None] = mapped_column(String(32), nullable=True)  # a batch job's line


class StoredFile(Base):
    """A file of the Files API: a batch job's input, output or errors, kept under the data dir."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("file"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    purpose: Mapped[str] = mapped_column(String(32))  # batch, batch_output
    filename: Mapped[str] = mapped_column(String(256))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    storage_path: Mapped[str] = mapped_column(String(1024))
    created_at: Mapped[float] = mapped_column(Float, default=time.time)


class BatchJob(Base):
    """A job of the Batch API: the requests of an input file, run at the batch tier."""

    __tablename__ = "batches"
    # the statuses whose time of reaching is kept, as <status>_at
    STAMPED = (
        "in_progress",
        "finalizing",
        "completed",
        "failed",
        "expired",
        "cancelling",
        "cancelled",
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=lambda: new_id("batch"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_id: Mapped[str] = mapped_column(String(32))  # whose limits and usage its requests count to
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(32))
    completion_window: Mapped[str] = mapped_column(String(16))
    # validating, in_progress, finalizing, completed, failed, expired, cancelling, cancelled
    status: Mapped[str] = mapped_column(String(16), index=True)
    output_file_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    errors: Mapped[list | None] = mapped_column(JSON, nullable=True)
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON, nullable=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    expires_at: Mapped[float] = mapped_column(Float)
    in_progress_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finalizing_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    completed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    failed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    expired_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    cancelling_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    cancelled_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # the server process running it, and when it last said so (another takes over past a lease)
    runner: Mapped[str | None] = mapped_column(String(64), nullable=True)
    heartbeat_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class AuditEntry(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    at: Mapped[float] = mapped_column(Float, default=time.time, index=True)
    actor: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(64))  # e.g. "adapter.register"
    target_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    detail: Mapped[dict] = mapped_column(JSON, default=dict)


class RegistryRevision(Base):
    """One row counting committed registry changes. Every change bumps it in its own transaction
    (see registry.audit); each server process polls it and drops its cached answers (keys,
    tenants, adapters) when it moves, so a change made through one process reaches all."""

    __tablename__ = "registry_revision"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger, default=0)
