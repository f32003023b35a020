"""Job use cases the API calls: submit, read, list, cancel. They record intent; the dispatcher acts on Ray."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import TypeGuard

from sqlalchemy import func, insert, literal
from sqlalchemy import select as sa_select
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from service.config import policies
from service.config.settings import Settings
from service.core import resources
from service.core.errors import Conflict, InvalidSpec, NotFound, StaleWrite
from service.lifecycle.state import record_event, transition
from service.policy import demand
from service.spec.job import JobSpec
from service.store import signals, spec_budget
from service.store.db import base_engine
from service.store.kept import KeptPerEngine
from service.store.models import (
    Attempt,
    Checkpoint,
    ClusterSnapshot,
    EventKind,
    Job,
    JobEvent,
    JobState,
    Metric,
    utcnow,
)
from service.store.spec_cache import stored_size
from service.tenancy import auth, code_archives, modes, secret_store
from service.tenancy.auth import Caller
from service.workflows import dependencies, notifications


def spec_hash(spec: JobSpec, dumped: dict | None = None) -> str:
    """The spec's digest (`dumped`: its `model_dump(mode="json")` when the caller has it already)."""
    body = spec.model_dump(mode="json") if dumped is None else dumped
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


SNAPSHOT_REUSE_SECONDS = 1.0  # a submission checks against a cluster snapshot read at most this long ago


def _read_shape(session: Session) -> ClusterSnapshot | None:
    snap = session.get(ClusterSnapshot, 1)
    # A detached copy: shared by the requests of the next second.
    return None if snap is None else ClusterSnapshot(id=1, nodes=list(snap.nodes or []), total=dict(snap.total or {}))


_shapes = KeptPerEngine(SNAPSHOT_REUSE_SECONDS, _read_shape)


def cluster_shape(session: Session) -> ClusterSnapshot | None:
    """The cluster as a dispatcher last stored it (its nodes and totals), for `check_fits_cluster`; read again once
    the kept copy is SNAPSHOT_REUSE_SECONDS old. The stored one is already up to a dispatcher tick old, so a second
    more changes nothing a submission is told, and a burst of submissions reads it once a second, not once each (a
    round trip of a PostgreSQL submission's six). None (no dispatcher has stored one yet) is kept the same way."""
    return _shapes.get(session)


def _seen(snapshot: ClusterSnapshot | None) -> TypeGuard[ClusterSnapshot]:
    return snapshot is not None and any(n.get("alive", True) and n.get("total") for n in snapshot.nodes)


def check_fits_cluster(spec: JobSpec, snapshot: ClusterSnapshot | None) -> None:
    """Refuse what the cluster (as last seen by a dispatcher) can never run. No snapshot yet, or no live node that has
    reported its resources (a head just started lists its node before its resources): nothing to check."""
    if not _seen(snapshot):
        return
    res = spec.resources
    if res.use_gpu and snapshot.total.get("GPU", 0.0) <= 0:
        raise InvalidSpec("resources.use_gpu: the Ray cluster has no GPUs; set use_gpu: false to train on CPU",
                          field="resources.use_gpu")  # fmt: skip
    per_worker = res.per_worker()
    nodes = [n for n in snapshot.nodes if n.get("alive", True) and n.get("total")]
    if not any(resources.fits(n["total"], per_worker) for n in nodes):
        largest = {k: max(n["total"].get(k, 0.0) for n in nodes) for k in per_worker}
        raise InvalidSpec(
            f"resources.resources_per_worker: one worker needs {per_worker}, more than any node has "
            f"(largest per resource: {largest})",
            field="resources.resources_per_worker",
        )
    placement = res.placement.value
    least = res.min_workers  # an elastic job starts at its min: that much must fit
    if placement == "strict_pack" and not any(resources.fits(n["total"], res.total(least)) for n in nodes):
        raise InvalidSpec(
            f"resources.placement: strict_pack needs one node with room for all {least} workers "
            f"({res.total(least)}); no node has it",
            field="resources.placement",
        )
    if placement == "strict_spread":
        holders = sum(1 for n in nodes if resources.fits(n["total"], per_worker))
        if least > holders:
            raise InvalidSpec(
                f"resources.placement: strict_spread needs {least} distinct nodes; only {holders} can hold a worker",
                field="resources.placement",
            )
    # How many workers fit on the whole cluster, node by node (a worker never spans nodes).
    capacity = sum(resources.workers_fitting(n["total"], per_worker) for n in nodes)
    if least > capacity:
        raise InvalidSpec(
            f"resources.num_workers: {least} workers of {per_worker} can never fit; "
            f"the cluster holds at most {capacity}",
            field="resources.num_workers",
        )


