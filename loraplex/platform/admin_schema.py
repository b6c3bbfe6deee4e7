"""Bodies of the admin REST API (`/admin/v1`)."""

from __future__ import annotations

from typing import Annotated, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from loraplex.platform.db.models import Adapter, ApiKey, Tenant

Limit = Annotated[int, Field(ge=1)] | None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TenantCreate(_Body):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    weight: Annotated[float, Field(gt=0, le=1000)] = 1.0


class TenantUpdate(_Body):
    name: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    disabled: bool | None = None
    weight: Annotated[float, Field(gt=0, le=1000)] | None = None


class TenantOut(BaseModel):
    id: str
    object: Literal["tenant"] = "tenant"
    name: str
    disabled: bool
    weight: float
    created_at: int

    @classmethod
    def of(cls, tenant: Tenant) -> TenantOut:
        return cls(
            id=tenant.id,
            name=tenant.name,
            disabled=tenant.disabled,
            weight=tenant.weight,
            created_at=int(tenant.created_at),
        )


class KeyCreate(_Body):
    name: Annotated[str, Field(min_length=1, max_length=128)] = "default"
    requests_per_minute: Limit = None
    tokens_per_minute: Limit = None
    max_concurrent: Limit = None
    batch_tokens_per_day: Limit = None
    service_tier: Literal["interactive", "batch"] = "interactive"


class KeyOut(BaseModel):
    id: str
    object: Literal["api_key"] = "api_key"
    tenant_id: str
    name: str
    prefix: str
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent: int | None
    batch_tokens_per_day: int | None
    service_tier: str
    created_at: int
    revoked: bool
    key: str | None = None  # the secret: only in the reply that created it

    @classmethod
    def of(cls, key: ApiKey, secret: str | None = None) -> KeyOut:
        return cls(
            id=key.id,
            tenant_id=key.tenant_id,
            name=key.name,
            prefix=key.prefix,
            requests_per_minute=key.requests_per_minute,
            tokens_per_minute=key.tokens_per_minute,
            max_concurrent=key.max_concurrent,
            batch_tokens_per_day=key.batch_tokens_per_day,
            service_tier=key.service_tier,
            created_at=int(key.created_at),
            revoked=key.revoked_at is not None,
            key=secret,
        )


class AdapterCreate(_Body):
    name: str
    path: str
    tenant_id: str | None = None  # None: shared with every tenant


class AdapterOut(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    name: str
    tenant_id: str | None
    shared: bool
    rank: int
    target_modules: list[str]
    size_bytes: int
    content_hash: str
    base_model: str
    source_path: str
    status: str  # registered, host-cached, resident or pinned
    pinned: bool
    running_requests: int = 0
    created_at: int

    @classmethod
    def of(cls, adapter: Adapter, status: str = "registered", running: int = 0) -> AdapterOut:
        return cls(
            id=adapter.id,
            name=adapter.name,
            tenant_id=adapter.tenant_id,
            shared=adapter.shared,
            rank=adapter.rank,
            target_modules=list(adapter.target_modules),
            size_bytes=adapter.size_bytes,
            content_hash=adapter.content_hash,
            base_model=adapter.base_model,
            source_path=adapter.source_path,
            status=status,
            pinned=adapter.pinned,
            running_requests=running,
            created_at=int(adapter.created_at),
        )


T = TypeVar("T")


class ListOf(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]


class UsageRow(BaseModel):
    id: str | None  # tenant or adapter id; None: the base model
    requests: int
    prompt_tokens: int
    completion_tokens: int
    errors: int


class UsagePoint(BaseModel):
    at: int  # start of the bucket (Unix seconds)
    id: str | None
    requests: int
    tokens: int


class UsageReport(BaseModel):
    since: int
    group_by: Literal["tenant", "adapter"]
    totals: list[UsageRow]
    series: list[UsagePoint]
    bucket_seconds: int


class AuditOut(BaseModel):
    id: int
    at: float
    actor: str
    action: str
    target_id: str | None
    detail: dict


class LoadLoRABody(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoRABody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_int_id: int | None = None
