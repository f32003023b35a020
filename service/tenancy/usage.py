"""Usage accounting (issue 15): who held how many CPU- and GPU-hours, how jobs ended, how long they waited to start.

An attempt uses what its worker group held (`Attempt.cpus`, `Attempt.gpus`) from its start to its end, or to `now`
while it runs, clipped to the window `[since, until)`. Clipping is what makes windows add up: usage over [a, b) plus
usage over [b, c) is usage over [a, c), so a week is the sum of its days. Only attempts that overlap the window are
read (`started_at < until`, and `ended_at` unset or after `since`, which `ix_attempts_ended` serves): a report costs
what its window holds, not the whole history.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import ColumnElement, extract, func, or_, select
from sqlmodel import Session, col

from service.core.errors import Forbidden, InvalidSpec
from service.store.models import Attempt, Job, JobState

if TYPE_CHECKING:
    from service.tenancy.auth import Caller

END_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
PERCENTILES = (50, 90, 99)


@dataclass
class Usage:
    """Resource-seconds held and the attempts that held them."""

    cpu_seconds: float = 0.0
    gpu_seconds: float = 0.0
    attempts: int = 0
    gpu_seconds_by_type: dict[str, float] = field(default_factory=dict)  # of jobs that ask for an accelerator type

    @property
    def cpu_hours(self) -> float:
        return self.cpu_seconds / 3600

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600

    @property
    def gpu_hours_by_type(self) -> dict[str, float]:
        return {kind: seconds / 3600 for kind, seconds in sorted(self.gpu_seconds_by_type.items())}

    def add(self, other: Usage) -> None:
        self.cpu_seconds += other.cpu_seconds
        self.gpu_seconds += other.gpu_seconds
        self.attempts += other.attempts
        for kind, seconds in other.gpu_seconds_by_type.items():
            self.gpu_seconds_by_type[kind] = self.gpu_seconds_by_type.get(kind, 0.0) + seconds


@dataclass(kw_only=True)
class UsageRow(Usage):
    owner: str
    team: str | None
    queue: str


@dataclass(frozen=True)
class QueueWait:
    """Seconds from submission to the first attempt's start, for jobs whose first attempt started in the window."""

    jobs: int
    p50: float | None
    p90: float | None
    p99: float | None


@dataclass(frozen=True)
class UsageReport:
    since: datetime | None
    until: datetime
    rows: list[UsageRow]  # by owner, team, queue
    totals: Usage
    jobs_ended: dict[str, int]  # jobs that finished in the window, by end state (every end state, zeros too)
    end_reasons: dict[str, int]  # the same jobs by end reason
    queue_wait: QueueWait


def visible_owner(caller: Caller, owner: str | None) -> str | None:
    """Whose usage the caller's report covers: any owner's (or everyone's) for an admin, else only their own (403)."""
    if caller.admin:
        return owner
    if owner is not None and owner != caller.owner:
        raise Forbidden(f"owner: {caller.owner!r} may see only their own usage, not {owner!r}'s", field="owner")
    return caller.owner


def report(
    session: Session,
    *,
    owner: str | None = None,
    team: str | None = None,
    queue: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    now: datetime,
) -> UsageReport:
    """Usage over `[since, until)` (no `since`: from the start; no `until`: to `now`); the filters combine with AND."""
    until = now if until is None else until
    if since is not None and since >= until:
        raise InvalidSpec(f"since: {since.isoformat()} is not before until ({until.isoformat()})", field="since")
    scope = _scope(owner=owner, team=team, queue=queue)
    rows = _rows(_overlapping(session, scope, since, until), since=since, until=until, now=now)
    totals = Usage()
    for row in rows:
        totals.add(row)
    jobs_ended, end_reasons = _ended(session, scope, since, until)
    waits = _waits(session, scope, since, until)
    return UsageReport(since=since, until=until, rows=rows, totals=totals, jobs_ended=jobs_ended,
                       end_reasons=end_reasons, queue_wait=queue_wait(waits))  # fmt: skip


def clipped_seconds(
    start: datetime, end: datetime | None, *, since: datetime | None, until: datetime, now: datetime
) -> float:
    """Seconds of `[start, end or now)` inside `[since, until)`; 0 when they do not meet."""
    stop = min(now if end is None else end, until)
    begin = start if since is None else max(start, since)
    return max(0.0, (stop - begin).total_seconds())


