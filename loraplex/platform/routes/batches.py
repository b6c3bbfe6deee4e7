"""The OpenAI Files and Batch APIs, scoped to the caller's tenant: upload a JSONL file of
requests, run it as a batch job (see batches.py), download the output and error files."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import FileResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from loraplex.platform.batches import ACTIVE, ENDPOINTS, WINDOWS
from loraplex.platform.db.models import BatchJob, StoredFile, new_id
from loraplex.platform.deps import CallerDep, PlatformDep
from loraplex.platform.errors import invalid_request, not_found

router = APIRouter(tags=["batch"])
MAX_FILE_BYTES = 200 * 2**20  # OpenAI's bound for a batch input file
CHUNK = 2**20


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"

    @classmethod
    def of(cls, row: StoredFile) -> FileObject:
        return cls(
            id=row.id,
            bytes=row.size_bytes,
            created_at=int(row.created_at),
            filename=row.filename,
            purpose=row.purpose,
        )


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None

    @classmethod
    def of(cls, job: BatchJob) -> BatchObject:
        def at(name: str) -> int | None:
            value = getattr(job, name)
            return int(value) if value is not None else None

        return cls(
            id=job.id,
            endpoint=job.endpoint,
            errors=BatchErrors(data=job.errors) if job.errors else None,
            input_file_id=job.input_file_id,
            completion_window=job.completion_window,
            status=job.status,
            output_file_id=job.output_file_id,
            error_file_id=job.error_file_id,
            created_at=int(job.created_at),
            request_counts=RequestCounts(
                total=job.total, completed=job.completed, failed=job.failed
            ),
            metadata=job.metadata_,
            expires_at=at("expires_at"),
            **{f"{status}_at": at(f"{status}_at") for status in BatchJob.STAMPED},
        )


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


Limit = Annotated[int, Query(ge=1, le=100)]


# -- files -----------------------------------------------------------------------------------


@router.post("/v1/files", response_model=FileObject)
async def create_file(
    caller: CallerDep, platform: PlatformDep, file: UploadFile, purpose: Annotated[str, Form()]
) -> FileObject:
    """Upload a JSONL file of requests (purpose "batch")."""
    if purpose != "batch":
        raise invalid_request("only files of purpose 'batch' are served", param="purpose")
    file_id = new_id("file")
    folder = platform.settings.data_dir / "files"
    path = folder / file_id
    size = await asyncio.to_thread(_save, file, folder, path)
    row = StoredFile(
        id=file_id,
        tenant_id=caller.tenant_id,
        purpose=purpose,
        filename=Path(file.filename or "input.jsonl").name[:256],
        size_bytes=size,
        storage_path=str(path),
    )
    try:
        await platform.db.run(lambda s: s.add(row))
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return FileObject.of(row)


def _save(upload: UploadFile, folder: Path, path: Path) -> int:
    """Copy the upload to `path`; raises APIError 400 past MAX_FILE_BYTES (nothing is kept)."""
    folder.mkdir(parents=True, exist_ok=True)
    size = 0
    with path.open("wb") as out:
        while chunk := upload.file.read(CHUNK):
            size += len(chunk)
            if size > MAX_FILE_BYTES:
                out.close()
                path.unlink(missing_ok=True)
                raise invalid_request(f"a file is at most {MAX_FILE_BYTES} bytes", param="file")
            out.write(chunk)
    if size == 0:
        path.unlink(missing_ok=True)
        raise invalid_request("the file is empty", param="file")
    return size


@router.get("/v1/files", response_model=FileList)
async def list_files(
    caller: CallerDep, platform: PlatformDep, purpose: str | None = None, limit: Limit = 100
) -> FileList:
    def listing(session) -> list[StoredFile]:
        query = select(StoredFile).where(StoredFile.tenant_id == caller.tenant_id)
        if purpose is not None:
            query = query.where(StoredFile.purpose == purpose)
        return list(session.scalars(query.order_by(StoredFile.created_at.desc()).limit(limit)))

    return FileList(data=[FileObject.of(row) for row in await platform.db.run(listing)])


async def _owned(platform, caller, model: type, row_id: str, what: str):
    """The caller's tenant's row of `model`; 404 alike for a missing one and another's."""
    row = await platform.db.run(lambda s: s.get(model, row_id))
    if row is None or row.tenant_id != caller.tenant_id:
        raise not_found(f"No {what} with id '{row_id}'.")
    return row


async def _file(platform, caller, file_id: str) -> StoredFile:
    return await _owned(platform, caller, StoredFile, file_id, "file")


