"""/v1/jobs: parse, authorise, call `service.lifecycle.jobs`. No rows are built and no Ray is called here."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Path, Query, Request, Response, status
from sqlmodel import Session

from api import cursors
from api.deps import CallerDep, RuntimeDep, SessionDep, SettingsDep
from api.routes.events import After, Follow, LastEventId, StreamTimeout, resume_after
from api.schemas import (
    ERROR_RESPONSES,
    SPEC_BUDGET_RESPONSES,
    Accepted,
    AttemptPublic,
    CheckpointPublic,
    DependencyPublic,
    EventPublic,
    JobList,
    JobPublic,
    MetricPoint,
    Position,
    Validated,
)
from api.sse import SSE_RESPONSE, event_stream
from service import estimate
from service.core.backend import submission_id
from service.core.errors import InvalidSpec
from service.lifecycle import jobs
from service.spec.job import JobSpec
from service.store.models import ClusterSnapshot, Job, JobState
from service.workflows import dependencies

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=ERROR_RESPONSES)
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=255)]
# Ids are ours ("j" + hex); anything else cannot name a job, and odd bytes never reach the database.
JobId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


def to_public(job: Job, session: Session) -> JobPublic:
    sub_id = submission_id(job.id, job.attempt) if job.attempt else None
    snap = session.get(ClusterSnapshot, 1) if sub_id else None  # a job never admitted has no Ray Job to link to
    dashboard = f"{snap.dashboard_url}/#/jobs/{sub_id}" if snap and snap.dashboard_url else None
    loss = (job.latest_metrics or {}).get("loss")
    return JobPublic.model_validate(job).model_copy(
        update={"ray_submission_id": sub_id, "ray_dashboard_url": dashboard, "loss": loss}
    )


def _with_dependencies(public: JobPublic, job: Job, session: Session) -> JobPublic:
    if not job.spec.get("depends_on"):
        return public
    found = [DependencyPublic.model_validate(d) for d in dependencies.describe(session, job)]
    return public.model_copy(update={"dependencies": found})


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobPublic,
    responses={
        200: {"model": JobPublic, "description": "a replay of the same Idempotency-Key and body"},
        **SPEC_BUDGET_RESPONSES,
    },
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
    job, created = jobs.submit(session, spec, caller=caller, idempotency_key=idempotency_key, settings=settings,
                               written_at_once=True)  # fmt: skip
    session.commit()
    if not created:
        response.status_code = status.HTTP_200_OK
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return _with_dependencies(to_public(job, session), job, session)


@router.post("/validate", response_model=Validated, responses=SPEC_BUDGET_RESPONSES)
def validate_job(spec: JobSpec, session: SessionDep, caller: CallerDep, settings: SettingsDep) -> Validated:
    """Every check a submission runs (the spec, what this caller may ask, the queue, the cluster's fit, named code
    archives, the spec budget), without queueing: 200 with what it would be told, or the 4xx a submission would
    get. Nothing is written (`shunter submit --dry-run`)."""
    try:
        job, _ = jobs.submit(session, spec, caller=caller, settings=settings)
        return Validated(state_reason=job.state_reason, warnings=list(job.warnings or []),
                         spec=spec.model_dump(mode="json", exclude_unset=True))  # fmt: skip
    finally:
        session.rollback()  # the job's row, its event, a named archive's use: none of it is kept


_EVENTS_AFTER = {
    "X-Events-After": {
        "description": "the newest event id when the listing was read: follow /v1/events?after=<it> to miss no change",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}


SPEC_PAGE = 20  # jobs a page when each comes with its spec


@router.get("", response_model=JobList, responses={200: {"description": "a page of jobs", "headers": _EVENTS_AFTER}})
def list_jobs(
    session: SessionDep,
    caller: CallerDep,
    settings: SettingsDep,
    response: Response,
    state: JobState | None = None,
    queue: Annotated[str | None, Query(max_length=64)] = None,
    name: Annotated[str | None, Query(max_length=128)] = None,
    owner: Annotated[str | None, Query(max_length=128, description="admins: only this owner's jobs")] = None,
    sweep: Annotated[str | None, Query(max_length=32, description="only this sweep's members")] = None,
    positions: Annotated[bool, Query(description="give each queued job its position (the web page asks)")] = False,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
    include: Annotated[
        Literal["spec"] | None,
        Query(description=f"`spec`: each job with its spec (at most {SPEC_PAGE} a page); without it `spec` is null"),
    ] = None,
) -> JobList:
    """Jobs, newest first; a queued one with its `position`. Pass `next_cursor` back as `cursor` for the next page.
    Without `include=spec` the jobs come without their specs (`GET /v1/jobs/{id}` has it): a page of 100 jobs of
    large specs was 39 MiB (issue 35).

    `X-Events-After` is the newest event id when the listing was read: a client that renders this page and then
    follows `/v1/events?after=<it>` misses no change (an event it also saw in the page only repeats a state)."""
    if include == "spec" and limit > SPEC_PAGE:
        raise InvalidSpec(f"limit: at most {SPEC_PAGE} jobs a page with include=spec, got {limit}", field="limit")
    before = cursors.decode(cursor) if cursor else None
    # Read before the jobs: every event after it comes through the stream, every one up to it is in the rows.
    response.headers["X-Events-After"] = str(jobs.last_event_id(session))
    rows = jobs.list_jobs(
        session,
        caller=caller,
        state=state,
        queue=queue,
        name=name,
        owner=owner,
        sweep=sweep,
        limit=limit + 1,
        before=before,
    )
    page = rows[:limit]
    next_cursor = cursors.encode(page[-1]) if len(rows) > limit else None
    items = [to_public(j, session) for j in page]
    if include != "spec":
        items = [j.model_copy(update={"spec": None}) for j in items]
    if positions and any(j.state == JobState.QUEUED for j in items):
        standings = estimate.estimates_nowait(session, settings)  # never the whole forecast inline
        items = [_with_position(j, standings.get(j.id)) if j.state == JobState.QUEUED else j for j in items]
    return JobList(items=items, next_cursor=next_cursor)


def _with_position(public: JobPublic, standing: estimate.Standing | None) -> JobPublic:
    if standing is None:
        return public  # waiting on its dependencies, or queued since the last estimate: no place yet
    return public.model_copy(update={
        "position": Position(queue=standing.queue_position, overall=standing.position),
        "estimated_start": standing.start,
    })  # fmt: skip


@router.get("/{job_id}", response_model=JobPublic)
def get_job(job_id: JobId, session: SessionDep, settings: SettingsDep, caller: CallerDep) -> JobPublic:
    """The job; a queued one also says where it stands (`position`, `estimated_start`; see service/estimate.py)."""
    job = jobs.get(session, job_id, caller=caller)
    public = _with_dependencies(to_public(job, session), job, session)
    if job.state == JobState.QUEUED:
        public = _with_position(public, estimate.estimates(session, settings, job_id=job.id).get(job.id))
    return public


@router.post("/{job_id}/cancel", status_code=status.HTTP_202_ACCEPTED, response_model=Accepted)
def cancel_job(job_id: JobId, session: SessionDep, caller: CallerDep) -> Accepted:
    """Ask for a cancel; a running job's Ray Job is stopped by the dispatcher and ends CANCELLED."""
    job = jobs.cancel(session, job_id, caller=caller)
    session.commit()
    return Accepted(id=job.id, state=job.state, detail="cancel requested")