def submit(
    session: Session,
    spec: JobSpec,
    *,
    caller: Caller,
    idempotency_key: str | None = None,
    settings: Settings | None = None,
    written_at_once: bool = False,
    spec_tally: spec_budget.Tally | None = None,
) -> tuple[Job, bool]:
    """Queue a job. Returns (job, created); a replay of the same idempotency key and body returns the first job.

    A job the cluster can never hold is refused (422), or, when `cluster_may_grow`, held with that reason. A job
    whose spec would take its owner's jobs that have not ended over `max_queued_spec_bytes_per_owner` is refused (429,
    `spec`; `spec_tally`: the owner's count as a sweep keeps it, which names its own field). A code archive the spec
    names must still be stored (422 naming its field), and counts as used (`service.tenancy.code_archives`).
    `written_at_once`: on PostgreSQL, a job without `depends_on` is written with its event and signals in one
    statement (`_insert_with_event`), and the returned job is not in the session: the caller reads it, never changes
    it (POST /v1/jobs). Otherwise the job is added to the session, and flushed.
    """
    auth.check_submit(caller, queue=spec.queue, priority=spec.priority)
    too_deep = spec.nesting_problem(settings.max_spec_depth) if settings is not None else None
    if too_deep and settings is not None:
        field, where = too_deep
        message = f"nested deeper than {settings.max_spec_depth} levels, this service's max_spec_depth (at {where})"
        raise InvalidSpec(f"{field}: {message}", field=field)
    modes.check_spec(spec, caller, settings)
    notifications.check_spec(spec, settings)
    dumped = spec.model_dump(mode="json")
    digest = spec_hash(spec, dumped)
    if idempotency_key:
        existing = session.exec(
            select(Job).where(Job.owner == caller.owner, Job.idempotency_key == idempotency_key)
        ).first()
        if existing is not None:
            return _replay(existing, digest, idempotency_key)
    reason = "waiting for resources"
    if settings is not None:
        from service.lifecycle.queues import check_known

        check_known(session, settings, spec.queue, spec.resources.accelerator_type)
    shape, held = cluster_shape(session), False
    try:
        check_fits_cluster(spec, shape)
    except InvalidSpec as exc:
        if settings is None or not settings.cluster_may_grow:
            raise
        reason, held = f"held until the cluster grows: {exc.detail}", True
    if settings and settings.cluster_may_grow and settings.node_types and (held or not _seen(shape)):
        demand.check_node_types(spec.resources, policies.node_types(settings))  # never holdable: refused, seen or not
    size = stored_size(dumped)
    if settings is not None:  # what the spec asks is valid (422s first); now what it would hold and use
        code_archives.use_named(session, spec, settings, owner=caller.owner)
        secret_store.check_named(session, spec.secrets, owner=caller.owner, team=caller.team)
        tally = spec_tally or spec_budget.Tally.read(session, settings, owner=caller.owner, field="spec")
        tally.add(size)
    job = Job(
        name=spec.name,
        owner=caller.owner,
        team=caller.team,
        queue=spec.queue,
        accelerator_type=resources.accelerator_of(spec.resources.per_worker()),
        priority=spec.priority,
        spec=dumped,
        spec_bytes=size,
        idempotency_key=idempotency_key,
        spec_hash=digest,
        state_reason=reason,
        warnings=[w] if (w := demand.accelerator_warning(spec.resources)) else None,
    )
    one_statement = written_at_once and not spec.depends_on and session.get_bind().dialect.name == "postgresql"
    if not one_statement:
        session.add(job)
        record_event(session, job.id, kind=EventKind.STATE, to_state=JobState.QUEUED, reason="submitted", attempt=0)
    signals.publish(session, signals.ADMISSION)  # on commit: a dispatcher looks now (service.store.signals)
    try:
        if one_statement:
            signals.publish(session, signals.EVENTS, job.id)  # (what record_event says of the event it adds)
            # Nothing else to write, and nothing read in a transaction yet: the statement is the transaction.
            alone = (
                not session.in_transaction()
                and not spec.notify
                and not notifications.cluster_targets(session.get_bind())
            )
            _insert_with_event(session, job, alone=alone)
        notifications.store_secrets(session, job, spec)
        notifications.enqueue(session, job, from_state=None, to_state=JobState.QUEUED, reason="submitted", message=None,
                       at=job.created_at)  # fmt: skip
        session.flush()
    except IntegrityError:
        # Two replays of one key raced: the loser returns the winner's job.
        session.rollback()
        if idempotency_key:
            existing = session.exec(
                select(Job).where(Job.owner == caller.owner, Job.idempotency_key == idempotency_key)
            ).one()
            return _replay(existing, digest, idempotency_key)
        raise
    dependencies.record(session, job, spec, owner=caller.owner, admin=caller.admin, now=job.created_at)
    return job, True