def nearest_rank(values: Sequence[float], percent: int) -> float | None:
    """The smallest value with at least `percent`% of the values at or below it (nearest rank); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = -(-percent * len(ordered) // 100)  # ceil in integers: in floats p/100*n can land a hair above a whole rank
    return ordered[max(rank, 1) - 1]


def queue_wait(waits: Sequence[float]) -> QueueWait:
    p50, p90, p99 = (nearest_rank(waits, p) for p in PERCENTILES)
    return QueueWait(jobs=len(waits), p50=p50, p90=p90, p99=p99)


def resource_seconds(session: Session, *, now: datetime) -> dict[tuple[str, str], tuple[float, float]]:
    """All-time (CPU, GPU) seconds by (owner, queue): ended attempts in full, summed in SQL; running ones to `now`."""
    held = _held_seconds(session)
    ended = session.execute(
        select(col(Job.owner), col(Job.queue), func.sum(col(Attempt.cpus) * held), func.sum(col(Attempt.gpus) * held))
        .join(Job, col(Job.id) == col(Attempt.job_id))
        .where(col(Attempt.ended_at).is_not(None))
        .group_by(Job.owner, Job.queue)
    ).all()
    totals = {(owner, queue): (float(cpu or 0.0), float(gpu or 0.0)) for owner, queue, cpu, gpu in ended}
    running = session.execute(
        select(col(Job.owner), col(Job.queue), col(Attempt.cpus), col(Attempt.gpus), col(Attempt.started_at))
        .join(Job, col(Job.id) == col(Attempt.job_id))
        .where(col(Attempt.ended_at).is_(None))
    ).all()
    for owner, queue, cpus, gpus, started in running:
        seconds = max(0.0, (now - started).total_seconds())
        cpu, gpu = totals.get((owner, queue), (0.0, 0.0))
        totals[(owner, queue)] = (cpu + cpus * seconds, gpu + gpus * seconds)
    return totals


def _held_seconds(session: Session) -> ColumnElement[Any]:
    """`ended_at - started_at` in seconds, in each database's own date arithmetic (SQLite's keeps milliseconds)."""
    if session.get_bind().dialect.name == "postgresql":
        return extract("epoch", col(Attempt.ended_at) - col(Attempt.started_at))
    return (func.julianday(col(Attempt.ended_at)) - func.julianday(col(Attempt.started_at))) * 86400.0


def _scope(*, owner: str | None, team: str | None, queue: str | None) -> list[ColumnElement[bool]]:
    wanted = ((Job.owner, owner), (Job.team, team), (Job.queue, queue))
    return [col(column) == value for column, value in wanted if value is not None]


def _overlapping(
    session: Session, scope: list[ColumnElement[bool]], since: datetime | None, until: datetime
) -> Iterable[Any]:
    query = (
        select(
            col(Job.owner),
            col(Job.team),
            col(Job.queue),
            col(Attempt.cpus),
            col(Attempt.gpus),
            col(Attempt.started_at),
            col(Attempt.ended_at),
            col(Job.accelerator_type),
        )  # fmt: skip
        .join(Job, col(Job.id) == col(Attempt.job_id))
        .where(col(Attempt.started_at) < until, *scope)
    )
    if since is not None:
        query = query.where(or_(col(Attempt.ended_at).is_(None), col(Attempt.ended_at) > since))
    return session.execute(query).all()


def _rows(attempts: Iterable[Any], *, since: datetime | None, until: datetime, now: datetime) -> list[UsageRow]:
    rows: dict[tuple[str, str | None, str], UsageRow] = {}
    for owner, team, queue, cpus, gpus, started, ended, kind in attempts:
        row = rows.setdefault((owner, team, queue), UsageRow(owner=owner, team=team, queue=queue))
        seconds = clipped_seconds(started, ended, since=since, until=until, now=now)
        by_type = {kind: gpus * seconds} if kind and gpus else {}
        row.add(Usage(cpu_seconds=cpus * seconds, gpu_seconds=gpus * seconds, attempts=1, gpu_seconds_by_type=by_type))
    return [rows[key] for key in sorted(rows, key=lambda k: (k[0], k[1] or "", k[2]))]


def _ended(
    session: Session, scope: list[ColumnElement[bool]], since: datetime | None, until: datetime
) -> tuple[dict[str, int], dict[str, int]]:
    """Jobs that finished in the window, by end state and by end reason."""
    query = select(col(Job.state), col(Job.end_reason), func.count()).where(
        col(Job.state).in_(END_STATES), col(Job.finished_at) < until, *scope
    )
    if since is not None:
        query = query.where(col(Job.finished_at) >= since)
    by_state = {state.value: 0 for state in END_STATES}
    by_reason: dict[str, int] = {}
    for state, reason, n in session.execute(query.group_by(col(Job.state), col(Job.end_reason))).all():
        by_state[JobState(state).value] += n
        key = getattr(reason, "value", reason) or "unknown"
        by_reason[key] = by_reason.get(key, 0) + n
    return by_state, dict(sorted(by_reason.items()))


def _waits(session: Session, scope: list[ColumnElement[bool]], since: datetime | None, until: datetime) -> list[float]:
    """Each job's wait for its first attempt (number 1), when that attempt started in the window."""
    query = (
        select(col(Job.created_at), col(Attempt.started_at))
        .join(Job, col(Job.id) == col(Attempt.job_id))
        .where(col(Attempt.number) == 1, col(Attempt.started_at) < until, *scope)
    )
    if since is not None:
        # An attempt that started after `since` ended after it too; saying so lets `ix_attempts_ended` bound the scan.
        ended_after = or_(col(Attempt.ended_at).is_(None), col(Attempt.ended_at) >= since)
        query = query.where(col(Attempt.started_at) >= since, ended_after)
    return [max(0.0, (started - created).total_seconds()) for created, started in session.execute(query).all()]
