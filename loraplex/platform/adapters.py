"""Registering, deleting and pinning adapters: the registry and the engine kept in step.

Registration validates the adapter with the engine's own checks (roots, format, base model,
rank), then copies its two files into the data dir under their content hash, checks the copy
hashes the same, and only then writes the row: a refused adapter leaves nothing behind, and a
registered one is served from a copy nobody can change under it. The engine knows an adapter by
its row id, so a name registered again (a new row) is never served with the old weights.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from fastapi import UploadFile

from loraplex.engine.api import AdapterError, AdapterInfo, LoRARequest
from loraplex.platform import registry
from loraplex.platform.db.models import Adapter
from loraplex.platform.errors import APIError, from_engine, invalid_request, not_found
from loraplex.platform.state import Platform

FILES = ("adapter_config.json", "adapter_model.safetensors")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
UPLOAD_CHUNK = 1 << 20


@dataclass(frozen=True)
class Residency:
    status: str  # "registered", "host-cached", "resident" or "pinned"
    running_requests: int = 0


class Adapters:
    def __init__(self, platform: Platform) -> None:
        self.platform = platform

    async def register_path(self, name: str, path: str, tenant_id: str | None) -> Adapter:
        self._check_name(name)
        await self._validate(path)  # roots and format, on the source itself
        staging = self.platform.settings.upload_dir / uuid.uuid4().hex
        try:
            await asyncio.to_thread(_copy_files, Path(path), staging)
            return await self._store(name, str(path), staging, tenant_id)
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)

    async def register_upload(
        self, name: str, tenant_id: str | None, config: UploadFile, weights: UploadFile
    ) -> Adapter:
        self._check_name(name)
        staging = self.platform.settings.upload_dir / uuid.uuid4().hex
        try:
            staging.mkdir(parents=True)
            for upload, file_name in ((config, FILES[0]), (weights, FILES[1])):
                await _save_upload(upload, staging / file_name)
            return await self._store(name, "upload", staging, tenant_id)
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)

    async def delete(self, adapter_id: str) -> Adapter:
        adapter = await self._run(lambda s: registry.delete_adapter(s, adapter_id))
        self.platform.directory.forget()  # no longer selectable, from now on
        await self.platform.require_engine().unload_adapter(adapter_id)  # in flight: finish
        return adapter

    async def set_pinned(self, adapter_id: str, pinned: bool) -> Adapter:
        engine = self.platform.require_engine()
        adapter = await self._run(lambda s: registry.get_adapter(s, adapter_id))
        if pinned:
            try:
                await engine.load_adapter(LoRARequest(adapter.id, adapter.storage_path), pin=True)
            except AdapterError as error:
                raise from_engine(error, serving=False) from None
        else:
            await engine.unpin_adapter(adapter.id)
        return await self._run(lambda s: registry.set_pinned(s, adapter_id, pinned))

    async def residency(self) -> dict[str, Residency]:
        """Adapter id -> where the engine holds it (ids it holds nowhere are left out)."""
        engine = self.platform.require_engine()
        snapshot = await engine.pool_snapshot()
        places = {i: Residency("host-cached") for i in engine.host_cached_adapters()}
        for resident in snapshot.resident:
            status = "pinned" if resident.pinned else "resident"
            for adapter_id in resident.adapter_ids:
                places[adapter_id] = Residency(status, resident.running_requests)
        return places

    # -- internals -------------------------------------------------------------------------

    def _check_name(self, name: str) -> None:
        if not NAME.fullmatch(name):
            raise invalid_request(
                "adapter names are 1-128 characters: letters, digits and . _ : / -, "
                "starting with a letter or digit",
                param="name",
            )
        if name == self.platform.base_model:
            raise invalid_request(f"{name!r} is the base model's name", param="name")

    async def _validate(self, path: str) -> AdapterInfo:
        engine = self.platform.require_engine()
        try:
            return await engine.validate_adapter(LoRARequest("registering", path))
        except AdapterError as error:
            raise from_engine(error, serving=False) from None

    async def _store(self, name: str, source: str, staging: Path, tenant_id: str | None):
        info = await self._validate(str(staging))
        target = self.platform.settings.adapter_store / info.content_hash
        await asyncio.to_thread(_place, staging, target)
        adapter = Adapter(
            tenant_id=tenant_id,
            name=name,
            source_path=source,
            storage_path=str(target),
            content_hash=info.content_hash,
            rank=info.rank,
            target_modules=list(info.target_modules),
            size_bytes=info.nbytes,
            base_model=self.platform.base_model,
        )
        adapter = await self._run(lambda s: registry.add_adapter(s, adapter))
        self.platform.directory.forget()
        return adapter

    async def _run(self, work):
        try:
            return await self.platform.db.run(work)
        except registry.NotFound as error:
            raise not_found(str(error)) from None
        except registry.Conflict as error:
            raise APIError(409, str(error), code="conflict", param="name") from None


def _copy_files(source: Path, staging: Path) -> None:
    staging.mkdir(parents=True)
    for file_name in FILES:
        if (source / file_name).is_file():
            shutil.copyfile(source / file_name, staging / file_name)


def _place(staging: Path, target: Path) -> None:
    """Move the validated files to their content-addressed home (already there: kept)."""
    if target.is_dir():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.rename(target)
    except OSError:
        if not target.is_dir():  # not a concurrent registration of the same content
            raise


async def _save_upload(upload: UploadFile, path: Path) -> None:
    with path.open("wb") as out:
        while chunk := await upload.read(UPLOAD_CHUNK):
            await asyncio.to_thread(out.write, chunk)
