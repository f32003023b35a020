"""Sweep use cases the API calls: create (the sweep and all its members in one transaction), read, list, cancel.

Members are ordinary jobs made by `service.lifecycle.jobs.submit` (the same validation, tenancy, queue and quota rules
as `POST /v1/jobs`), with `sweep_id` and `sweep_index` set. The metric a member is ranked by is the last value it
reported of the sweep's metric (`service.policy.sweep_rules.rank`); the best value it ever reported is shown beside it.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from service.config.settings import Settings
from service.core.errors import Conflict, InvalidSpec, NotFound
from service.lifecycle import jobs
from service.policy import sweep_rules
from service.spec.sweep import SweepRequest, member_specs
from service.store import spec_budget
from service.store.models import Job, JobState, Metric, Sweep, utcnow
from service.store.spec_cache import stored_size
from service.tenancy.auth import Caller


def request_hash(request: SweepRequest) -> str:
    return hashlib.sha256(json.dumps(request.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def create(
    session: Session,
    request: SweepRequest,
    *,
    caller: Caller,
    settings: Settings,
    idempotency_key: str | None = None,
) -> tuple[Sweep, bool]:
    """Queue a sweep's members; returns (sweep, created). The caller commits: every member or none. A replay of the
    same Idempotency-Key and body returns the first sweep; another body under that key is a 409."""
    digest = request_hash(request)
    if idempotency_key:
        existing = _by_key(session, caller.owner, idempotency_key)
        if existing is not None:
            return _replay(existing, digest, idempotency_key), False
    size, cap = request.size, settings.max_sweep_members
    if size > cap:
        field = "grid" if request.grid else ("points" if request.points else "count")
        raise InvalidSpec(f"{field}: makes {size} members, more than this service's max_sweep_members ({cap})",
                          field=field)  # fmt: skip
    per_member = stored_size(request.base.model_dump(mode="json", exclude_unset=True))
    budget = settings.max_sweep_bytes
    if size * per_member > budget:  # checked before any member is made: the base is each member's least
        raise InvalidSpec(f"base: {size} members of a {per_member:,}-byte spec are {size * per_member:,} bytes, more "
                          f"than this service's max_sweep_bytes ({budget:,})", field="base")  # fmt: skip
    # The owner's specs not yet ended, with the members': read once, then counted member by member (field `base`).
    tally = spec_budget.Tally.read(session, settings, owner=caller.owner, field="base")
    tally.check(size * per_member, what=f"{size} members of a {per_member:,}-byte spec")
    members = member_specs(request)
    sweep = Sweep(
        name=request.name,
        owner=caller.owner,
        team=caller.team,
        request=request.model_dump(mode="json", exclude_unset=True),
        values=[values for values, _ in members],
        max_parallel=request.max_parallel,
        metric_name=request.metric.name if request.metric else None,
        metric_mode=request.metric.mode if request.metric else None,
        idempotency_key=idempotency_key,
        request_hash=digest,
    )
    session.add(sweep)
    try:
        session.flush()
    except IntegrityError:
        session.rollback()  # two replays of one key raced: the loser returns the winner's sweep
        existing = _by_key(session, caller.owner, idempotency_key) if idempotency_key else None
        if existing is None:
            raise
        return _replay(existing, digest, idempotency_key or ""), False
    for index, (_, spec) in enumerate(members):
        try:
            job, _ = jobs.submit(session, spec, caller=caller, settings=settings, spec_tally=tally)
        except InvalidSpec as exc:
            raise InvalidSpec(f"member {index}: {exc.detail}", field=exc.field, extra=exc.extra) from None
        job.sweep_id, job.sweep_index = sweep.id, index
        session.add(job)
    session.flush()
    return sweep, True


def _by_key(session: Session, owner: str, key: str) -> Sweep | None:
    return session.exec(select(Sweep).where(Sweep.owner == owner, Sweep.idempotency_key == key)).first()


def _replay(existing: Sweep, digest: str, key: str) -> Sweep:
    if existing.request_hash != digest:
        raise Conflict(f"Idempotency-Key {key!r} was used for a different sweep (sweep {existing.id})")
    return existing


def get(session: Session, sweep_id: str, *, caller: Caller) -> Sweep:
    sweep = session.get(Sweep, sweep_id)
    if sweep is None or not (caller.admin or sweep.owner == caller.owner):
        raise NotFound(f"no sweep {sweep_id!r}")
    return sweep


def list_sweeps(
    session: Session,
    *,
    caller: Caller,
    owner: str | None = None,
    limit: int = 50,
    before: tuple[datetime, str] | None = None,
) -> list[Sweep]:
    """Newest first; the caller's own (an admin's: everyone's, or `owner`'s); `before`: a (created_at, id) cursor."""
    query = select(Sweep)
    if not caller.admin:
        query = query.where(Sweep.owner == caller.owner)
    if owner is not None:
        query = query.where(Sweep.owner == owner)
    if before is not None:
        created, sweep_id = before
        query = query.where(
            (col(Sweep.created_at) < created) | ((col(Sweep.created_at) == created) & (col(Sweep.id) < sweep_id))
        )
    query = query.order_by(col(Sweep.created_at).desc(), col(Sweep.id).desc()).limit(limit)
    return list(session.exec(query).all())


def members(session: Session, sweep: Sweep) -> list[Job]:
    query = select(Job).where(Job.sweep_id == sweep.id).order_by(col(Job.sweep_index))
    return list(session.exec(query).all())


def counts(session: Session, sweep_ids: list[str]) -> dict[str, dict[str, int]]:
    """sweep id -> {state: members in it}, for a listing (one grouped query)."""
    if not sweep_ids:
        return {}
    rows = session.exec(
        select(Job.sweep_id, Job.state, func.count()).where(col(Job.sweep_id).in_(sweep_ids))
        .group_by(col(Job.sweep_id), col(Job.state))
    ).all()  # fmt: skip
    out: dict[str, dict[str, int]] = {}
    for sweep_id, state, n in rows:
        out.setdefault(str(sweep_id), {})[JobState(state).value] = int(n)
    return out


@dataclass(frozen=True)
class MetricValues:
    last: float
    best: float  # the lowest (mode min) or highest (mode max) value ever reported


def metric_values(session: Session, job_ids: list[str], name: str, mode: str) -> dict[str, MetricValues]:
    """Each member's last reported value of `name` (the latest row, whatever the attempt) and its best-ever one."""
    if not job_ids:
        return {}
    where = (col(Metric.job_id).in_(job_ids), Metric.name == name)
    latest = select(func.max(Metric.id)).where(*where).group_by(col(Metric.job_id))
    last = dict(session.exec(select(Metric.job_id, Metric.value).where(col(Metric.id).in_(latest))).all())
    pick = func.min if mode == "min" else func.max
    extreme = select(Metric.job_id, pick(Metric.value)).where(*where).group_by(col(Metric.job_id))
    best = dict(session.exec(extreme).all())
    return {job_id: MetricValues(float(value), float(best[job_id])) for job_id, value in last.items()}


