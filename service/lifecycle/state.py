"""The job state machine. `transition` is the only code that changes `Job.state`.

Each change is a guarded `UPDATE … WHERE id = :id AND state = :expected [AND lease_token = :token]` that must touch
exactly one row, plus a `JobEvent` in the same transaction: a racing writer (another dispatcher, a cancel from the
API, a stale lease holder) loses cleanly with `StaleWrite` instead of overwriting what it did not see.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, insert, select, update
from sqlmodel import Session, col

from service.core.errors import IllegalTransition, StaleWrite
from service.policy import end_reasons
from service.store import signals
from service.store.models import EndReason, EventKind, Job, JobDependency, JobEvent, JobState, utcnow
from service.workflows import dependencies, notifications

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
    now = now or utcnow()
    changes = _changes(job, frm, to, reason=reason, message=message, values=values, now=now)
    stmt = update(Job).where(col(Job.id) == job.id, col(Job.state) == frm)
    if lease_token is not None:
        stmt = stmt.where(col(Job.lease_token) == lease_token)
    result = session.execute(stmt.values(**changes).execution_options(synchronize_session=False))
    if result.rowcount != 1:  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult; Session.execute says Result
        raise StaleWrite(f"job {job.id} is no longer {frm.value} (or its lease moved on)")
    record_event(
        session, job.id, kind=EventKind.STATE, reason=reason, message=message, actor=actor, at=now,
        attempt=changes.get("attempt", job.attempt), from_state=frm, to_state=to,
    )  # fmt: skip
    for key, value in changes.items():
        setattr(job, key, value)
    notifications.enqueue(session, job, from_state=frm, to_state=to, reason=reason, message=message, at=now)  # webhooks
    if to.is_terminal:  # its dependents (depends_on) are met, or end: in this same transaction
        dependencies.settle(session, job, now=now, actor=actor, transition=transition, record_event=record_event)
    return job


def _changes(
    job: Job, frm: JobState, to: JobState, *, reason: str, message: str | None, values: dict[str, Any] | None,
    now: datetime,
) -> dict[str, Any]:  # fmt: skip
    """The columns a transition sets (raises IllegalTransition for a move the state machine does not allow)."""
    if not is_allowed(frm, to):
        raise IllegalTransition(f"job {job.id}: {frm.value} -> {to.value} is not allowed")
    changes: dict[str, Any] = {"state": to, "updated_at": now, "state_reason": message or reason}
    if to is S.STARTING and job.started_at is None:
        changes["started_at"] = now
    if to.is_terminal:
        changes["finished_at"] = now
        changes.update(lease_owner=None, lease_token=None, lease_expires_at=None)
    elif to is S.QUEUED:
        changes.update(lease_owner=None, lease_token=None, lease_expires_at=None, finished_at=None)
    changes.update(values or {})
    return changes


@dataclass
class Move:
    """One job's transition in a `transition_many` batch (the arguments of `transition`)."""

    job: Job
    to: JobState
    reason: str
    message: str | None = None
    lease_token: str | None = None
    values: dict[str, Any] | None = field(default=None)


