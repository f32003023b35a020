"""Job dependencies (`depends_on`): a job waits QUEUED until the jobs it names meet their conditions, and ends at the
first one that cannot.

- Submission (`record`) writes one `JobDependency` row per entry and counts the unmet ones into `Job.waiting_on`;
  admission reads only jobs at 0 (`service.lifecycle.leases`), so a waiting job neither starts nor holds up the jobs
  behind it. A dependency already met counts as met at once; one that already ended without meeting its condition is
  refused (422): the job could never start.
- The transaction that ends a job settles its dependents (`settle`, called by `service.lifecycle.state.transition`, the
one
  writer of job state): each pending edge becomes met (the dependency's latest complete checkpoint is kept on it) or
  missed. A miss ends a QUEUED dependent FAILED with end reason `dependency_failed` (or CANCELLED, with
  `on_dependency_failure: cancel`), which in turn settles that job's own dependents: a chain ends link by link. A
  later retry of the dependency revives nothing: only pending edges are settled.
- A user's retry of the dependent itself (`reopen`) looks at its unmet dependencies again: one that now meets its
  condition is met, one that runs again is waited for, one that still misses refuses the retry (409).
- When the job starts, `${deps.<as>.checkpoint}` / `${deps.<as>.model}` in its config are filled in
  (`resolved_config`) from the edges: the driver reads the filled-in config; a reference that cannot be filled
  ends the job (user error) naming its field.

No cycle can form: a job may depend only on jobs that exist when it is submitted, ids are the service's own, and a
stored spec never changes (a retry keeps it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Any

from sqlalchemy import func, update
from sqlmodel import Session, col, select

from service.core.errors import Conflict, InvalidSpec
from service.spec.depends_on import Condition, OnFailure, substitute
from service.spec.job import JobSpec
from service.store.models import EndReason, EventKind, Job, JobDependency, JobState, utcnow

MET, MISSED = "met", "missed"
VERB = {Condition.succeeded: "succeed", Condition.ended: "end"}
NAMED_IN_REASON = 3  # how many pending dependencies a waiting job's state_reason names


# ---- decisions (pure) --------------------------------------------------------------------------------------------
def outcome(condition: Condition, state: JobState) -> str | None:
    """Met, missed, or None (not decided yet: the dependency has not ended)."""
    if not state.is_terminal:
        return None
    return MET if condition is Condition.ended or state is JobState.SUCCEEDED else MISSED


def miss_state(policy: OnFailure) -> JobState:
    """Where a dependent goes when a dependency misses."""
    return JobState.CANCELLED if policy is OnFailure.cancel else JobState.FAILED


def miss_message(dependency: str, state: JobState) -> str:
    return f"dependency {dependency} ended {state.value} and can no longer succeed"


def waiting_reason(pending: list[tuple[str, Condition]], total: int) -> str:
    """A waiting job's state_reason: e.g. 'waiting for job j1 to succeed (1 of 2 dependencies left)'."""
    named = ", ".join(f"job {job} to {VERB[cond]}" for job, cond in pending[:NAMED_IN_REASON])
    more = f" and {len(pending) - NAMED_IN_REASON} more" if len(pending) > NAMED_IN_REASON else ""
    noun = "dependency" if total == 1 else "dependencies"
    return f"waiting for {named}{more} ({len(pending)} of {total} {noun} left)"


READY_REASON = "dependencies met; waiting for resources"


# ---- submission and retry ----------------------------------------------------------------------------------------
def record(session: Session, job: Job, spec: JobSpec, *, owner: str, admin: bool, now: datetime) -> None:
    """Write the edges of a just-flushed `job` and its `waiting_on`; refuse unknown ids and, for a non-admin, another
    owner's jobs with the same 422 (a 403 told anyone which job ids exist: issue 35), and dependencies that already
    missed (422)."""
    if not spec.depends_on:
        return
    # Locked, in id order (two submissions naming the same jobs never wait on each other in a circle): a dependency
    # ending meanwhile either sees this job's edge and settles it, or is seen ended here.
    rows = {j.id: j for j in _locked_all(session, [d.job for d in spec.depends_on])}
    pending: list[tuple[str, Condition]] = []
    for i, dep in enumerate(spec.depends_on):
        field = f"depends_on[{i}].job"
        row = rows.get(dep.job)
        if row is None or (not admin and row.owner != owner):
            raise InvalidSpec(f"{field}: no job {dep.job!r}", field=field)
        got = outcome(dep.on, JobState(row.state))
        if got == MISSED:
            raise InvalidSpec(
                f"{field}: job {dep.job} already ended {JobState(row.state).value} and can never succeed (retry it "
                f"first, or wait for it with on: ended)",
                field=field,
            )
        if got is None:
            pending.append((dep.job, dep.on))
        session.add(
            JobDependency(job_id=job.id, depends_on=dep.job, position=i, condition=dep.on.value, alias=dep.as_,
                          outcome=got, settled_at=now if got else None,
                          checkpoint=row.latest_checkpoint if got else None)
        )  # fmt: skip
    job.waiting_on = len(pending)
    job.state_reason = waiting_reason(pending, len(spec.depends_on)) if pending else READY_REASON
    session.add(job)