def _insert_with_event(session: Session, job: Job, *, alone: bool = False) -> None:
    """One statement on PostgreSQL: the job's row, its `submitted` event and the signals published so far
    (`signals.unsent_notes`), in place of the ORM's INSERT, INSERT, then SELECT pg_notify(...) at commit. The row holds
    every column of `job` as the ORM writes it (tests/service/test_spec_roundtrip.py reads both back the same); the
    event is the one `record_event` adds. `alone`: it is all the submission writes, and nothing was read in a
    transaction before it, so it runs as a transaction of its own (autocommit): one round trip in all, instead of
    BEGIN, the statement and COMMIT; the signals are still heard in this process when the session commits."""
    jobs_t, events_t = Job.__table__, JobEvent.__table__  # type: ignore[attr-defined]  # SQLModel sets __table__ when it makes the class
    new_job = insert(jobs_t).values({c.name: getattr(job, c.key) for c in jobs_t.columns}).returning(jobs_t.c.id)
    job_cte = new_job.cte("new_job")
    event = {"kind": EventKind.STATE.value, "from_state": None, "to_state": JobState.QUEUED, "reason": "submitted",
             "message": None, "attempt": 0, "actor": None, "at": utcnow()}  # fmt: skip
    columns = [job_cte.c.id, *(literal(v, events_t.c[k].type) for k, v in event.items())]
    event_cte = (
        insert(events_t).from_select(["job_id", *event], sa_select(*columns)).returning(events_t.c.id).cte("new_event")
    )
    said = [func.pg_notify(literal(channel), literal(payload)) for channel, payload in signals.unsent_notes(session)]
    statement = sa_select(event_cte.c.id, *said).add_cte(job_cte).select_from(event_cte)
    if not alone:
        session.execute(statement)
        return
    with base_engine(session.get_bind()).connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(statement)


def _replay(existing: Job, digest: str, key: str) -> tuple[Job, bool]:
    if existing.spec_hash != digest:
        raise Conflict(f"Idempotency-Key {key!r} was used for a different job spec (job {existing.id})")
    return existing, False


def get(session: Session, job_id: str, *, caller: Caller) -> Job:
    job = session.get(Job, job_id)
    if job is None or not caller.may_see(job):
        raise NotFound(f"no job {job_id!r}")
    return job


def list_jobs(
    session: Session,
    *,
    caller: Caller,
    state: JobState | None = None,
    queue: str | None = None,
    name: str | None = None,
    owner: str | None = None,
    sweep: str | None = None,
    limit: int = 50,
    before: tuple[datetime, str] | None = None,
) -> list[Job]:
    """Newest first; `before` is a (created_at, id) cursor, stable while new jobs arrive.

    `owner` narrows an admin's listing; for anyone else it can only narrow their own jobs (to nothing).
    """
    query = select(Job)
    if not caller.admin:
        query = query.where(Job.owner == caller.owner)
    if owner is not None:
        query = query.where(Job.owner == owner)
    if state is not None:
        query = query.where(Job.state == state)
    if queue is not None:
        query = query.where(Job.queue == queue)
    if name is not None:
        query = query.where(Job.name == name)
    if sweep is not None:
        query = query.where(Job.sweep_id == sweep)
    if before is not None:
        created, job_id = before
        query = query.where(
            (col(Job.created_at) < created) | ((col(Job.created_at) == created) & (col(Job.id) < job_id))
        )
    query = query.order_by(col(Job.created_at).desc(), col(Job.id).desc()).limit(limit)
    return list(session.exec(query).all())


def cancel(session: Session, job_id: str, *, caller: Caller) -> Job:
    """Ask for a cancel: a queued job ends at once; an admitted one goes CANCELLING and the dispatcher stops it."""
    for _ in range(5):
        job = get(session, job_id, caller=caller)
        session.refresh(job)
        state = JobState(job.state)
        if state.is_terminal:
            raise Conflict(f"job {job_id} already ended {state.value}; nothing to cancel")
        if state is JobState.CANCELLING:
            return job
        try:
            to = JobState.CANCELLED if state is JobState.QUEUED else JobState.CANCELLING
            values = {"end_reason": "cancelled"} if to is JobState.CANCELLED else {}
            signals.publish(session, signals.ADMISSION, job.id)  # its dispatcher stops it now, not at its next tick
            return transition(session, job, to=to, reason="cancel_requested", actor=caller.owner, values=values)
        except StaleWrite:
            continue  # a dispatcher moved it (e.g. QUEUED -> STARTING) between read and write: read again
    raise Conflict(f"job {job_id} is changing state too fast to cancel; try again")


