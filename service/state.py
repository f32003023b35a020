"""The job state machine. `transition` is the only code that changes `Job.state`.

Each change is a guarded `UPDATE … WHERE id = :id AND state = :expected [AND lease_token = :token]` that must touch
exactly one row, plus a `JobEvent` in the same transaction: a racing writer (another dispatcher, a cancel from the
API, a stale lease holder) loses cleanly with `StaleWrite` instead of overwriting what it did not see.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlmodel import Session

from service import dependencies, notify
from service.errors import IllegalTransition, StaleWrite
from service.models import EndReason, EventKind, Job, JobEvent, JobState, utcnow

S = JobState
ALLOWED: dict[JobState, frozenset[JobState]] = {
    S.QUEUED: frozenset({S.STARTING, S.CANCELLED, S.FAILED}),
    S.STARTING: frozenset({S.RUNNING, S.SUCCEEDED, S.FAILED, S.QUEUED, S.CANCELLING}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.QUEUED, S.CANCELLING}),
    # A job may finish on its own before the stop reaches it: its true end wins.
    S.CANCELLING: frozenset({S.CANCELLED, S.SUCCEEDED, S.FAILED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset({S.QUEUED}),  # explicit retry by the user
    S.CANCELLED: frozenset({S.QUEUED}),  # explicit retry by the user
}


def is_allowed(frm: JobState, to: JobState) -> bool:
    return to in ALLOWED[frm]


def transition(
    session: Session,
    job: Job,
    *,
    to: JobState,
    reason: str,
    message: str | None = None,
    lease_token: str | None = None,
    actor: str | None = None,
    values: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> Job:
    """Move `job` from the state it was read in to `to`, with an event; raise if the row moved meanwhile.

    `lease_token` fences the write to the current lease holder; `values` are other columns set in the same UPDATE.
    The caller commits (the event and the change land together or not at all).
    """
    frm = JobState(job.state)
    if not is_allowed(frm, to):
        raise IllegalTransition(f"job {job.id}: {frm.value} -> {to.value} is not allowed")
    now = now or utcnow()
    changes: dict[str, Any] = {"state": to, "updated_at": now, "state_reason": message or reason}
    if to is S.STARTING and job.started_at is None:
        changes["started_at"] = now
    if to.is_terminal:
        changes["finished_at"] = now
        changes.update(lease_owner=None, lease_token=None, lease_expires_at=None)
    elif to is S.QUEUED:
        changes.update(lease_owner=None, lease_token=None, lease_expires_at=None, finished_at=None)
    changes.update(values or {})

    stmt = update(Job).where(Job.id == job.id, Job.state == frm)  # type: ignore[arg-type]
    if lease_token is not None:
        stmt = stmt.where(Job.lease_token == lease_token)  # type: ignore[arg-type]
    result = session.execute(stmt.values(**changes).execution_options(synchronize_session=False))
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise StaleWrite(f"job {job.id} is no longer {frm.value} (or its lease moved on)")
    record_event(
        session, job.id, kind=EventKind.STATE, reason=reason, message=message, actor=actor, at=now,
        attempt=changes.get("attempt", job.attempt), from_state=frm, to_state=to,
    )  # fmt: skip
    for key, value in changes.items():
        setattr(job, key, value)
    notify.enqueue(session, job, from_state=frm, to_state=to, reason=reason, message=message, at=now)  # webhooks
    if to.is_terminal:  # its dependents (depends_on) are met, or end: in this same transaction
        dependencies.settle(session, job, now=now, actor=actor, transition=transition, record_event=record_event)
    return job


def record_event(
    session: Session,
    job_id: str,
    *,
    kind: EventKind,
    reason: str,
    attempt: int | None,
    message: str | None = None,
    actor: str | None = None,
    at: datetime | None = None,
    from_state: JobState | None = None,
    to_state: JobState | None = None,
) -> None:
    """Append one timeline entry; the only code that writes `JobEvent` rows (the caller commits)."""
    session.add(
        JobEvent(
            job_id=job_id, kind=EventKind(kind).value, from_state=from_state, to_state=to_state, reason=reason[:64],
            message=message, attempt=attempt, actor=actor, at=at or utcnow(),
        )
    )  # fmt: skip


def end_reason_state(reason: EndReason) -> JobState:
    if reason is EndReason.SUCCEEDED:
        return S.SUCCEEDED
    if reason is EndReason.CANCELLED:
        return S.CANCELLED
    return S.FAILED
