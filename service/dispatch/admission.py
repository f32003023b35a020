"""One admission pass: which queued jobs start now, and which running ones are asked to yield for them.

The policy is `service.policy.scheduler` (pure); this module reads what it needs and writes what it decided, all in one
write transaction under the admission lock, so several dispatchers never hand out the same free room twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.config import policies
from service.config.settings import Settings
from service.core import resources
from service.core.backend import ClusterView, submission_id
from service.dispatch.scaling import Scaling
from service.lifecycle import leases, node_faults, queues
from service.lifecycle.state import Move, record_event, transition, transition_many
from service.policy import admission_pass, demand, fairshare, growth, scheduler
from service.spec.job import JobSpec
from service.store import standing
from service.store.db import session_scope
from service.store.models import ACTIVE_STATES, Attempt, EndReason, EventKind, Job, JobState, utcnow
from service.workflows import dependencies
from service.workflows.sweep_admission import held_back

SpecOf = Callable[[Job], "tuple[JobSpec | None, str | None]"]


def admit(
    engine: Engine,
    settings: Settings,
    cluster: ClusterView,
    *,
    owner: str,
    spec_of: SpecOf,
    resources_of: Callable[[Job], dict[str, float]],
    now: datetime | None = None,
    attempts: dict[str, Attempt] | None = None,
    scaling: Scaling | None = None,
) -> tuple[list[Job], list[Job]]:
    """Start every queued job whose whole worker group fits, in priority/FIFO order, within queue limits; returns
    (the jobs admitted, the running jobs now asked to yield). A queued job whose stored spec does not validate ends
    FAILED (user error) here instead of holding up the queue. `now`: the pass's time (default: the clock's).
    `attempts`, when given, receives each admitted job's new attempt row (job id -> Attempt, detached): what the
    dispatcher submits without reading it back. `scaling`, when given, is told what the jobs waiting for room need
    (`service.dispatch.scaling`: sent to the autoscaler after the pass), and their reasons say when it was asked."""
    now = now or utcnow()
    if scaling is not None:
        scaling.clear()
    started: list[Job] = []
    victims: list[Job] = []
    with session_scope(engine, write=False) as session:  # the common idle pass: a read, no write lock, no pass
        if not leases.any_ready(session, now=now) and not _may_grow(session, settings, spec_of):
            return started, victims
    # Under the admission lock every round trip is paid by every dispatcher: without autoflush the loop's event and
    # attempt rows go in as batched INSERTs at commit (measured with bench/claims.py).
    with session_scope(engine) as session, session.no_autoflush:
        leases.lock_admission(session)
        waiting: list[tuple[Job, JobSpec]] = []
        fair = policies.fair_share(settings)
        heads = leases.queued_heads if fair.enabled else leases.queued
        # Sweep members over their sweep's max_parallel are left out of the read (they hold up nobody behind them).
        for job in heads(session, now=now, limit=settings.admit_batch, where=held_back(session, now=now)):
            spec, error = spec_of(job)
            if spec is None:
                values = {"end_reason": EndReason.USER_ERROR, "last_error": error}
                transition(session, job, to=JobState.FAILED, reason=EndReason.USER_ERROR.value, message=error,
                           actor=owner, values=values, now=now)  # fmt: skip
            else:
                waiting.append((job, spec))
        if not waiting and not _may_grow(session, settings, spec_of):
            return [], []
        everyone, per_job = node_faults.excluded(
            session, [j.id for j, _ in waiting], policies.exclusion_rules(settings), now=now
        )
        nodes = [scheduler.NodeFree(n.node_id, dict(n.available)) for n in cluster.nodes
                 if n.alive and n.node_id not in everyone]  # fmt: skip
        # Every admitted job counts against its queue's limits; the placed and unplaced ones may also be preempted.
        admitted = session.exec(select(Job).where(col(Job.state).in_(ACTIVE_STATES))).all()
        active = [j for j in admitted if j.state in (JobState.STARTING, JobState.RUNNING)]
        # Jobs admitted but not yet placed by Ray still count against the free room Ray reports.
        for job in active:
            if job.state == JobState.STARTING:
                resources.take_spread([n.free for n in nodes], resources_of(job))
        ready = dependencies.ready_since(session, [j.id for j, _ in waiting])
        candidates = [kept_off(replace(candidate(job, spec), ready_since=ready.get(job.id)), per_job.get(job.id),
                               cluster) for job, spec in waiting]  # fmt: skip
        kept = {c.job_id: sorted(c.excluded | set(everyone)) for c in candidates}
        kept_why = {c.job_id: {n: per_job[c.job_id][n] for n in c.excluded} for c in candidates if c.excluded}
        limits, rules = queues.limits(session, settings), policies.quota_rules(settings)
        held = standing.held(admitted, resources_of)
        running = [
            scheduler.Running(j.id, j.priority, j.created_at.timestamp(), resources_of(j),
                              yielding=j.preempt_requested_at is not None, queue=j.queue)
            for j in active
        ]  # fmt: skip
        pass_ = admission_pass.run(
            candidates, nodes,
            rules=admission_pass.Rules(fair=fair, limits=limits, quotas=rules, held=held,
                                       gpu_hours=standing.gpu_hours(session, rules, limits, now),
                                       reserve_after_seconds=settings.reserve_after_seconds),
            usage=standing.fair_usage(session, fair, now),
            holding=[fairshare.Holding(j.owner, j.team, resources_of(j), _timeout(spec_of, j)) for j in admitted],
            running=running, room=dict(cluster.available), now=now.timestamp(),
            planned=(lambda ordered, plan: scaling.plan(ordered, plan.waiting, _running(active, spec_of)))
            if scaling is not None and scaling.enabled else None,
            # the autoscaler may bring the room within the grace: no one is stopped for it yet
            may_preempt=(lambda job_id: scaling.may_preempt(job_id, now)) if scaling is not None else None,
            grow=_growth(session, active, specs_of=spec_of, settings=settings, now=now),
        )  # fmt: skip
        decision = pass_.plan
        by_id = {job.id: job for job, _ in waiting}
        specs = {job.id: spec for job, spec in waiting}
        starts = []
        for job_id in decision.admit:
            job, res = by_id[job_id], specs[job_id].resources
            size = decision.sizes.get(job_id, res.max_workers)
            said = f"at {size} workers of {res.min_workers} to {res.max_workers}" if res.elastic else None
            starts.append(_start_attempt(session, job, owner=owner, now=now, settings=settings,
                                         held=res.total(size), world_size=size, message=said,
                                         excluded=kept[job_id], why=kept_why.get(job_id)))  # fmt: skip
        started = _write_starts(session, starts, owner=owner, now=now, attempts=attempts)
        for job_id, why in decision.waiting.items():
            why = scaling.reason(job_id, why) if scaling is not None else why
            if by_id[job_id].state_reason != why:
                leases.set_reason(session, job_id, why)
        by_active = {j.id: j for j in active}
        served, why = pass_.served, pass_.why
        victims += _grow(session, pass_.grown, by_active, owner=owner, now=now)
        for blocked, victim_ids in served:
            for victim_id in victim_ids:
                victim = by_active[victim_id]
                session.execute(update(Job).where(col(Job.id) == victim_id).values(preempt_requested_at=now))
                # The job it yields to is named only to its own owner: another owner's job id is not the victim's
                # to know (issue 35).
                blocker = by_id.get(blocked.job_id)
                mine = blocker is not None and blocker.owner == victim.owner
                whom = blocked.job_id if mine else "another owner's job"
                record_event(session, victim_id, kind=EventKind.PREEMPTION, reason="preemption_requested",
                             attempt=victim.attempt, actor=owner,
                             message=f"making room for {whom} ({why or f'priority {blocked.priority}'})")  # fmt: skip
                victims.append(victim)
    return started, victims


def _running(active: list[Job], spec_of: SpecOf) -> list[demand.Running]:
    """The admitted jobs' worker groups, as the autoscaler must count them (it ignores what is in use)."""
    out = []
    for job in active:
        spec, _ = spec_of(job)
        if spec is not None:
            res = spec.resources
            out.append(demand.Running(job.id, res.per_worker(), res.workers(job.world_size), res.placement.value))
    return out