def reopen(session: Session, job: Job, *, now: datetime | None = None) -> str | None:
    """Before a user's retry of `job`: its unmet dependencies looked at again. Returns its state_reason to be (None
    without dependencies); a dependency that still misses refuses the retry (409)."""
    now = now or utcnow()
    edges = _edges(session, job.id)
    if not edges:
        return None
    pending: list[tuple[str, Condition]] = []
    for edge in edges:
        cond = Condition(edge.condition)
        if edge.outcome == MET:
            continue
        row = _locked(session, edge.depends_on)
        state = JobState(row.state) if row is not None else JobState.FAILED
        got = outcome(cond, state)
        if got == MISSED:
            raise Conflict(
                f"job {job.id} depends on job {edge.depends_on}, which ended {state.value}: retry that one first"
            )
        _set_edge(session, edge.id, got, now=now, checkpoint=row.latest_checkpoint if got and row else None)
        if got is None:
            pending.append((edge.depends_on, cond))
    session.execute(update(Job).where(col(Job.id) == job.id).values(waiting_on=len(pending)))
    job.waiting_on = len(pending)
    return waiting_reason(pending, len(edges)) if pending else READY_REASON


# ---- the end of a dependency -------------------------------------------------------------------------------------
Transition = Callable[..., Job]
Note = Callable[..., None]


_SETTLING = "shunter.dependencies.settling"  # session.info: the jobs ended in this settle, still to settle


def settle(
    session: Session, job: Job, *, now: datetime, actor: str | None, transition: Transition, record_event: Note
) -> None:
    """`job` has just ended: settle every pending edge on it, in this transaction. `transition` and `record_event`
    are `service.lifecycle.state`'s (passed in: this module is below it). A dependent ended here settles its own
    dependents from this loop, not by recursion, so a chain of any length ends in one transaction."""
    queue: deque[tuple[str, JobState]] | None = session.info.get(_SETTLING)
    if queue is not None:  # a dependent ended by the settle already running in this session
        queue.append((job.id, JobState(job.state)))
        return
    queue = session.info[_SETTLING] = deque([(job.id, JobState(job.state))])
    try:
        while queue:
            ended, state = queue.popleft()
            _settle_one(session, ended, state, now=now, actor=actor, transition=transition, record_event=record_event)
    finally:
        del session.info[_SETTLING]


def _settle_one(
    session: Session, job_id: str, state: JobState, *, now: datetime, actor: str | None, transition: Transition,
    record_event: Note,
) -> None:  # fmt: skip
    edges = session.exec(
        select(JobDependency)
        .where(JobDependency.depends_on == job_id, col(JobDependency.outcome).is_(None))
        .order_by(col(JobDependency.id))
    ).all()
    if not edges:
        return
    checkpoint = session.exec(select(Job.latest_checkpoint).where(Job.id == job_id)).first()
    for edge in edges:
        got = outcome(Condition(edge.condition), state)
        _set_edge(session, edge.id, got, now=now, checkpoint=checkpoint if got == MET else None)
        session.execute(
            update(Job).where(col(Job.id) == edge.job_id).values(waiting_on=col(Job.waiting_on) - 1)
        )  # only ever pending edges are counted: this one was
        dependent = _locked(session, edge.job_id)
        if dependent is None or dependent.state != JobState.QUEUED:
            continue  # ended meanwhile (cancelled while waiting): the edge is settled, nothing else moves
        if got == MET:
            reason = _reason_now(session, dependent.id)
            session.execute(update(Job).where(col(Job.id) == dependent.id).values(state_reason=reason))
            record_event(session, dependent.id, kind=EventKind.DEPENDENCY, reason="dependency_met", actor=actor,
                         attempt=dependent.attempt, at=now,
                         message=f"job {job_id} ended {state.value}; {reason}")  # fmt: skip
            continue
        message = miss_message(job_id, state)
        policy = OnFailure((dependent.spec or {}).get("on_dependency_failure", OnFailure.fail.value))
        transition(
            session, dependent, to=miss_state(policy), reason=EndReason.DEPENDENCY_FAILED.value, message=message,
            actor=actor, now=now, values={"end_reason": EndReason.DEPENDENCY_FAILED, "last_error": message},
        )  # fmt: skip


