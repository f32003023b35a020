"""What `max_parallel` keeps out of an admission pass (the decision is `service.policy.sweep_rules.hold`).

Held members are left out of the pass's queue query itself, so however many members a sweep has queued they never
fill the pass's batch (`admit_batch`) and never block the jobs behind them. Runs inside the admission transaction,
under its lock, so two dispatchers never both hand out a sweep's last free place.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import ColumnElement, func, or_, update
from sqlmodel import Session, col, select

from service.policy import sweep_rules
from service.store.models import ACTIVE_STATES, Job, JobState, Sweep


def held_back(session: Session, *, now: datetime) -> ColumnElement[bool] | None:
    """A condition on `jobs` that leaves out the queued members `max_parallel` holds in this pass (None: nothing
    held), after writing each one's `state_reason` (only where it changed: no write on a quiet pass)."""
    ready = or_(col(Job.not_before).is_(None), col(Job.not_before) <= now)
    # By ix_jobs_sweep_state, a probe per capped sweep: joined, the planner read every queued job for it.
    capped = select(Sweep.id).where(col(Sweep.max_parallel).is_not(None))
    rows = session.exec(
        select(Job.id, Job.sweep_id, Job.sweep_index, Job.state_reason).where(
            col(Job.sweep_id).in_(capped), Job.state == JobState.QUEUED, ready
        )
    ).all()
    if not rows:
        return None
    sweep_ids = sorted({str(sweep_id) for _, sweep_id, _, _ in rows})
    limits = {str(sweep_id): int(limit) for sweep_id, limit in session.exec(
        select(Sweep.id, Sweep.max_parallel).where(col(Sweep.id).in_(sweep_ids))).all()
        if limit is not None}  # fmt: skip
    counted = session.exec(
        select(Job.sweep_id, func.count())
        .where(col(Job.sweep_id).in_(list(limits)), col(Job.state).in_(list(ACTIVE_STATES)))
        .group_by(col(Job.sweep_id))
    ).all()
    active = {str(sweep_id): int(n) for sweep_id, n in counted}
    queued = [sweep_rules.Queued(job_id, str(sweep_id), int(index or 0)) for job_id, sweep_id, index, _ in rows]
    held = sweep_rules.hold(queued, active, limits)
    if not held:
        return None
    said = {job_id: reason for job_id, _, _, reason in rows}
    changed: dict[str, list[str]] = {}
    for job_id, why in held.items():
        if said[job_id] != why:
            changed.setdefault(why, []).append(job_id)
    for why, ids in changed.items():
        session.execute(
            update(Job).where(col(Job.id).in_(ids), col(Job.state) == JobState.QUEUED).values(state_reason=why),
            execution_options={"synchronize_session": False},
        )
    allowed = [job_id for job_id, *_ in rows if job_id not in held]
    return or_(col(Job.sweep_id).is_(None), col(Job.sweep_id).not_in(list(limits)), col(Job.id).in_(allowed))