def _may_grow(session: Session, settings: Settings, spec_of: SpecOf) -> bool:
    """Whether a running elastic job is below its max (with nothing queued, the pass is for growth alone)."""
    if not settings.elastic_grow:
        return False
    running = session.exec(select(Job).where(col(Job.state) == JobState.RUNNING)).all()
    return any(_below_max(job, spec_of(job)[0]) for job in running)


def _below_max(job: Job, spec: JobSpec | None) -> bool:
    """A running elastic job, not asked to yield, below its range's max: one that growth may ask to grow."""
    if spec is None or not spec.resources.elastic or job.state != JobState.RUNNING or job.world_size is None:
        return False
    return job.preempt_requested_at is None and job.world_size < spec.resources.max_workers


def _growth(
    session: Session, active: list[Job], *, specs_of: SpecOf, settings: Settings, now: datetime
) -> admission_pass.Growth | None:
    """Growth's part of the pass (service.policy.growth): the running elastic jobs that may grow, with how long their
    attempts have run."""
    if not settings.elastic_grow:
        return None
    growable = []
    for job in active:
        spec, _ = specs_of(job)
        if spec is None or not _below_max(job, spec):
            continue
        started = session.exec(
            select(Attempt.started_at).where(Attempt.job_id == job.id, Attempt.number == job.attempt)
        ).first()
        if started is not None:
            growable.append(growth.Growable(candidate(job, spec), job.world_size or 0, (now - started).total_seconds()))
    return admission_pass.Growth(settings.elastic_grow_after_seconds, settings.elastic_grow_min_gain, growable)


