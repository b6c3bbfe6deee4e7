"""The admin REST API under /admin/v1 (admin token), and vLLM's adapter-loading routes."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import PlainTextResponse

from loraplex.platform import registry
from loraplex.platform.adapters import Adapters
from loraplex.platform.admin_schema import (
    AdapterCreate,
    AdapterOut,
    AuditOut,
    KeyCreate,
    KeyOut,
    ListOf,
    LoadLoRABody,
    TenantCreate,
    TenantOut,
    TenantUpdate,
    UnloadLoRABody,
    UsagePoint,
    UsageReport,
    UsageRow,
)
from loraplex.platform.db.models import SHARED_SCOPE
from loraplex.platform.deps import AdminDep, PlatformDep
from loraplex.platform.errors import APIError, invalid_request, not_found
from loraplex.platform.state import Platform

router = APIRouter(prefix="/admin/v1", dependencies=[AdminDep], tags=["admin"])
vllm_router = APIRouter(dependencies=[AdminDep], tags=["admin"])


async def _run(platform: Platform, work):
    """A registry call; its NotFound and Conflict as 404 and 409."""
    try:
        return await platform.db.run(work)
    except registry.NotFound as error:
        raise not_found(str(error)) from None
    except registry.Conflict as error:
        raise APIError(409, str(error), code="conflict", param="name") from None


# -- tenants ---------------------------------------------------------------------------------


@router.post("/tenants", status_code=201, response_model=TenantOut)
async def create_tenant(body: TenantCreate, platform: PlatformDep) -> TenantOut:
    tenant = await _run(platform, lambda s: registry.create_tenant(s, body.name, body.weight))
    return TenantOut.of(tenant)


@router.get("/tenants", response_model=ListOf[TenantOut])
async def list_tenants(platform: PlatformDep) -> ListOf[TenantOut]:
    tenants = await _run(platform, registry.list_tenants)
    return ListOf[TenantOut](data=[TenantOut.of(t) for t in tenants])


@router.get("/tenants/{tenant_id}", response_model=TenantOut)
async def get_tenant(tenant_id: str, platform: PlatformDep) -> TenantOut:
    return TenantOut.of(await _run(platform, lambda s: registry.get_tenant(s, tenant_id)))


@router.patch("/tenants/{tenant_id}", response_model=TenantOut)
async def update_tenant(tenant_id: str, body: TenantUpdate, platform: PlatformDep) -> TenantOut:
    changes = body.model_dump(exclude_none=True)
    tenant = await _run(platform, lambda s: registry.update_tenant(s, tenant_id, **changes))
    platform.directory.forget()  # a disabled tenant is refused from now on
    return TenantOut.of(tenant)


# -- keys ------------------------------------------------------------------------------------


@router.post("/tenants/{tenant_id}/keys", status_code=201, response_model=KeyOut)
async def create_key(tenant_id: str, body: KeyCreate, platform: PlatformDep) -> KeyOut:
    limits = registry.KeyLimits(
        body.requests_per_minute,
        body.tokens_per_minute,
        body.max_concurrent,
        body.batch_tokens_per_day,
    )
    key, secret = await _run(
        platform,
        lambda s: registry.create_key(s, tenant_id, body.name, limits, body.service_tier),
    )
    return KeyOut.of(key, secret)


@router.get("/tenants/{tenant_id}/keys", response_model=ListOf[KeyOut])
async def list_tenant_keys(tenant_id: str, platform: PlatformDep) -> ListOf[KeyOut]:
    await _run(platform, lambda s: registry.get_tenant(s, tenant_id))
    keys = await _run(platform, lambda s: registry.list_keys(s, tenant_id))
    return ListOf[KeyOut](data=[KeyOut.of(k) for k in keys])


@router.get("/keys", response_model=ListOf[KeyOut])
async def list_keys(
    platform: PlatformDep, tenant_id: Annotated[str | None, Query()] = None
) -> ListOf[KeyOut]:
    keys = await _run(platform, lambda s: registry.list_keys(s, tenant_id))
    return ListOf[KeyOut](data=[KeyOut.of(k) for k in keys])


@router.delete("/keys/{key_id}", response_model=KeyOut)
async def revoke_key(key_id: str, platform: PlatformDep) -> KeyOut:
    key = await _run(platform, lambda s: registry.revoke_key(s, key_id))
    platform.directory.forget()
    return KeyOut.of(key)


# -- adapters --------------------------------------------------------------------------------


@router.post("/adapters", status_code=201, response_model=AdapterOut)
async def register_adapter(body: AdapterCreate, platform: PlatformDep) -> AdapterOut:
    adapter = await Adapters(platform).register_path(body.name, body.path, body.tenant_id)
    return AdapterOut.of(adapter)


@router.post("/adapters/upload", status_code=201, response_model=AdapterOut)
async def upload_adapter(
    platform: PlatformDep,
    name: Annotated[str, Form()],
    adapter_config: UploadFile,
    adapter_model: UploadFile,
    tenant_id: Annotated[str | None, Form()] = None,
) -> AdapterOut:
    adapter = await Adapters(platform).register_upload(
        name, tenant_id or None, adapter_config, adapter_model
    )
    return AdapterOut.of(adapter)


@router.get("/adapters", response_model=ListOf[AdapterOut])
async def list_adapters(
    platform: PlatformDep, tenant_id: Annotated[str | None, Query()] = None
) -> ListOf[AdapterOut]:
    adapters = await _run(platform, lambda s: registry.list_adapters(s, tenant_id))
    places = await Adapters(platform).residency()
    return ListOf[AdapterOut](data=[_with_residency(a, places) for a in adapters])


@router.get("/adapters/{adapter_id}", response_model=AdapterOut)
async def get_adapter(adapter_id: str, platform: PlatformDep) -> AdapterOut:
    adapter = await _run(platform, lambda s: registry.get_adapter(s, adapter_id))
    return _with_residency(adapter, await Adapters(platform).residency())


@router.delete("/adapters/{adapter_id}", response_model=AdapterOut)
async def delete_adapter(adapter_id: str, platform: PlatformDep) -> AdapterOut:
    return AdapterOut.of(await Adapters(platform).delete(adapter_id))


@router.post("/adapters/{adapter_id}/pin", response_model=AdapterOut)
async def pin_adapter(adapter_id: str, platform: PlatformDep) -> AdapterOut:
    adapter = await Adapters(platform).set_pinned(adapter_id, True)
    return _with_residency(adapter, await Adapters(platform).residency())


@router.post("/adapters/{adapter_id}/unpin", response_model=AdapterOut)
async def unpin_adapter(adapter_id: str, platform: PlatformDep) -> AdapterOut:
    adapter = await Adapters(platform).set_pinned(adapter_id, False)
    return _with_residency(adapter, await Adapters(platform).residency())


def _with_residency(adapter, places) -> AdapterOut:
    place = places.get(adapter.id)
    if place is None:
        return AdapterOut.of(adapter)
    return AdapterOut.of(adapter, place.status, place.running_requests)


# -- usage, engine, audit --------------------------------------------------------------------


@router.get("/usage", response_model=UsageReport)
async def usage(
    platform: PlatformDep,
    window: Annotated[int, Query(ge=60, le=30 * 86400)] = 3600,
    group_by: Annotated[Literal["tenant", "adapter"], Query()] = "tenant",
    tenant_id: Annotated[str | None, Query()] = None,
) -> UsageReport:
    since = time.time() - window
    bucket = max(60, window // 60)

    def report(session):
        return (
            registry.usage_summary(session, since, group_by, tenant_id),
            registry.usage_series(session, since, bucket, group_by),
        )

    totals, series = await _run(platform, report)
    return UsageReport(
        since=int(since),
        group_by=group_by,
        bucket_seconds=bucket,
        totals=[
            UsageRow(
                id=t.group,
                requests=t.requests,
                prompt_tokens=t.prompt_tokens,
                completion_tokens=t.completion_tokens,
                errors=t.errors,
            )
            for t in totals
        ],
        series=[UsagePoint(at=int(at), id=g, requests=n, tokens=tok) for at, g, n, tok in series],
    )


@router.get("/engine")
async def engine_report(platform: PlatformDep) -> dict:
    engine = platform.require_engine()
    snapshot = await engine.pool_snapshot()
    return {
        "model": platform.base_model,
        "info": engine.model_info().__dict__,
        "stats": engine.stats().__dict__,
        "pool": {
            "num_pages": snapshot.num_pages,
            "free_pages": snapshot.free_pages,
            "kv_pages": snapshot.kv_pages,
            "cached_pages": snapshot.cached_pages,
            "adapter_pages": snapshot.adapter_pages,
            "resident": [r.__dict__ for r in snapshot.resident],
        },
        "replicas": _replicas(platform),
    }


def _replicas(platform) -> list[dict] | None:
    """Each engine replica's last report, when the engine runs on Ray Serve."""
    reports = platform.replica_reports()
    if reports is None:
        return None
    return [
        {
            "replica": r.replica,
            "running_requests": r.stats.num_running_requests,
            "waiting_requests": r.stats.num_waiting_requests,
            "free_pages": r.pool.free_pages,
            "resident_adapters": [a for info in r.pool.resident for a in info.adapter_ids],
            "routed_adapters": r.routed,
            "adapter_requests": r.adapter_requests,
            "affinity_hits": r.affinity_hits,
        }
        for r in reports
    ]


@router.get("/audit", response_model=ListOf[AuditOut])
async def audit(
    platform: PlatformDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> ListOf[AuditOut]:
    entries = await _run(platform, lambda s: registry.list_audit(s, limit))
    return ListOf[AuditOut](
        data=[
            AuditOut(
                id=e.id,
                at=e.at,
                actor=e.actor,
                action=e.action,
                target_id=e.target_id,
                detail=e.detail,
            )
            for e in entries
        ]
    )


# -- vLLM's routes, for users moving over -------------------------------------------------


@vllm_router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRABody, platform: PlatformDep) -> str:
    """Registers a shared adapter, as vLLM's route loads one for everybody."""
    await Adapters(platform).register_path(body.lora_name, body.lora_path, None)
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@vllm_router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRABody, platform: PlatformDep) -> str:
    adapter = await _run(platform, lambda s: registry.find_adapter(s, SHARED_SCOPE, body.lora_name))
    if adapter is None:
        raise invalid_request(
            f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name"
        )
    await Adapters(platform).delete(adapter.id)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