def retry(session: Session, job_id: str, *, caller: Caller, settings: Settings | None = None) -> Job:
    """Put an ended (FAILED or CANCELLED) job back in the queue; it resumes from its last good checkpoint. With
    `settings`, its spec counts again against its owner's `max_queued_spec_bytes_per_owner` (429 beyond)."""
    job = get(session, job_id, caller=caller)
    state = JobState(job.state)
    if state not in (JobState.FAILED, JobState.CANCELLED):
        raise Conflict(f"job {job_id} is {state.value}; only FAILED or CANCELLED jobs can be retried")
    auth.check_submit(caller, queue=job.queue, priority=job.priority)
    if settings is not None:
        tally = spec_budget.Tally.read(session, settings, owner=job.owner, field="spec")
        tally.check(job.spec_bytes, what=f"job {job.id}'s spec")
        try:
            spec = JobSpec.model_validate(job.spec)
        except ValueError:
            spec = None  # its attempt ends it as a user error, saying why
        if spec is not None:  # its code archive must still be stored (422 naming the field, as at submission)
            code_archives.use_named(session, spec, settings, owner=job.owner)
    waiting = dependencies.reopen(session, job)  # its unmet dependencies, looked at again (409 if one still misses)
    signals.publish(session, signals.ADMISSION)
    return transition(
        session,
        job,
        to=JobState.QUEUED,
        reason="retry_requested",
        message=waiting,
        actor=caller.owner,
        values={"end_reason": None, "last_error": None, "not_before": None},
    )


def events(session: Session, job: Job, *, after_id: int = 0, limit: int | None = None) -> list[JobEvent]:
    """The job's events after an event id, oldest first (at most `limit`: a page)."""
    query = select(JobEvent).where(JobEvent.job_id == job.id, col(JobEvent.id) > after_id)
    return list(session.exec(query.order_by(col(JobEvent.id)).limit(limit)).all())


def visible_events(session: Session, *, caller: Caller, after_id: int = 0, limit: int = 1000) -> list[JobEvent]:
    """Events of every job the caller may see, oldest first, after an event id (a stream's resume point)."""
    query = select(JobEvent).where(col(JobEvent.id) > after_id)
    if not caller.admin:
        query = query.join(Job, col(Job.id) == col(JobEvent.job_id)).where(Job.owner == caller.owner)
    return list(session.exec(query.order_by(col(JobEvent.id)).limit(limit)).all())


def last_event_id(session: Session) -> int:
    """The newest event id (0 before any): where a stream that follows a listing read now starts."""
    return int(session.exec(select(func.max(JobEvent.id))).one() or 0)


def active_jobs(session: Session, *, caller: Caller) -> list[Job]:
    """Jobs admitted to Ray and not yet ended (STARTING, RUNNING, CANCELLING) that the caller may see."""
    query = select(Job).where(col(Job.state).in_([JobState.STARTING, JobState.RUNNING, JobState.CANCELLING]))
    if not caller.admin:
        query = query.where(Job.owner == caller.owner)
    return list(session.exec(query.order_by(col(Job.started_at), col(Job.id))).all())


def visible_ids(session: Session, job_ids: set[str], *, caller: Caller) -> set[str]:
    """Those of `job_ids` the caller may see (all, for an admin)."""
    if caller.admin or not job_ids:
        return set(job_ids)
    query = select(Job.id).where(col(Job.id).in_(sorted(job_ids)), Job.owner == caller.owner)
    return set(session.exec(query).all())


def cluster_snapshot(session: Session) -> ClusterSnapshot | None:
    """The dispatcher's latest view of the Ray cluster (None until a dispatcher has reached Ray once)."""
    return session.get(ClusterSnapshot, 1)


def attempts(session: Session, job: Job) -> list[Attempt]:
    return list(session.exec(select(Attempt).where(Attempt.job_id == job.id).order_by(col(Attempt.number))).all())


def checkpoints(session: Session, job: Job, *, after_id: int = 0, limit: int | None = None) -> list[Checkpoint]:
    """The job's checkpoints in the order they were recorded, after a row id (at most `limit`: a page)."""
    query = select(Checkpoint).where(Checkpoint.job_id == job.id, col(Checkpoint.id) > after_id)
    return list(session.exec(query.order_by(col(Checkpoint.id)).limit(limit)).all())


def metric_series(
    session: Session, job: Job, *, name: str | None = None, after_id: int = 0, limit: int = 10_000
) -> list[Metric]:
    """The job's metric points in the order they were reported, after a row id (at most `limit`: a page)."""
    query = select(Metric).where(Metric.job_id == job.id, col(Metric.id) > after_id)
    if name:
        query = query.where(Metric.name == name)
    return list(session.exec(query.order_by(col(Metric.id)).limit(limit)).all())
