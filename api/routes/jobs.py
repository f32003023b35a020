"""/v1/jobs: parse, authorise, call `service.jobs`. No rows are built and no Ray is called here."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path as FsPath
from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Response, status
from fastapi.responses import PlainTextResponse, StreamingResponse
from sqlalchemy.engine import Engine
from sqlmodel import Session

from api.deps import CallerDep, RuntimeDep, SessionDep, SettingsDep
from api.routes.events import After, Follow, LastEventId, StreamTimeout
from api.schemas import (
    ERROR_RESPONSES,
    Accepted,
    AttemptPublic,
    CheckpointPublic,
    EventPublic,
    JobList,
    JobPublic,
    MetricPoint,
)
from api.sse import SSE_RESPONSE, event_stream
from service import jobs
from service.backend import submission_id
from service.errors import InfraError, InvalidSpec, NotFound
from service.models import Attempt, ClusterSnapshot, Job, JobState
from service.runtime import Runtime
from service.spec import JobSpec

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERROR_RESPONSES)
FOLLOW_POLL_SECONDS = 1.0
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=255)]
# Ids are ours ("j" + hex); anything else cannot name a job, and odd bytes never reach the database.
JobId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


def to_public(job: Job, session: Session) -> JobPublic:
    snap = session.get(ClusterSnapshot, 1)
    sub_id = submission_id(job.id, job.attempt) if job.attempt else None
    dashboard = f"{snap.dashboard_url}/#/jobs/{sub_id}" if snap and snap.dashboard_url and sub_id else None
    loss = (job.latest_metrics or {}).get("loss")
    return JobPublic.model_validate(job).model_copy(
        update={"ray_submission_id": sub_id, "ray_dashboard_url": dashboard, "loss": loss}
    )


def _encode_cursor(job: Job) -> str:
    return base64.urlsafe_b64encode(f"{job.created_at.isoformat()}|{job.id}".encode()).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        created, _, job_id = base64.urlsafe_b64decode(cursor.encode()).decode().partition("|")
        return datetime.fromisoformat(created), job_id
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidSpec("cursor: not a cursor this API returned", field="cursor") from exc


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobPublic,
    responses={200: {"model": JobPublic, "description": "a replay of the same Idempotency-Key and body"}},
)
def submit_job(
    spec: JobSpec,
    session: SessionDep,
    caller: CallerDep,
    settings: SettingsDep,
    response: Response,
    idempotency_key: IdempotencyKey = None,
) -> JobPublic:
    """Queue a training job. With `Idempotency-Key`, a replay of the same body returns the first job (200)."""
    job, created = jobs.submit(session, spec, caller=caller, idempotency_key=idempotency_key, settings=settings)
    session.commit()
    if not created:
        response.status_code = status.HTTP_200_OK
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return to_public(job, session)


@router.get("", response_model=JobList)
def list_jobs(
    session: SessionDep,
    caller: CallerDep,
    state: JobState | None = None,
    queue: Annotated[str | None, Query(max_length=64)] = None,
    name: Annotated[str | None, Query(max_length=128)] = None,
    owner: Annotated[str | None, Query(max_length=128, description="admins: only this owner's jobs")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> JobList:
    """Jobs, newest first. Pass `next_cursor` back as `cursor` for the next page."""
    before = _decode_cursor(cursor) if cursor else None
    rows = jobs.list_jobs(
        session, caller=caller, state=state, queue=queue, name=name, owner=owner, limit=limit + 1, before=before
    )
    page = rows[:limit]
    next_cursor = _encode_cursor(page[-1]) if len(rows) > limit else None
    return JobList(items=[to_public(j, session) for j in page], next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobPublic)
def get_job(job_id: JobId, session: SessionDep, caller: CallerDep) -> JobPublic:
    return to_public(jobs.get(session, job_id, caller=caller), session)


@router.post("/{job_id}/cancel", status_code=status.HTTP_202_ACCEPTED, response_model=Accepted)
def cancel_job(job_id: JobId, session: SessionDep, caller: CallerDep) -> Accepted:
    """Ask for a cancel; a running job's Ray Job is stopped by the dispatcher and ends CANCELLED."""
    job = jobs.cancel(session, job_id, caller=caller)
    session.commit()
    return Accepted(id=job.id, state=job.state, detail="cancel requested")


@router.post("/{job_id}/retry", status_code=status.HTTP_202_ACCEPTED, response_model=Accepted)
def retry_job(job_id: JobId, session: SessionDep, caller: CallerDep) -> Accepted:
    """Queue a FAILED or CANCELLED job again; it resumes from its last good checkpoint."""
    job = jobs.retry(session, job_id, caller=caller)
    session.commit()
    return Accepted(id=job.id, state=job.state, detail="queued again")