def transition_many(
    session: Session, moves: list[Move], *, actor: str | None, now: datetime | None = None, locked: bool = False
) -> list[Move]:
    """`transition` for many jobs in a few statements: the guarded UPDATEs as one executemany per shape of change,
    the state events as one batched INSERT. Returns the moves that lost (the row was no longer in the state it was
    read in, or its lease moved on): nothing is written for those, the others go ahead.

    Which rows still match is read first with their rows locked (`FOR UPDATE`; SQLite's write transaction is the
    lock), unless the caller holds them locked already (`locked`: admission's `FOR UPDATE SKIP LOCKED` read), so the
    UPDATEs then cannot miss: if one does anyway, StaleWrite is raised for the whole batch. Each job's event, its
    webhook outbox rows and the settling of its dependents land in this same transaction, as with `transition`."""
    if not moves:
        return []
    now = now or utcnow()
    lost: list[Move] = []
    if not locked:
        ids = sorted({m.job.id for m in moves})
        rows = session.execute(
            select(col(Job.id), col(Job.state), col(Job.lease_token)).where(col(Job.id).in_(ids)).order_by(col(Job.id))
            .with_for_update()
        ).all()  # fmt: skip
        current = {r[0]: (JobState(r[1]), r[2]) for r in rows}
        kept: list[Move] = []
        for m in moves:
            state, token = current.get(m.job.id, (None, None))
            fenced = m.lease_token is not None and token != m.lease_token
            (lost if state is not JobState(m.job.state) or fenced else kept).append(m)
        moves = kept
    planned = [(m, JobState(m.job.state)) for m in moves]
    changes = [_changes(m.job, frm, m.to, reason=m.reason, message=m.message, values=m.values, now=now)
               for m, frm in planned]  # fmt: skip
    groups: dict[tuple[tuple[str, ...], bool], list[dict[str, Any]]] = {}
    for (m, frm), change in zip(planned, changes, strict=True):
        one = {"p_id": m.job.id, "p_frm": frm, "p_token": m.lease_token, **{f"v_{k}": v for k, v in change.items()}}
        groups.setdefault((tuple(sorted(change)), m.lease_token is not None), []).append(one)
    session.flush()  # rows added before (a job's other events) go in first: each timeline stays in call order
    table = Job.__table__  # type: ignore[attr-defined]  # SQLModel sets __table__ when it makes the class
    for (keys, fenced), params in groups.items():
        stmt = update(table).where(table.c.id == bindparam("p_id"), table.c.state == bindparam("p_frm"))
        if fenced:
            stmt = stmt.where(table.c.lease_token == bindparam("p_token"))
        result = session.execute(stmt.values({k: bindparam(f"v_{k}") for k in keys}), params)
        if result.rowcount != len(params):  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult; Session.execute says Result
            raise StaleWrite(f"{len(params) - result.rowcount} of {len(params)} jobs moved on under a locked batch")  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult; Session.execute says Result
    record_events(session, [
        {"job_id": m.job.id, "kind": EventKind.STATE, "from_state": frm, "to_state": m.to, "reason": m.reason,
         "message": m.message, "actor": actor, "at": now, "attempt": change.get("attempt", m.job.attempt)}
        for (m, frm), change in zip(planned, changes, strict=True)
    ])  # fmt: skip
    for (m, frm), change in zip(planned, changes, strict=True):
        for key, value in change.items():
            setattr(m.job, key, value)
        notifications.enqueue(session, m.job, from_state=frm, to_state=m.to, reason=m.reason, message=m.message, at=now)
    ended = [m.job for m, _ in planned if m.to.is_terminal]
    if ended:  # one read for the whole batch: only jobs something still waits on have dependents to settle
        # Ids: SQLAlchemy's select through `Session.exec` reads rows, which no id is ever `in`.
        waited_on = set(
            session.execute(
                select(col(JobDependency.depends_on)).where(
                    col(JobDependency.depends_on).in_([j.id for j in ended]), col(JobDependency.outcome).is_(None)
                )
            )
            .scalars()
            .all()
        )
        for job in ended:
            if job.id in waited_on:
                dependencies.settle(session, job, now=now, actor=actor, transition=transition,
                                    record_event=record_event)  # fmt: skip
    return lost


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
    """Append one timeline entry; with `record_events`, the only code that writes `JobEvent` rows (the caller commits;
    the job's event streams hear of it once that commit is done: `service.store.signals`)."""
    signals.publish(session, signals.EVENTS, job_id)
    session.add(
        JobEvent(
            job_id=job_id, kind=EventKind(kind).value, from_state=from_state, to_state=to_state, reason=reason[:64],
            message=message, attempt=attempt, actor=actor, at=at or utcnow(),
        )
    )  # fmt: skip


def record_events(session: Session, events: list[dict[str, Any]]) -> None:
    """Append many timeline entries (`record_event`'s arguments, with `job_id`, as dicts) in one batched INSERT, now
    (rows `record_event` added before are flushed first, so each job's timeline keeps the order of the calls)."""
    if not events:
        return
    session.flush()
    rows = [{"from_state": None, "to_state": None, "message": None, "actor": None, "attempt": None, **e,
             "kind": EventKind(e["kind"]).value, "reason": e["reason"][:64], "at": e.get("at") or utcnow()}
            for e in events]  # fmt: skip
    session.execute(insert(JobEvent.__table__), rows)  # type: ignore[attr-defined]  # SQLModel sets __table__ when it makes the class
    for job_id in {e["job_id"] for e in events}:
        signals.publish(session, signals.EVENTS, job_id)


def end_reason_state(reason: EndReason) -> JobState:
    """The job's state when an attempt that ended so is not retried (its row of `service.policy.end_reasons`)."""
    return end_reasons.of(reason).state