@router.get("/v1/files/{file_id}", response_model=FileObject)
async def get_file(file_id: str, caller: CallerDep, platform: PlatformDep) -> FileObject:
    return FileObject.of(await _file(platform, caller, file_id))


@router.get("/v1/files/{file_id}/content", response_class=FileResponse)
async def file_content(file_id: str, caller: CallerDep, platform: PlatformDep) -> FileResponse:
    row = await _file(platform, caller, file_id)
    if not Path(row.storage_path).exists():
        raise not_found(f"The content of file '{file_id}' is gone.")
    return FileResponse(row.storage_path, media_type="application/jsonl", filename=row.filename)


@router.delete("/v1/files/{file_id}", response_model=FileDeleted)
async def delete_file(file_id: str, caller: CallerDep, platform: PlatformDep) -> FileDeleted:
    row = await _file(platform, caller, file_id)

    def delete(session) -> None:
        running = session.scalar(
            select(BatchJob.id).where(
                BatchJob.input_file_id == file_id, BatchJob.status.in_(ACTIVE)
            )
        )
        if running is not None:
            raise invalid_request(f"batch {running} is running on this file", param="file_id")
        session.delete(session.get(StoredFile, file_id))

    await platform.db.run(delete)
    if row.purpose == "batch":  # an output file belongs to its job's folder, kept with it
        await asyncio.to_thread(Path(row.storage_path).unlink, missing_ok=True)
    return FileDeleted(id=file_id)


# -- batches ---------------------------------------------------------------------------------


@router.post("/v1/batches", response_model=BatchObject)
async def create_batch(body: BatchCreate, caller: CallerDep, platform: PlatformDep) -> BatchObject:
    """Run the requests of an uploaded file at the batch tier."""
    if body.endpoint not in ENDPOINTS:
        raise invalid_request(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    if body.completion_window not in WINDOWS:
        raise invalid_request(
            f"completion_window must be one of {', '.join(WINDOWS)}", param="completion_window"
        )
    stored = await _file(platform, caller, body.input_file_id)
    if stored.purpose != "batch":
        raise invalid_request("the input file's purpose must be 'batch'", param="input_file_id")
    now = time.time()
    job = BatchJob(
        tenant_id=caller.tenant_id,
        key_id=caller.key_id,
        endpoint=body.endpoint,
        input_file_id=body.input_file_id,
        completion_window=body.completion_window,
        status="validating",
        metadata_=body.metadata,
        total=0,
        completed=0,
        failed=0,
        created_at=now,
        expires_at=now + WINDOWS[body.completion_window],
    )
    await platform.db.run(lambda s: s.add(job))
    platform.batches.wake()
    return BatchObject.of(job)


async def _batch(platform, caller, batch_id: str) -> BatchJob:
    return await _owned(platform, caller, BatchJob, batch_id, "batch")


@router.get("/v1/batches/{batch_id}", response_model=BatchObject)
async def get_batch(batch_id: str, caller: CallerDep, platform: PlatformDep) -> BatchObject:
    return BatchObject.of(await _batch(platform, caller, batch_id))


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject)
async def cancel_batch(batch_id: str, caller: CallerDep, platform: PlatformDep) -> BatchObject:
    """Stop a job: requests in flight are aborted, those done stay in its output."""
    await _batch(platform, caller, batch_id)

    def cancel(session) -> BatchJob:
        job = session.get(BatchJob, batch_id)
        if job.status in ("validating", "in_progress"):
            job.status, job.cancelling_at = "cancelling", time.time()
        elif job.status not in ("cancelling", "cancelled"):
            raise invalid_request(f"a batch that is {job.status} cannot be cancelled")
        return job

    job = await platform.db.run(cancel)
    platform.batches.wake()
    return BatchObject.of(job)


@router.get("/v1/batches", response_model=BatchList)
async def list_batches(
    caller: CallerDep, platform: PlatformDep, limit: Limit = 20, after: str | None = None
) -> BatchList:
    def listing(session) -> list[BatchJob]:
        query = select(BatchJob).where(BatchJob.tenant_id == caller.tenant_id)
        if after is not None:
            anchor = session.get(BatchJob, after)
            if anchor is not None:
                query = query.where(BatchJob.created_at < anchor.created_at)
        newest_first = query.order_by(BatchJob.created_at.desc(), BatchJob.id)
        return list(session.scalars(newest_first.limit(limit + 1)))

    jobs = await platform.db.run(listing)
    data = [BatchObject.of(job) for job in jobs[:limit]]
    return BatchList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=len(jobs) > limit,
    )