def _grow(session: Session, sizes: dict[str, int], by_id: dict[str, Job], *, owner: str, now: datetime) -> list[Job]:
    """Ask the running elastic jobs the pass grows to checkpoint and stop, to be admitted again larger."""
    grown = []
    for job_id, size in sizes.items():
        job = by_id[job_id]
        session.execute(update(Job).where(col(Job.id) == job_id).values(preempt_requested_at=now))
        said = (f"room for {size} workers (it runs {job.world_size}) is free and no job of priority {job.priority} "
                f"or higher waits: checkpointing, to run again at up to {size}")  # fmt: skip
        record_event(session, job_id, kind=EventKind.RESIZED, reason="grow_requested", attempt=job.attempt,
                     actor=owner, message=said)  # fmt: skip
        grown.append(job)
    return grown


def _start_attempt(
    session: Session, job: Job, *, owner: str, now: datetime, settings: Settings, held: dict[str, float],
    world_size: int, message: str | None = None, excluded: list[str] | None = None, why: dict[str, str] | None = None,
) -> tuple[Move, dict[str, Any]]:  # fmt: skip
    """One admitted job's QUEUED -> STARTING move and its new attempt row, written with the pass's others
    (`_write_starts`); its resize and node events are recorded here, before its state event."""
    number = job.attempt + 1
    before = job.world_size  # the size of the attempt before (None: the first one)
    if before is not None and before != world_size:
        grew = "grows" if world_size > before else "shrinks"
        record_event(session, job.id, kind=EventKind.RESIZED, reason="resized", attempt=number, actor=owner, at=now,
                     message=f"{grew} from {before} to {world_size} workers (attempt {number} resumes from the "
                             f"latest checkpoint at the new size)")  # fmt: skip
    for node, said in sorted((why or {}).items()):
        record_event(session, job.id, kind=EventKind.NODE, reason="node_excluded", attempt=number, actor=owner, at=now,
                     message=f"attempt {number} is kept off node {node}: it {said}")  # fmt: skip
    values: dict[str, Any] = {"attempt": number, "step": None, "latest_metrics": None, "progress_at": None,
                              "world_size": world_size, "stalled_at": None}  # fmt: skip
    values.update(leases.lease_values(owner, now, settings.lease_seconds))
    row = {"job_id": job.id, "number": number, "submission_id": submission_id(job.id, number), "submitted": False,
           "started_at": now, "cpus": held.get("CPU", 0.0), "gpus": held.get("GPU", 0.0),
           "excluded_nodes": excluded or None}  # fmt: skip
    return Move(job, JobState.STARTING, "admitted", message=message, values=values), row


def _write_starts(
    session: Session, starts: list[tuple[Move, dict[str, Any]]], *, owner: str, now: datetime,
    attempts: dict[str, Attempt] | None,
) -> list[Job]:  # fmt: skip
    """The pass's starts in three statements: the guarded UPDATEs (one executemany: the rows are locked by the
    queued read, or by SQLite's write transaction), their events, and the attempt rows (one INSERT)."""
    if not starts:
        return []
    transition_many(session, [m for m, _ in starts], actor=owner, now=now, locked=True)
    table = Attempt.__table__  # type: ignore[attr-defined]  # SQLModel sets __table__ when it makes the class
    rows = [row for _, row in starts]
    session.execute(insert(table), rows)  # one executemany (SQLite would run an INSERT … RETURNING row by row)
    if attempts is not None:
        subs = [row["submission_id"] for row in rows]
        ids = dict(
            session.execute(select(Attempt.submission_id, Attempt.id).where(col(Attempt.submission_id).in_(subs))).all()
        )
        for row in rows:
            attempts[row["job_id"]] = Attempt(id=ids[row["submission_id"]], **row)
    return [m.job for m, _ in starts]


def candidate(job: Job, spec: JobSpec) -> scheduler.Candidate:
    """A queued job as the policy sees it (admission and the start estimate alike)."""
    return scheduler.Candidate(
        job_id=job.id,
        priority=job.priority,
        seq=job.created_at.timestamp(),
        queue=job.queue,
        owner=job.owner,
        team=job.team,
        num_workers=spec.resources.max_workers,
        min_workers=spec.resources.min_workers if spec.resources.elastic else None,
        per_worker=spec.resources.per_worker(),
        placement=spec.resources.placement.value,
        run_seconds=spec.timeout_seconds,
    )


def kept_off(cand: scheduler.Candidate, nodes: dict[str, str] | None, cluster: ClusterView) -> scheduler.Candidate:
    """The candidate kept off its own excluded nodes, unless the rest of the cluster could never hold its group (by
    total room, not free): a job is then run where it can, never left waiting for ever."""
    if not nodes:
        return cand
    kept = replace(cand, excluded=frozenset(nodes), num_workers=cand.min_workers or cand.num_workers)
    whole = [scheduler.NodeFree(n.node_id, dict(n.total)) for n in cluster.nodes if n.alive]
    if scheduler.place(kept, whole) is None:
        return cand
    return replace(cand, excluded=frozenset(nodes))


def _timeout(spec_of: SpecOf, job: Job) -> float | None:
    spec, _ = spec_of(job)
    return spec.timeout_seconds if spec is not None else None