@router.get("/{job_id}/events", response_model=list[EventPublic], responses=SSE_RESPONSE)
def job_events(
    job_id: JobId,
    session: SessionDep,
    caller: CallerDep,
    runtime: RuntimeDep,
    after: After = 0,
    follow: Follow = False,
    timeout_seconds: StreamTimeout = None,
    last_event_id: LastEventId = None,
) -> Response | list[EventPublic]:
    """The job's timeline, oldest first. `follow=true` streams it (SSE) and ends after the job's terminal event."""
    job = jobs.get(session, job_id, caller=caller)
    start = max(after, last_event_id or 0)
    if follow:
        return event_stream(runtime.engine, caller=caller, job_id=job.id, after=start, timeout_seconds=timeout_seconds)
    return [EventPublic.model_validate(e) for e in jobs.events(session, job, after_id=start)]


@router.get("/{job_id}/attempts", response_model=list[AttemptPublic])
def job_attempts(job_id: JobId, session: SessionDep, caller: CallerDep) -> list[AttemptPublic]:
    job = jobs.get(session, job_id, caller=caller)
    return [AttemptPublic.model_validate(a) for a in jobs.attempts(session, job)]


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointPublic])
def job_checkpoints(job_id: JobId, session: SessionDep, caller: CallerDep) -> list[CheckpointPublic]:
    job = jobs.get(session, job_id, caller=caller)
    return [CheckpointPublic.model_validate(c) for c in jobs.checkpoints(session, job)]


@router.get("/{job_id}/metrics", response_model=list[MetricPoint])
def job_metrics(
    job_id: JobId,
    session: SessionDep,
    caller: CallerDep,
    name: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> list[MetricPoint]:
    job = jobs.get(session, job_id, caller=caller)
    return [MetricPoint.model_validate(m) for m in jobs.metric_series(session, job, name=name, limit=limit)]


@router.get(
    "/{job_id}/logs",
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "the log text"}},
)
def job_logs(
    job_id: JobId,
    session: SessionDep,
    caller: CallerDep,
    runtime: RuntimeDep,
    attempt: Annotated[int | None, Query(ge=1, le=10_000)] = None,
    follow: bool = False,
) -> Response:
    """The attempt's driver log (worker output included). Kept by shunter once the attempt ends.

    `follow=true` streams until the attempt ends (without `attempt`: until the job ends, attempt after attempt);
    the final text comes from shunter's stored copy, so the last lines are never lost.
    """
    job = jobs.get(session, job_id, caller=caller)
    if follow:
        return StreamingResponse(_follow(runtime, job.id, attempt), media_type="text/plain")
    number = attempt or job.attempt
    if number == 0:
        return PlainTextResponse("")
    rows = {a.number: a for a in jobs.attempts(session, job)}
    if number not in rows:
        raise NotFound(f"job {job_id} has no attempt {number}")
    text = _read_log(runtime, rows[number].submission_id, rows[number].log_uri)
    if text is None and rows[number].ended_at is None:
        raise InfraError(f"the log of running attempt {number} is with Ray, which does not answer; try again")
    return PlainTextResponse(text or "")


def _read_log(runtime: Runtime, submission_id: str, log_uri: str | None) -> str | None:
    """Shunter's stored copy if there is one, else what Ray has (None when Ray does not answer)."""
    if log_uri and FsPath(log_uri).exists():
        return FsPath(log_uri).read_text(errors="replace")
    try:
        return runtime.ray.logs(submission_id)
    except InfraError:
        return None


def _attempt_state(engine: Engine, job_id: str, number: int | None) -> tuple[Job | None, Attempt | None]:
    with Session(engine, expire_on_commit=False) as session:
        job = session.get(Job, job_id)
        if job is None:
            return None, None
        wanted = number or job.attempt
        row = next((a for a in jobs.attempts(session, job) if a.number == wanted), None)
        return job, row


async def _follow(runtime: Runtime, job_id: str, pinned: int | None) -> AsyncIterator[str]:
    """Stream an attempt's new log text until it ends, then the rest of shunter's stored copy; unpinned, go on to
    the next attempt until the job itself ends."""
    number, sent = pinned, 0
    while True:
        job, row = await asyncio.to_thread(_attempt_state, runtime.engine, job_id, number)
        if job is None:
            return
        if row is None:  # not admitted yet (or an attempt that never existed)
            if pinned is not None or JobState(job.state).is_terminal:
                return
            await asyncio.sleep(FOLLOW_POLL_SECONDS)
            continue
        if number is None:
            number = row.number
        ended = row.ended_at is not None
        # Once the attempt has ended its log_uri is final: read the stored copy (or Ray, if it could not be kept).
        text = await asyncio.to_thread(_read_log, runtime, row.submission_id, row.log_uri if ended else None) or ""
        if len(text) > sent:
            yield text[sent:]
            sent = len(text)
        if ended:
            if pinned is not None or (JobState(job.state).is_terminal and job.attempt == number):
                return
            if job.attempt > number:  # a retry was admitted: follow it
                number, sent = number + 1, 0
                yield f"\n--- shunter: attempt {number} ---\n"
                continue
        await asyncio.sleep(FOLLOW_POLL_SECONDS)
