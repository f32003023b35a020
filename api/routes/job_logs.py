"""/v1/jobs/{id}/logs: a job's log, read by range or followed. No rows are built here; a running attempt's log is
read from Ray through `RayLogs` (service.lifecycle.log_reads), an ended one from shunter's stored copy."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.responses import StreamingResponse
from sqlalchemy.engine import Engine
from sqlmodel import Session

from api.deps import CallerDep, RuntimeDep, SessionDep
from api.gate import step_aside
from api.routes.events import StreamTimeout
from api.routes.jobs import JobId
from api.schemas import (
    ERROR_RESPONSES,
    STREAM_ERROR_RESPONSES,
)
from api.sse import pause
from api.streams import DB_UNAVAILABLE, is_database_outage, open_stream, slots_of, state_of
from service.core.errors import InfraError, NotFound
from service.dispatch.host_files import HostFiles
from service.lifecycle import jobs
from service.lifecycle.log_reads import (
    FOLLOW_READ_MAX,
    MaskedReader,
    RayLogReader,
    RayLogs,
    byte_range,
    file_chunks,
    file_reader,
    open_stored,
    ray_chunks,
    read_at,
    started,
    stored_size,
    stored_tail,
    tail_offset,
)
from service.runtime import Runtime
from service.store.models import Attempt, Job, JobState
from service.tenancy.secret_store import masker_for

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERROR_RESPONSES)
FOLLOW_POLL_SECONDS = 1.0
MAX_LOG_BYTES = 64 << 20  # the most `limit_bytes` may ask for in one answer
TEXT = "text/plain; charset=utf-8"


_NEXT_OFFSET = {
    "X-Next-Offset": {
        "description": "the byte offset just past this answer: pass it as `offset` to read on",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}
LOG_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"text/plain": {"schema": {"type": "string"}}},
        "description": "the log text (bytes of the UTF-8 log from `offset`), or with `follow=true` a stream of it",
        "headers": _NEXT_OFFSET,
    },
    **STREAM_ERROR_RESPONSES,
}
Tail = Annotated[int | None, Query(ge=1, le=100_000, description="only the last N lines (at or after `offset`)")]
Offset = Annotated[int | None, Query(ge=0, le=2**62, description="start at this byte of the log")]
LimitBytes = Annotated[int | None, Query(ge=1, le=MAX_LOG_BYTES, description="answer at most this many bytes")]


@router.get("/{job_id}/logs", response_class=Response, responses=LOG_RESPONSES)
def job_logs(
    job_id: JobId,
    request: Request,
    session: SessionDep,
    caller: CallerDep,
    runtime: RuntimeDep,
    attempt: Annotated[int | None, Query(ge=1, le=10_000)] = None,
    follow: bool = False,
    tail: Tail = None,
    offset: Offset = None,
    limit_bytes: LimitBytes = None,
    timeout_seconds: StreamTimeout = None,
) -> Response:
    """The attempt's driver log (worker output included). Kept by shunter once the attempt ends.

    Ranged: `offset` (a byte of the log), `tail` (the last N lines), `limit_bytes`; `X-Next-Offset` is where the
    answer ends (pass it back as `offset` to read on). `follow=true` streams from there until the attempt ends
    (without `attempt`: until the job ends, attempt after attempt), or `timeout_seconds` / `stream_max_seconds`;
    the final text comes from shunter's stored copy, so the last lines are never lost.
    """
    job = jobs.get(session, job_id, caller=caller)
    files = HostFiles(runtime.settings.data_dir)
    if follow:
        body = functools.partial(
            _follow, runtime, files, ray_logs_of(request.app), job.id, attempt, offset=offset or 0, tail=tail
        )
        return open_stream(
            request.app, caller, runtime.settings, body, timeout_seconds=timeout_seconds, media_type=TEXT
        )
    number = attempt or job.attempt
    if number == 0:
        return Response(b"", media_type=TEXT, headers={"X-Next-Offset": "0"})
    rows = {a.number: a for a in jobs.attempts(session, job)}
    if number not in rows:
        raise NotFound(f"job {job_id} has no attempt {number}")
    row = rows[number]
    # Nothing below reads the database through the request's session: it gives its pooled connection back now. A
    # read that waits (below) or asks Ray never holds one while it does (45 waiting reads held every connection of
    # SQLite's pool, 20 PostgreSQL's, and stalled everyone's requests: issue 35).
    session.close()
    if _log_still_coming(row):
        # The wait takes one of the caller's stream slots, as a follow does (429 beyond `max_streams_per_caller`).
        slot = slots_of(request.app).acquire(caller.owner, runtime.settings.max_streams_per_caller)
        step_aside(request)  # it waits on the dispatcher, not the CPU: its place in the gate goes to others
        try:
            row = _final_log_awaited(runtime.engine, job.id, row)
        finally:
            slot.release()
    # The path is built from ids, never read from the row: a row's log_uri names no file the API will open.
    stored = open_stored(files.log_path(job.id, number))
    if stored is not None:
        handle, size = stored
        try:
            start, end = byte_range(file_reader(handle), size, offset=offset, tail=tail, limit=limit_bytes)
        except BaseException:
            handle.close()
            raise
        headers = {"X-Next-Offset": str(end), "Content-Length": str(end - start)}
        return StreamingResponse(file_chunks(handle, start, end), media_type=TEXT, headers=headers)
    # A running attempt's log is Ray's, read by byte range: this request holds at most two blocks of it
    # (`ray_log_block_bytes`), whatever its size (issue 35).
    block = runtime.settings.ray_log_block_bytes
    try:
        view = ray_logs_of(request.app).view(runtime.ray, row.submission_id, max_age=FOLLOW_POLL_SECONDS, block=block)
    except InfraError:
        if row.ended_at is None:
            detail = f"the log of running attempt {number} is with Ray, which does not answer; try again"
            raise InfraError(detail) from None
        view = None  # an ended attempt whose log was not kept: what there is, is nothing
    if view is None:  # Ray has no such submission: not submitted yet (the row is written first), or its log is gone
        return Response(b"", media_type=TEXT, headers={"X-Next-Offset": "0"})
    # The job's secret values are starred out of what Ray has (shunter's copy was, when it was kept).
    reader = MaskedReader(RayLogReader(runtime.ray, view, block), masker_for(runtime.engine, runtime.settings, job.id))
    start, end = byte_range(reader.read, view.size, offset=offset, tail=tail, limit=limit_bytes)
    return StreamingResponse(started(reader.chunks(start, end)), media_type=TEXT, headers={"X-Next-Offset": str(end)})


LATE_LOG_WAIT_SECONDS = 15.0


def _log_still_coming(row: Attempt) -> bool:
    return row.driver_ended_at is not None and row.ray_status is None


def _final_log_awaited(engine: Engine, job_id: str, row: Attempt) -> Attempt:
    """An attempt ended on its driver's word has its whole log kept once its Ray Job exits, seconds later (Ray's
    teardown; worker lines Ray still forwards): a read in between waits for that, up to `LATE_LOG_WAIT_SECONDS`,
    so that the log of a job seen SUCCEEDED is whole. Past that, what Ray has now. Each look is a short session of
    its own: nothing is held between them."""
    deadline = time.monotonic() + LATE_LOG_WAIT_SECONDS
    while _log_still_coming(row) and time.monotonic() < deadline:
        time.sleep(0.25)
        _, fresh = _attempt_state(engine, job_id, row.number)
        if fresh is None:
            break
        row = fresh
    return row


def ray_logs_of(app: FastAPI) -> RayLogs:
    return state_of(app, "ray_logs", RayLogs)


def _attempt_state(engine: Engine, job_id: str, number: int | None) -> tuple[Job | None, Attempt | None]:
    with Session(engine, expire_on_commit=False) as session:
        job = session.get(Job, job_id)
        if job is None:
            return None, None
        wanted = number or job.attempt
        row = next((a for a in jobs.attempts(session, job) if a.number == wanted), None)
        return job, row


async def _follow(
    runtime: Runtime,
    files: HostFiles,
    ray_logs: RayLogs,
    job_id: str,
    pinned: int | None,
    deadline: float,
    *,
    offset: int,
    tail: int | None,
) -> AsyncIterator[bytes]:
    """Stream an attempt's new log text until it ends, then the rest of shunter's stored copy; unpinned, go on to
    the next attempt until the job itself ends. Only new bytes are sent; a running attempt's Ray log is fetched
    once per poll for all followers in this process (`RayLogs`), and no connection is held between polls."""
    number, sent, pending_tail = pinned, offset, tail
    while True:
        try:
            job, row = await asyncio.to_thread(_attempt_state, runtime.engine, job_id, number)
        except DB_UNAVAILABLE as exc:
            if not is_database_outage(exc):
                raise
            log.warning("log follow: the database does not answer; trying again", exc_info=True)
            if not await pause(deadline, FOLLOW_POLL_SECONDS):
                return
            continue
        if job is None:
            return
        if row is None:  # not admitted yet (or an attempt that never existed)
            if pinned is not None or JobState(job.state).is_terminal:
                return
            if not await pause(deadline, FOLLOW_POLL_SECONDS):
                return
            continue
        if number is None:
            number = row.number
        # An attempt ended on its driver's word has its log kept once its Ray Job has exited
        # (service.dispatch.late_logs): until then its last lines are still to come from Ray.
        ended = row.ended_at is not None and not (row.driver_ended_at is not None and row.ray_status is None)
        # Once the attempt has ended its stored copy is final: read on from where we are (or Ray, if it was not kept).
        path = files.log_path(job_id, number)
        size = await asyncio.to_thread(stored_size, path) if ended else None
        if size is not None:
            if pending_tail is not None:
                sent = max(sent, await asyncio.to_thread(stored_tail, path, size, pending_tail, sent))
                pending_tail = None
            while sent < size and time.monotonic() < deadline:
                chunk = await asyncio.to_thread(read_at, path, sent, min(FOLLOW_READ_MAX, size - sent))
                if not chunk:
                    break
                yield chunk
                sent += len(chunk)
        else:
            block = runtime.settings.ray_log_block_bytes
            try:
                view = await asyncio.to_thread(ray_logs.view, runtime.ray, row.submission_id,
                                               max_age=FOLLOW_POLL_SECONDS, block=block)  # fmt: skip
            except InfraError as exc:  # Ray is away: look again at the next poll
                log.warning("log follow of %s: %s", row.submission_id, exc.detail)
                view = None
            if view is not None:
                masker = await asyncio.to_thread(masker_for, runtime.engine, runtime.settings, job_id)
                reader = MaskedReader(RayLogReader(runtime.ray, view, block), masker)
                try:
                    if pending_tail is not None:
                        floor = min(sent, view.size)
                        sent = max(sent, await asyncio.to_thread(tail_offset, reader.read, view.size, pending_tail,
                                                                 floor=floor))  # fmt: skip
                        pending_tail = None
                    async for chunk in ray_chunks(reader, sent, view.size, deadline):
                        yield chunk
                        sent += len(chunk)
                except InfraError as exc:  # Ray broke off: read on from where this got, at the next poll
                    log.warning("log follow of %s: %s", row.submission_id, exc.detail)
        if ended:
            if pinned is not None or (JobState(job.state).is_terminal and job.attempt == number):
                return
            if job.attempt > number:  # a retry was admitted: follow it
                number, sent = number + 1, 0
                yield f"\n--- shunter: attempt {number} ---\n".encode()
                continue
        if not await pause(deadline, FOLLOW_POLL_SECONDS):
            return