# ---- the hand-off ------------------------------------------------------------------------------------------------
def resolved_config(
    session: Session, job: Job, spec: JobSpec, *, storage_of: Callable[[JobSpec], str]
) -> tuple[dict[str, Any], list[str]]:
    """The job's config with its `${deps...}` references filled in, and those that could not be (their paths).

    `checkpoint`: the dependency's latest complete checkpoint when it met the condition. `model`: a script-mode
    dependency's kept outputs folder (`<storage>/<job>/outputs`, see workers.script), else that checkpoint.
    `storage_of` is `service.dispatch.submission.job_storage` with the service's settings."""
    if "${deps." not in repr(spec.config):
        return spec.config, []
    edges = {e.alias: e for e in _edges(session, job.id) if e.alias is not None}

    def lookup(alias: str, kind: str) -> str | None:
        edge = edges.get(alias)
        if edge is None or edge.outcome != MET:
            return None
        if kind == "model":
            dep = session.get(Job, edge.depends_on)
            dep_spec = _spec(dep)
            if dep is not None and dep_spec is not None and dep_spec.entrypoint.script:
                return f"{storage_of(dep_spec).rstrip('/')}/{dep.id}/outputs"
        return edge.checkpoint

    return substitute(spec.config, lookup)


def describe(session: Session, job: Job) -> list[dict[str, Any]]:
    """The job's dependencies as the API shows them: each one's condition, name, outcome and current state."""
    edges = _edges(session, job.id)
    states = dict(session.exec(select(Job.id, Job.state).where(col(Job.id).in_([e.depends_on for e in edges]))).all())
    return [
        {"job": e.depends_on, "on": e.condition, "as": e.alias, "status": e.outcome or "pending",
         "state": JobState(states[e.depends_on]).value if e.depends_on in states else None,
         "settled_at": e.settled_at, "checkpoint": e.checkpoint}
        for e in edges
    ]  # fmt: skip


# ---- helpers -----------------------------------------------------------------------------------------------------
def _edges(session: Session, job_id: str) -> list[JobDependency]:
    query = select(JobDependency).where(JobDependency.job_id == job_id).order_by(col(JobDependency.position))
    return list(session.exec(query.execution_options(populate_existing=True)).all())


def _locked(session: Session, job_id: str) -> Job | None:
    """The job row as it is now in this transaction, locked on PostgreSQL (SQLite's write transaction locks all)."""
    query = select(Job).where(Job.id == job_id).with_for_update().execution_options(populate_existing=True)
    return session.exec(query).first()


def _locked_all(session: Session, job_ids: list[str]) -> list[Job]:
    query = select(Job).where(col(Job.id).in_(sorted(job_ids))).order_by(col(Job.id)).with_for_update()
    return list(session.exec(query.execution_options(populate_existing=True)).all())


def _set_edge(session: Session, edge_id: int | None, got: str | None, *, now: datetime, checkpoint: str | None) -> None:
    # A Core UPDATE, not an attribute change: admission runs without autoflush, and the next read must see it.
    session.execute(
        update(JobDependency)
        .where(col(JobDependency.id) == edge_id)
        .values(outcome=got, settled_at=now if got else None, checkpoint=checkpoint)
    )


def _reason_now(session: Session, job_id: str) -> str:
    rows = session.exec(
        select(JobDependency.depends_on, JobDependency.condition, JobDependency.outcome)
        .where(JobDependency.job_id == job_id)
        .order_by(col(JobDependency.position))
    ).all()
    pending = [(dep, Condition(cond)) for dep, cond, got in rows if got is None]
    return waiting_reason(pending, len(rows)) if pending else READY_REASON


def _spec(job: Job | None) -> JobSpec | None:
    if job is None:
        return None
    try:
        return JobSpec.model_validate(job.spec)
    except ValueError:
        return None


def ready_since(session: Session, job_ids: list[str]) -> dict[str, float]:
    """Job id -> when its last dependency was settled (seconds), for those of `job_ids` that had any: since then it
    waits for room, not for its dependencies (the starvation guard counts from here)."""
    if not job_ids:
        return {}
    query = (
        select(JobDependency.job_id, func.max(JobDependency.settled_at))
        .where(col(JobDependency.job_id).in_(job_ids), col(JobDependency.settled_at).is_not(None))
        .group_by(col(JobDependency.job_id))
    )
    return {job_id: at.timestamp() for job_id, at in session.exec(query).all() if at is not None}