@router.post(
    "/{job_id}/retry", status_code=status.HTTP_202_ACCEPTED, response_model=Accepted, responses=SPEC_BUDGET_RESPONSES
)
def retry_job(job_id: JobId, session: SessionDep, caller: CallerDep, settings: SettingsDep) -> Accepted:
    """Queue a FAILED or CANCELLED job again; it resumes from its last good checkpoint."""
    job = jobs.retry(session, job_id, caller=caller, settings=settings)
    session.commit()
    return Accepted(id=job.id, state=job.state, detail="queued again")


# Paging of a job's events, checkpoints and metrics (issue 35: a job writes as many as it likes): each keeps its list
# shape, a page holds at most `limit` rows, and a full page says where the next one starts in X-Next-After.
NEXT_AFTER = "X-Next-After"
_NEXT_AFTER_HEADER = {
    NEXT_AFTER: {
        "description": "sent when the page is full and more rows may follow: pass it as `after` for the next page",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}
PAGED: dict[int | str, dict[str, Any]] = {200: {"description": "one page, oldest first", "headers": _NEXT_AFTER_HEADER}}
PAGE_SIZE = 1000
PageLimit = Annotated[int, Query(ge=1, le=10_000, description=f"at most this many rows (default {PAGE_SIZE})")]
RowAfter = Annotated[int, Query(ge=0, le=2**62, description="only rows after this position (a page's X-Next-After)")]


def _paged(response: Response, rows: list[Any], limit: int) -> list[Any]:
    if len(rows) >= limit:
        response.headers[NEXT_AFTER] = str(rows[-1].id)
    return rows


@router.get("/{job_id}/events", response_model=list[EventPublic],
            responses={**SSE_RESPONSE, 200: {**SSE_RESPONSE[200], "headers": _NEXT_AFTER_HEADER}})  # fmt: skip
def job_events(
    job_id: JobId,
    request: Request,
    response: Response,
    session: SessionDep,
    caller: CallerDep,
    runtime: RuntimeDep,
    after: After = 0,
    limit: PageLimit = PAGE_SIZE,
    follow: Follow = False,
    timeout_seconds: StreamTimeout = None,
    last_event_id: LastEventId = "",
) -> Response | list[EventPublic]:
    """The job's timeline, oldest first, a page of at most `limit` events after `after` (a full page names the next
    in `X-Next-After`). `follow=true` streams it (SSE) and ends after the job's terminal event (or at
    `timeout_seconds` / the server's `stream_max_seconds`; reconnect with `Last-Event-ID`)."""
    job = jobs.get(session, job_id, caller=caller)
    start = resume_after(after, last_event_id)
    if follow:
        return event_stream(
            request.app, runtime.engine, runtime.settings, caller=caller, job_id=job.id, after=start,
            timeout_seconds=timeout_seconds,
        )  # fmt: skip
    rows = _paged(response, jobs.events(session, job, after_id=start, limit=limit), limit)
    return [EventPublic.model_validate(e) for e in rows]


@router.get("/{job_id}/attempts", response_model=list[AttemptPublic])
def job_attempts(job_id: JobId, session: SessionDep, caller: CallerDep) -> list[AttemptPublic]:
    job = jobs.get(session, job_id, caller=caller)
    return [AttemptPublic.model_validate(a) for a in jobs.attempts(session, job)]


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointPublic], responses=PAGED)
def job_checkpoints(
    job_id: JobId, response: Response, session: SessionDep, caller: CallerDep, after: RowAfter = 0,
    limit: PageLimit = PAGE_SIZE,
) -> list[CheckpointPublic]:  # fmt: skip
    """The job's checkpoints in the order they were recorded, a page of at most `limit` (a full page names the next
    in `X-Next-After`)."""
    job = jobs.get(session, job_id, caller=caller)
    rows = _paged(response, jobs.checkpoints(session, job, after_id=after, limit=limit), limit)
    return [CheckpointPublic.model_validate(c) for c in rows]


@router.get("/{job_id}/metrics", response_model=list[MetricPoint], responses=PAGED)
def job_metrics(
    job_id: JobId,
    response: Response,
    session: SessionDep,
    caller: CallerDep,
    name: Annotated[str | None, Query(max_length=128)] = None,
    after: RowAfter = 0,
    limit: Annotated[int, Query(ge=1, le=100_000, description="at most this many points (default 10000)")] = 10_000,
) -> list[MetricPoint]:
    """The job's metric points in the order they were reported (only `name`'s, if given), a page of at most `limit`
    (a full page names the next in `X-Next-After`)."""
    job = jobs.get(session, job_id, caller=caller)
    rows = _paged(response, jobs.metric_series(session, job, name=name, after_id=after, limit=limit), limit)
    return [MetricPoint.model_validate(m) for m in rows]
