"""The OpenAI Batch API's jobs: an input file of requests, run at the batch tier in this process.

A job goes validating -> in_progress -> finalizing -> completed (or failed at validation,
cancelling -> cancelled, expired past its window). Each request of the input runs through the
same route code as an HTTP request of the job's key (its limits, usage rows and adapters), at the
batch tier, so that interactive traffic goes first. A finished request is appended to the job's
output file (a 2xx) or error file (anything else) at once, one flushed line each; a job that
was running when the server stopped resumes on the next start: requests already in either file
are not run again, a half-written last line is dropped, so every request has exactly one line.
A rate-limited request waits and is retried, it does not fail.

Several server processes may share the registry: a process claims a job before running it and
renews its claim as it goes; another takes a job over only once the claim has gone stale
(LEASE_POLLS polls without renewal, LEASE_MIN_SECONDS at least: its process stopped). A process
that finds its claim taken stops running the job. The job's files live under the data dir,
which the processes must then share; a line is written under a lock on the job's folder and
only if no process wrote one for its request (`JobFiles`), so a late process that ran a request
again still leaves one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from sqlalchemy import func, or_, select, update
from starlette.requests import Request

from loraplex.platform.db.models import BatchJob, StoredFile, Usage
from loraplex.platform.errors import SERVER_ERROR, APIError
from loraplex.platform.tenancy import Caller, caller_by_key_id

logger = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
LEGACY = "/v1/completions"
ENDPOINTS = (CHAT, LEGACY)
WINDOWS = {"24h": 24 * 3600}
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
MAX_LINES = 50_000  # OpenAI's bound per batch
MAX_ERRORS_SHOWN = 20
ESTIMATED_MAX_TOKENS = 256  # a request without max_tokens, when checking a token budget
LEASE_POLLS = 10  # a claim not renewed for this many polls is stale,
LEASE_MIN_SECONDS = 10.0  # and for at least this long: a busy process may renew late
RETRY_SECONDS = 1.0  # a request refused for load waits this long unless the refusal says


@dataclass(frozen=True)
class BatchOrigin:
    """Set in an in-process request's scope: whom a batch job's request runs for."""

    caller: Caller
    batch_id: str


def job_dir(data_dir: Path, batch_id: str) -> Path:
    return data_dir / "batches" / batch_id


def parse_input(path: Path, endpoint: str) -> tuple[list[dict], list[dict]]:
    """(the requests of a JSONL input file, the problems found: at most MAX_ERRORS_SHOWN)."""
    requests, errors, seen = [], [], set()

    def problem(line: int | None, message: str, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS_SHOWN:
            errors.append(
                {"code": "invalid_request", "message": message, "param": param, "line": line}
            )

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        problem(None, f"the input file cannot be read as UTF-8 text: {error}")
        return [], errors
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            item = json.loads(raw)
        except ValueError:
            problem(number, "this line is not valid JSON")
            continue
        if not isinstance(item, dict):
            problem(number, "each line must be a JSON object")
            continue
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
            problem(number, "custom_id must be a string of 1 to 512 characters", "custom_id")
        elif custom_id in seen:
            problem(number, f"custom_id {custom_id!r} is used twice", "custom_id")
        if item.get("method") != "POST":
            problem(number, "method must be POST", "method")
        if item.get("url") != endpoint:
            problem(number, f"url must be the batch's endpoint, {endpoint}", "url")
        if not isinstance(item.get("body"), dict):
            problem(number, "body must be a JSON object", "body")
        seen.add(custom_id)
        requests.append(item)
    if not requests and not errors:
        problem(None, "the input file holds no requests")
    if len(requests) > MAX_LINES:
        problem(None, f"a batch holds at most {MAX_LINES} requests, this one {len(requests)}")
    return requests, errors


def estimated_tokens(item: dict) -> int:
    """What a request may use, for a budget check: about 4 characters a prompt token, plus its
    max_tokens (an estimate, as OpenAI's own for batch queues)."""
    body = item["body"]
    prompt = body.get("messages", body.get("prompt", ""))
    most = body.get("max_completion_tokens") or body.get("max_tokens") or ESTIMATED_MAX_TOKENS
    n = body.get("n") or 1
    return len(json.dumps(prompt)) // 4 + (most if isinstance(most, int) else 0) * n


class JobFiles:
    """A job's output and error files, which every process running the job appends to: a line
    is written under an exclusive lock on the job's folder, and only if no process has written
    one for its request, so each request has exactly one line however the claims went."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._paths = {True: folder / "output.jsonl", False: folder / "errors.jsonl"}
        self._lock_path = folder / "lock"
        self._read = {True: 0, False: 0}  # bytes of each file already taken into `_done`
        self._done = {True: set(), False: set()}
        self.look()

    @property
    def succeeded(self) -> set[str]:
        return self._done[True]

    @property
    def failed(self) -> set[str]:
        return self._done[False]

    def has(self, custom_id: str) -> bool:
        """Whether some process wrote a line for the request (as of the last look)."""
        return custom_id in self._done[True] or custom_id in self._done[False]

    def look(self) -> None:
        """Take in the lines other processes wrote since the last look."""
        with self._locked():
            self._catch_up()

    def record(self, custom_id: str, line: dict, ok: bool) -> bool:
        """Append the request's line unless one is there already; -> whether it was written."""
        with self._locked():
            self._catch_up()
            if self.has(custom_id):
                return False
            data = (json.dumps(line) + "\n").encode()
            with self._paths[ok].open("ab") as file:
                file.write(data)
            self._read[ok] += len(data)
            self._done[ok].add(custom_id)
            return True

    @contextlib.contextmanager
    def _locked(self):
        with self._lock_path.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            yield

    def _catch_up(self) -> None:
        """Read what was appended since the last look (under the lock). A half-written last
        line can only be left by a process that stopped while writing it: it is cut off, and
        its request runs again."""
        for ok, path in self._paths.items():
            if not path.exists():
                continue
            with path.open("r+b") as file:
                file.seek(self._read[ok])
                data = file.read()
                whole = data[: data.rfind(b"\n") + 1]
                if len(whole) < len(data):
                    file.truncate(self._read[ok] + len(whole))
            lines = (json.loads(raw) for raw in whole.splitlines() if raw.strip())
            self._done[ok].update(line["custom_id"] for line in lines)
            self._read[ok] += len(whole)


def _internal_request(app: FastAPI, path: str, body: bytes, origin: BatchOrigin) -> Request:
    """An HTTP request made in-process, for the route code: no client, so it never goes away."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # no client to disconnect
        raise AssertionError("unreachable")

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "app": app,
        "state": {"batch": origin},
        "client": None,
        "server": None,
        "scheme": "http",
        "http_version": "1.1",
    }
    return Request(scope, receive)


class BatchRunner:
    """Runs the active jobs of the registry, each on its own task, `concurrency` requests of
    each in flight (the engine's scheduler decides who runs first)."""

    def __init__(
        self,
        app: FastAPI,
        handlers: dict[str, Callable],
        concurrency: int = 4,
        poll_seconds: float = 1.0,
    ) -> None:
        self.app = app
        self.platform = app.state.platform
        self.handlers = handlers
        self.concurrency = concurrency
        self.poll_seconds = poll_seconds
        self._jobs: dict[str, asyncio.Task] = {}
        self.runner_id = f"runner_{uuid.uuid4().hex[:16]}"
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._watch())

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        """Stop every job where it is (requests in flight are aborted and run again on the next
        start)."""
        tasks = [t for t in (self._loop_task, *self._jobs.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self) -> None:
        db = self.platform.db
        while True:
            try:
                active = await db.run(self._claim)
                for batch_id in active:
                    if batch_id not in self._jobs:
                        task = asyncio.create_task(self._run(batch_id))
                        self._jobs[batch_id] = task
                        task.add_done_callback(lambda _t, b=batch_id: self._jobs.pop(b, None))
            except Exception:
                logger.exception("batch jobs could not be listed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_seconds)

    def _claim(self, session) -> list[str]:
        """The active jobs this process runs, after claiming those free or gone stale."""
        now = time.time()
        stale = now - max(LEASE_POLLS * self.poll_seconds, LEASE_MIN_SECONDS)
        mine = []
        for job in session.scalars(select(BatchJob).where(BatchJob.status.in_(ACTIVE))):
            claimed = session.execute(
                update(BatchJob)
                .where(
                    BatchJob.id == job.id,
                    or_(
                        BatchJob.runner.is_(None),
                        BatchJob.runner == self.runner_id,
                        BatchJob.heartbeat_at < stale,
                    ),
                )
                .values(runner=self.runner_id, heartbeat_at=now)
            )
            if claimed.rowcount:
                mine.append(job.id)
        return mine

    # -- one job ----------------------------------------------------------------------------

    async def _run(self, batch_id: str) -> None:
        try:
            job = await self._get(batch_id)
            if job.status == "validating":
                job = await self._validate(job)
            if job.status == "in_progress":
                job = await self._execute(job)
                if job is None:
                    return
            if job.status in ("finalizing", "cancelling", "expired"):
                await self._finalize(job)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            logger.exception("batch %s failed", batch_id)
            await self._set(batch_id, "failed", errors=[_error("server_error", str(error))])

    async def _get(self, batch_id: str) -> BatchJob:
        return await self.platform.db.run(lambda s: s.get(BatchJob, batch_id))

    async def _set(self, batch_id: str, status: str, **fields) -> BatchJob:
        def change(session) -> BatchJob:
            job = session.get(BatchJob, batch_id)
            if status != job.status:
                setattr(job, f"{status}_at", time.time())
            job.status = status
            for name, value in fields.items():
                setattr(job, name, value)
            return job

        return await self.platform.db.run(change)

    async def _save(self, batch_id: str, files: JobFiles) -> bool:
        """Save the counts of the job's files and renew this process's claim on the job;
        -> False (nothing saved) if the claim is another process's now."""
        completed, failed = len(files.succeeded), len(files.failed)

        def save(session) -> bool:
            renewed = session.execute(
                update(BatchJob)
                .where(BatchJob.id == batch_id, BatchJob.runner == self.runner_id)
                .values(completed=completed, failed=failed, heartbeat_at=time.time())
            )
            return bool(renewed.rowcount)

        return await self.platform.db.run(save)

    def _input_path(self, job: BatchJob) -> Path | None:
        stored = self.platform.db.transaction(lambda s: s.get(StoredFile, job.input_file_id))
        return Path(stored.storage_path) if stored is not None else None

    async def _validate(self, job: BatchJob) -> BatchJob:
        path = await asyncio.to_thread(self._input_path, job)
        if path is None:
            return await self._set(
                job.id, "failed", errors=[_error("invalid_request", "the input file is gone")]
            )
        requests, errors = await asyncio.to_thread(parse_input, path, job.endpoint)
        if not errors:
            errors = await self._check_budget(job, requests)
        if errors:
            return await self._set(job.id, "failed", errors=errors, total=len(requests))
        return await self._set(job.id, "in_progress", total=len(requests))

    async def _check_budget(self, job: BatchJob, requests: list[dict]) -> list[dict]:
        caller = await self.platform.db.run(lambda s: caller_by_key_id(s, job.key_id))
        budget = caller.limits.batch_tokens_per_day if isinstance(caller, Caller) else None
        if budget is None:
            return []
        needed = sum(estimated_tokens(item) for item in requests)
        used = await self.platform.db.run(lambda s: batch_tokens_today(s, job.key_id))
        if used + needed <= budget:
            return []
        message = (
            f"this batch may use about {needed} tokens; the key's batch budget is {budget} "
            f"tokens a day and {used} are used today"
        )
        return [_error("token_limit_exceeded", message)]

    async def _execute(self, job: BatchJob) -> BatchJob | None:
        """Run the requests without a line yet. -> the job after, None if it was lost."""
        path = await asyncio.to_thread(self._input_path, job)
        if path is None:
            return await self._set(
                job.id, "failed", errors=[_error("invalid_request", "the input file is gone")]
            )
        requests, _ = await asyncio.to_thread(parse_input, path, job.endpoint)
        folder = job_dir(self.platform.settings.data_dir, job.id)
        files = await asyncio.to_thread(JobFiles, folder)  # the files are the truth
        queue: asyncio.Queue[dict] = asyncio.Queue()
        for item in requests:
            if not files.has(item["custom_id"]):
                queue.put_nowait(item)

        async def worker() -> None:
            while not queue.empty():
                item = queue.get_nowait()
                await asyncio.to_thread(files.look)
                if files.has(item["custom_id"]):
                    continue  # a process that held the job before ran it
                line, ok = await self._run_line(job, item)
                await asyncio.to_thread(files.record, item["custom_id"], line, ok)

        workers = [asyncio.create_task(worker()) for _ in range(self.concurrency)]
        status = await self._supervise(job, workers, files)
        await asyncio.to_thread(files.look)  # lines a late process wrote count too
        if status is None or not await self._save(job.id, files):
            return None  # another process took the job over
        if status == "in_progress":
            return await self._set(job.id, "finalizing")
        return await self._get(job.id)

    async def _supervise(
        self, job: BatchJob, workers: list[asyncio.Task], files: JobFiles
    ) -> str | None:
        """Wait for the workers, saving the counts and renewing the claim as they go; stop them
        if the job is cancelled or expires, or once the claim is another process's (it found
        this one silent past the lease). -> the job's status then, None if the job was lost."""
        pending = set(workers)
        try:
            while pending:
                _, pending = await asyncio.wait(pending, timeout=self.poll_seconds)
                if not await self._save(job.id, files):
                    logger.warning("batch %s: another process took the job over", job.id)
                    return None
                status = (await self._get(job.id)).status  # cancelled through any process?
                if status == "in_progress" and time.time() > job.expires_at:
                    status = (await self._set(job.id, "expired")).status
                if status != "in_progress":
                    return status  # the workers left are stopped below
            for task in workers:
                task.result()  # a worker's own failure fails the job
            return "in_progress"
        finally:
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _run_line(self, job: BatchJob, item: dict) -> tuple[dict, bool]:
        """(the output line of one request, whether it succeeded)."""
        line_id = f"batch_req_{uuid.uuid4().hex[:24]}"
        custom_id, body = item["custom_id"], item["body"]
        if body.get("stream"):
            error = APIError(400, "stream is not served in a batch", param="body.stream")
            return _line(line_id, custom_id, error.status, line_id, error.body()), False
        raw = json.dumps(body).encode()
        while True:
            found = await self.platform.db.run(lambda s: caller_by_key_id(s, job.key_id))
            if not isinstance(found, Caller):
                error = APIError(401, "the batch's API key was revoked or its tenant disabled")
                return _line(line_id, custom_id, error.status, line_id, error.body()), False
            request = _internal_request(self.app, job.endpoint, raw, BatchOrigin(found, job.id))
            try:
                response = await self.handlers[job.endpoint](request)
            except APIError as error:
                wait = _retry_after(error)
                if wait is not None:
                    await asyncio.sleep(wait)
                    continue
                return _line(line_id, custom_id, error.status, line_id, error.body()), False
            except Exception as error:  # the route's own failure: the line says so, the job goes on
                logger.exception("batch %s: request %s failed", job.id, line_id)
                failure = APIError(500, f"the request failed: {error}", SERVER_ERROR)
                return _line(line_id, custom_id, 500, line_id, failure.body()), False
            reply = json.loads(response.body)
            return _line(line_id, custom_id, 200, reply.get("id", line_id), reply), True

    async def _finalize(self, job: BatchJob) -> None:
        """Make the output and error files downloadable; the job ends completed or cancelled."""
        folder = job_dir(self.platform.settings.data_dir, job.id)
        end = {"cancelling": "cancelled", "expired": "expired"}.get(job.status, "completed")

        def finish(session) -> None:
            current = session.get(BatchJob, job.id)
            for kind, name in (("output", "output.jsonl"), ("error", "errors.jsonl")):
                path = folder / name
                empty = not path.exists() or not path.stat().st_size
                if getattr(current, f"{kind}_file_id") or empty:
                    continue
                stored = StoredFile(
                    tenant_id=current.tenant_id,
                    purpose="batch_output",
                    filename=f"{current.id}_{kind}.jsonl",
                    size_bytes=path.stat().st_size,
                    storage_path=str(path),
                )
                session.add(stored)
                session.flush()
                setattr(current, f"{kind}_file_id", stored.id)
            if current.status != end:
                current.status = end
                setattr(current, f"{end}_at", time.time())

        await self.platform.db.run(finish)


def batch_tokens_today(session, key_id: str) -> int:
    """Tokens the key's batch requests used since UTC midnight."""
    midnight = time.time() // 86400 * 86400
    total = session.scalar(
        select(func.coalesce(func.sum(Usage.prompt_tokens + Usage.completion_tokens), 0)).where(
            Usage.key_id == key_id, Usage.batch_id.is_not(None), Usage.created_at >= midnight
        )
    )
    return int(total or 0)


def _line(line_id: str, custom_id: str, status: int, request_id: str, body: dict) -> dict:
    return {
        "id": line_id,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def _error(code: str, message: str) -> dict:
    return {"code": code, "message": message, "param": None, "line": None}


def _retry_after(error: APIError) -> float | None:
    """Seconds to wait before running a refused request again; None if it is not retried."""
    if error.status == 429 or (error.status == 503 and error.code in ("overloaded", "starting")):
        try:
            return max(float(error.headers.get("retry-after", RETRY_SECONDS)), 0.05)
        except ValueError:
            return RETRY_SECONDS
    return None
