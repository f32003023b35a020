"""What `max_parallel` keeps out of an admission pass (the decision is `service.sweep_policy.hold`).

Held members are left out of the pass's queue query itself, so however many members a sweep has queued they never
fill the pass's batch (`admit_batch`) and never block the jobs behind them. Runs inside the admission transaction,
under its lock, so two dispatchers never both hand out a sweep's last free place.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, func, or_, update
from sqlmodel import Session, col, select

from service import sweep_policy
from service.models import ACTIVE_STATES, Job, JobState, Sweep


def held_back(session: Session, *, now: datetime) -> ColumnElement[bool] | None:
    """A condition on `jobs` that leaves out the queued members `max_parallel` holds in this pass (None: nothing
    held), after writing each one's `state_reason` (only where it changed: no write on a quiet pass)."""
    ready = or_(col(Job.not_before).is_(None), col(Job.not_before) <= now)
    rows = session.exec(
        select(Job.id, Job.sweep_id, Job.sweep_index, Job.state_reason, Sweep.max_parallel)
        .join(Sweep, col(Sweep.id) == col(Job.sweep_id))
        .where(Job.state == JobState.QUEUED, col(Sweep.max_parallel).is_not(None), ready)
    ).all()
    if not rows:
        return None
    limits = {sweep_id: int(limit) for _, sweep_id, _, _, limit in rows}
    counted = session.exec(
        select(Job.sweep_id, func.count())
        .where(col(Job.sweep_id).in_(list(limits)), col(Job.state).in_(list(ACTIVE_STATES)))
        .group_by(col(Job.sweep_id))
    ).all()
    active = {str(sweep_id): int(n) for sweep_id, n in counted}
    queued = [sweep_policy.Queued(job_id, str(sweep_id), int(index or 0)) for job_id, sweep_id, index, _, _ in rows]
    held = sweep_policy.hold(queued, active, limits)
    if not held:
        return None
    said = {job_id: reason for job_id, _, _, reason, _ in rows}
    changed: dict[str, list[str]] = {}
    for job_id, why in held.items():
        if said[job_id] != why:
            changed.setdefault(why, []).append(job_id)
    for why, ids in changed.items():
        session.execute(
            update(Job).where(col(Job.id).in_(ids), Job.state == JobState.QUEUED).values(state_reason=why),
            execution_options={"synchronize_session": False},
        )
    allowed = [job_id for job_id, *_ in rows if job_id not in held]
    return or_(col(Job.sweep_id).is_(None), col(Job.sweep_id).not_in(list(limits)), col(Job.id).in_(allowed))
