"""/v1/jobs: parse, authorise, call `service.jobs`. No rows are built and no Ray is called here."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Header, Query, Response, status
from fastapi.responses import PlainTextResponse, StreamingResponse
from sqlmodel import Session

from api.deps import CallerDep, RuntimeDep, SessionDep
from api.schemas import Accepted, AttemptPublic, CheckpointPublic, EventPublic, JobList, JobPublic, MetricPoint
from service import jobs
from service.errors import InfraError, InvalidSpec, NotFound
from service.models import ClusterSnapshot, Job, JobState
from service.spec import JobSpec

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=255)]


def to_public(job: Job, session: Session) -> JobPublic:
    snap = session.get(ClusterSnapshot, 1)
    sub_id = f"shunter-{job.id}-{job.attempt}" if job.attempt else None
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


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobPublic)
def submit_job(
    spec: JobSpec, session: SessionDep, caller: CallerDep, response: Response, idempotency_key: IdempotencyKey = None
) -> JobPublic:
    """Queue a training job. With `Idempotency-Key`, a replay of the same body returns the first job (200)."""
    job, created = jobs.submit(session, spec, caller=caller, idempotency_key=idempotency_key)
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
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> JobList:
    """Jobs, newest first. Pass `next_cursor` back as `cursor` for the next page."""
    before = _decode_cursor(cursor) if cursor else None
    rows = jobs.list_jobs(session, caller=caller, state=state, queue=queue, name=name, limit=limit + 1, before=before)
    page = rows[:limit]
    next_cursor = _encode_cursor(page[-1]) if len(rows) > limit else None
    return JobList(items=[to_public(j, session) for j in page], next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobPublic)
def get_job(job_id: str, session: SessionDep, caller: CallerDep) -> JobPublic:
    return to_public(jobs.get(session, job_id, caller=caller), session)


@router.post("/{job_id}/cancel", status_code=status.HTTP_202_ACCEPTED, response_model=Accepted)
def cancel_job(job_id: str, session: SessionDep, caller: CallerDep) -> Accepted:
    """Ask for a cancel; a running job's Ray Job is stopped by the dispatcher and ends CANCELLED."""
    job = jobs.cancel(session, job_id, caller=caller)
    session.commit()
    return Accepted(id=job.id, state=job.state, detail="cancel requested")


@router.post("/{job_id}/retry", status_code=status.HTTP_202_ACCEPTED, response_model=Accepted)
def retry_job(job_id: str, session: SessionDep, caller: CallerDep) -> Accepted:
    """Queue a FAILED or CANCELLED job again; it resumes from its last good checkpoint."""
    job = jobs.retry(session, job_id, caller=caller)
    session.commit()
    return Accepted(id=job.id, state=job.state, detail="queued again")


@router.get("/{job_id}/events", response_model=list[EventPublic])
def job_events(
    job_id: str, session: SessionDep, caller: CallerDep, after: Annotated[int, Query(ge=0)] = 0
) -> list[EventPublic]:
    job = jobs.get(session, job_id, caller=caller)
    return [EventPublic.model_validate(e) for e in jobs.events(session, job, after_id=after)]


@router.get("/{job_id}/attempts", response_model=list[AttemptPublic])
def job_attempts(job_id: str, session: SessionDep, caller: CallerDep) -> list[AttemptPublic]:
    job = jobs.get(session, job_id, caller=caller)
    return [AttemptPublic.model_validate(a) for a in jobs.attempts(session, job)]


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointPublic])
def job_checkpoints(job_id: str, session: SessionDep, caller: CallerDep) -> list[CheckpointPublic]:
    job = jobs.get(session, job_id, caller=caller)
    return [CheckpointPublic.model_validate(c) for c in jobs.checkpoints(session, job)]


@router.get("/{job_id}/metrics", response_model=list[MetricPoint])
def job_metrics(
    job_id: str,
    session: SessionDep,
    caller: CallerDep,
    name: Annotated[str | None, Query(max_length=128)] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> list[MetricPoint]:
    job = jobs.get(session, job_id, caller=caller)
    return [MetricPoint.model_validate(m) for m in jobs.metric_series(session, job, name=name, limit=limit)]


@router.get("/{job_id}/logs", response_class=PlainTextResponse)
def job_logs(
    job_id: str,
    session: SessionDep,
    caller: CallerDep,
    runtime: RuntimeDep,
    attempt: Annotated[int | None, Query(ge=1)] = None,
    follow: bool = False,
) -> Response:
    """The attempt's driver log (worker output included). Kept by shunter once the attempt ends."""
    job = jobs.get(session, job_id, caller=caller)
    number = attempt or job.attempt
    if number == 0:
        return PlainTextResponse("")
    rows = {a.number: a for a in jobs.attempts(session, job)}
    if number not in rows:
        raise NotFound(f"job {job_id} has no attempt {number}")
    if follow:
        return StreamingResponse(_follow(runtime, job.id, number), media_type="text/plain")
    return PlainTextResponse(_read_log(runtime, rows[number].submission_id, rows[number].log_uri) or "")


def _read_log(runtime: object, submission_id: str, log_uri: str | None) -> str | None:
    if log_uri and Path(log_uri).exists():
        return Path(log_uri).read_text(errors="replace")
    try:
        return runtime.ray.logs(submission_id)  # type: ignore[attr-defined]
    except InfraError:
        return None


async def _follow(runtime: object, job_id: str, number: int) -> AsyncIterator[str]:
    """Stream new log text until the attempt has ended, then the rest from shunter's stored copy."""
    sent = 0
    engine = runtime.engine  # type: ignore[attr-defined]
    while True:
        with Session(engine) as session:
            job = session.get(Job, job_id)
            row = next((a for a in jobs.attempts(session, job) if a.number == number), None) if job else None
        if row is None:
            return
        ended = row.ended_at is not None
        text = await asyncio.to_thread(_read_log, runtime, row.submission_id, row.log_uri if ended else None) or ""
        if len(text) > sent:
            yield text[sent:]
            sent = len(text)
        if ended:
            return
        await asyncio.sleep(1.0)