@dataclass(frozen=True)
class Member:
    job: Job
    values: dict[str, Any]
    metric: MetricValues | None
    rank: int | None  # 1 = best; None: has not reported the metric


@dataclass(frozen=True)
class Status:
    sweep: Sweep
    members: list[Member]
    counts: dict[str, int]
    best: Member | None

    @property
    def done(self) -> bool:
        return all(JobState(m.job.state).is_terminal for m in self.members)


def status(session: Session, sweep: Sweep) -> Status:
    """The sweep with its members, their metric and rank, counts by state and the best member (see sweep_policy)."""
    jobs_ = members(session, sweep)
    mode = sweep.metric_mode or "min"
    values = metric_values(session, [j.id for j in jobs_], sweep.metric_name, mode) if sweep.metric_name else {}
    scored = [
        sweep_rules.Scored(
            int(j.sweep_index or 0), JobState(j.state).value, values[j.id].last if j.id in values else None
        )
        for j in jobs_
    ]
    ranks = {index: place for place, index in enumerate(sweep_rules.rank(scored, mode), start=1)}
    out = []
    for job in jobs_:
        index = int(job.sweep_index or 0)
        filled = sweep.values[index] if index < len(sweep.values) else {}
        out.append(Member(job=job, values=filled, metric=values.get(job.id), rank=ranks.get(index)))
    winner = sweep_rules.best(scored, mode)
    by_index = {int(m.job.sweep_index or 0): m for m in out}
    tally = Counter(JobState(j.state).value for j in jobs_)
    return Status(
        sweep=sweep, members=out, counts=dict(tally), best=by_index.get(winner) if winner is not None else None
    )


def cancel(session: Session, sweep_id: str, *, caller: Caller) -> tuple[Sweep, list[str]]:
    """Ask every member that has not ended to cancel (as `POST /v1/jobs/{id}/cancel` does); returns (sweep, the ids
    asked). Members that end meanwhile are skipped; the caller commits."""
    sweep = get(session, sweep_id, caller=caller)
    asked = []
    for job in members(session, sweep):
        if JobState(job.state).is_terminal:
            continue
        try:
            jobs.cancel(session, job.id, caller=caller)
        except Conflict:
            session.refresh(job)
            if not JobState(job.state).is_terminal:
                raise
            continue  # it ended between our read and the cancel
        asked.append(job.id)
    if sweep.cancelled_at is None:
        sweep.cancelled_at = utcnow()
        session.add(sweep)
    session.flush()
    return sweep, asked
