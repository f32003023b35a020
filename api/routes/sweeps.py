"""/v1/sweeps: parse, authorise, call `service.lifecycle.sweeps`. Members are jobs: /v1/jobs/{id} shows each."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Response, status

from api import cursors
from api.deps import CallerDep, SessionDep, SettingsDep
from api.schemas import ERROR_RESPONSES, SPEC_BUDGET_RESPONSES
from api.sweep_schemas import SweepCancelled, SweepList, SweepMember, SweepPublic, SweepSummary
from service.lifecycle import sweeps
from service.spec.sweep import SweepMetric, SweepRequest
from service.store.models import EndReason, JobState, Sweep

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"], responses=ERROR_RESPONSES)
IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=255)]
SweepId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


def _metric(sweep: Sweep) -> SweepMetric | None:
    if sweep.metric_name is None:
        return None
    return SweepMetric(name=sweep.metric_name, mode=sweep.metric_mode or "min")


def _summary(sweep: Sweep, counts: dict[str, int]) -> SweepSummary:
    ended = sum(n for state, n in counts.items() if state in ("SUCCEEDED", "FAILED", "CANCELLED"))
    return SweepSummary(
        id=sweep.id, name=sweep.name, owner=sweep.owner, team=sweep.team, size=len(sweep.values),
        max_parallel=sweep.max_parallel, metric=_metric(sweep), counts=counts, done=ended == len(sweep.values),
        created_at=sweep.created_at, cancelled_at=sweep.cancelled_at,
    )  # fmt: skip


def _member(m: sweeps.Member) -> SweepMember:
    job = m.job
    return SweepMember(
        index=int(job.sweep_index or 0), job_id=job.id, name=job.name, values=m.values, state=JobState(job.state).value,
        state_reason=job.state_reason, end_reason=EndReason(job.end_reason).value if job.end_reason else None,
        step=job.step,
        metric=m.metric.last if m.metric else None, best_metric=m.metric.best if m.metric else None, rank=m.rank,
    )  # fmt: skip


def to_public(st: sweeps.Status) -> SweepPublic:
    sweep, request = st.sweep, st.sweep.request
    summary = _summary(sweep, st.counts)
    return SweepPublic(
        **summary.model_dump(), grid=request.get("grid"), points=request.get("points"), count=request.get("count"),
        members=[_member(m) for m in st.members], best=_member(st.best) if st.best else None,
    )  # fmt: skip


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=SweepPublic,
    responses={
        200: {"model": SweepPublic, "description": "a replay of the same Idempotency-Key and body"},
        **SPEC_BUDGET_RESPONSES,
    },
)
def create_sweep(
    request: SweepRequest,
    session: SessionDep,
    caller: CallerDep,
    settings: SettingsDep,
    response: Response,
    idempotency_key: IdempotencyKey = None,
) -> SweepPublic:
    """Queue every member of a sweep (or array) in one transaction: all of them, or none with a 4xx."""
    sweep, created = sweeps.create(session, request, caller=caller, settings=settings, idempotency_key=idempotency_key)
    session.commit()
    if not created:
        response.status_code = status.HTTP_200_OK
    response.headers["Location"] = f"/v1/sweeps/{sweep.id}"
    return to_public(sweeps.status(session, sweep))


@router.get("", response_model=SweepList)
def list_sweeps(
    session: SessionDep,
    caller: CallerDep,
    owner: Annotated[str | None, Query(max_length=128, description="admins: only this owner's sweeps")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> SweepList:
    """The caller's sweeps (an admin's: everyone's), newest first, with their members' counts by state."""
    before = cursors.decode(cursor) if cursor else None
    rows = sweeps.list_sweeps(session, caller=caller, owner=owner, limit=limit + 1, before=before)
    page = rows[:limit]
    counted = sweeps.counts(session, [s.id for s in page])
    return SweepList(
        items=[_summary(s, counted.get(s.id, {})) for s in page],
        next_cursor=cursors.encode(page[-1]) if len(rows) > limit else None,
    )


@router.get("/{sweep_id}", response_model=SweepPublic)
def get_sweep(sweep_id: SweepId, session: SessionDep, caller: CallerDep) -> SweepPublic:
    """The sweep, its members (values, state, metric, rank) in index order, counts by state, and the best member."""
    return to_public(sweeps.status(session, sweeps.get(session, sweep_id, caller=caller)))


@router.post("/{sweep_id}/cancel", status_code=status.HTTP_202_ACCEPTED, response_model=SweepCancelled)
def cancel_sweep(sweep_id: SweepId, session: SessionDep, caller: CallerDep) -> SweepCancelled:
    """Cancel every member that has not ended (queued ones at once; running ones are stopped by the dispatcher)."""
    sweep, asked = sweeps.cancel(session, sweep_id, caller=caller)
    session.commit()
    return SweepCancelled(id=sweep.id, cancelled=asked, detail=f"cancel requested for {len(asked)} members")
