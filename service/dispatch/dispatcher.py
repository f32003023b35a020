"""The dispatcher loop: the only code that acts on Ray.

Each tick runs its named steps in order (`Dispatcher.steps`): renew leases (and adopt jobs whose dispatcher died),
read the cluster's resources, reconcile every job it holds (stall watch among the facts) and write the ends Ray
reported together, admit queued jobs whose whole worker group fits, keep the logs of attempts that ended on their
driver's word, and cluster-wide chores. What to do with a job is decided by the pure
`service.policy.reconcile.decide` (and admission by `service.policy.admission_pass`); this module gathers the facts
and carries out the actions through its parts, each given its collaborators: `ClusterReads`, `Finishing` (ends and
submissions recorded, with the injected retry policy), `HostEffects`, `JobFaults`, `LateLogs`, `StallWatch`,
`Scaling`, `Chores`. The admission pass is injected too (`admit`). Database writes are short transactions; Ray
calls happen between them, never inside one.

One job's fault stays that job's: input of its own that cannot be used (a spec that no longer validates, a resume
id that names nothing) ends it as a user error; a fault of shunter's host while handling it (keeping its log,
writing a preemption notice) is recorded as an event and got past; anything else unexpected is retried on later ticks
and, past `job_fault_patience_seconds`, ends that job. None of it stops the pass for the other jobs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.config.settings import Settings
from service.core.backend import Backend, ClusterView
from service.core.errors import InfraError, InvalidSpec
from service.dispatch import admission, submission
from service.dispatch.chores import Chores
from service.dispatch.cluster_reads import ClusterReads
from service.dispatch.finishing import Ending, Finishing, batched_finish
from service.dispatch.host_effects import HostEffects
from service.dispatch.host_files import HostFiles
from service.dispatch.job_faults import JobFaults
from service.dispatch.late_logs import LateLogs
from service.dispatch.nodes import NodeHistory
from service.dispatch.scaling import Scaling
from service.dispatch.stall_watch import StallWatch
from service.dispatch.timings import DISPATCHER_TICK_SECONDS
from service.lifecycle import leases
from service.lifecycle.state import transition
from service.policy import retry
from service.policy.reconcile import (
    Action,
    AttemptFacts,
    DumpStacks,
    Finish,
    JobFacts,
    MarkRunning,
    MarkSubmitted,
    Patience,
    Stop,
    Submit,
    decide,
)
from service.spec.job import JobSpec
from service.store import signals
from service.store.db import session_scope
from service.store.models import Attempt, Checkpoint, EndReason, Job, JobState, utcnow
from service.store.spec_cache import SpecCache, stored_size
from service.tenancy.secret_store import masker_for

log = logging.getLogger(__name__)
STOP_RESEND_SECONDS = 5.0
LEASE_PASSES = 5  # lease renewals per lease


@dataclass
class TickState:
    """What one tick's steps hand on: when it began, and the cluster as read (None: Ray could not be read)."""

    now: datetime
    cluster: ClusterView | None = None


class Dispatcher:
    def __init__(
        self, *, engine: Engine, settings: Settings, ray: Backend, owner: str, files: HostFiles | None = None,
        retry_policy: Callable[..., retry.RetryDecision] = retry.decide,
        admit: Callable[..., tuple[list[Job], list[Job]]] = admission.admit,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.settings = settings
        self.ray = ray
        self.owner = owner
        self.files = files or HostFiles(settings.data_dir)
        self.patience = Patience(submit_seconds=settings.submit_patience_seconds,
                                 preemption_grace_seconds=settings.preemption_grace_seconds)  # fmt: skip
        self.stalls = StallWatch(engine=engine, settings=settings, ray=ray, owner=owner)  # hang detection
        self._started = False
        self._warm = False  # the backend's client made ahead of the first submission (after the first tick)
        self._stop_sent: dict[str, float] = {}
        self._specs: SpecCache[tuple[JobSpec | None, str | None]] = SpecCache()
        self.faults = JobFaults(engine=engine, settings=settings, ray=ray, owner=owner)  # one job's, kept its own
        self._pool = ThreadPoolExecutor(max_workers=settings.dispatcher_threads, thread_name_prefix="reconcile")
        self.last_tick_seconds = 0.0
        self.chores = Chores(engine=engine, settings=settings, ray=ray)  # cluster-wide housekeeping, now and then
        self.scaling = Scaling(engine=engine, settings=settings, ray=ray, owner=owner)  # asks a growing cluster
        self._next_lease_pass: datetime | None = None  # when the leases are next renewed (`tick`)
        self._may_hold = True  # False once a read found it holds no lease, until it gains one (`tick`)
        self.nodes = NodeHistory()  # which nodes went draining or dead, and when (bears out node_draining ends)
        self.cluster_reads = ClusterReads(engine=engine, ray=ray, nodes=self.nodes, scaling=self.scaling)
        self.late = LateLogs(engine=engine, ray=ray, files=self.files, owner=owner,
                             linger_seconds=settings.driver_linger_seconds,
                             mask=lambda job_id: masker_for(engine, settings, job_id))  # fmt: skip
        self.waker: signals.Waker | None = None  # signals between ticks, while `run` runs (service.store.signals)
        self.host = HostEffects(engine=engine, settings=settings, ray=ray, files=self.files, owner=owner,
                                spec_of=self.spec_of)  # fmt: skip
        self.finishing = Finishing(engine=engine, settings=settings, owner=owner, nodes=self.nodes, late=self.late,
                                   host=self.host, spec_of=self.spec_of, safely=self.faults.safely,
                                   stop_sent=self._stop_sent, retry_policy=retry_policy)  # fmt: skip
        self._admit = admit
        self.steps: list[tuple[str, Callable[[TickState], None]]] = [
            ("leases", self._leases), ("cluster", self._read), ("reconcile", self._reconcile_held_jobs),
            ("admit", self._admission), ("late logs", self._late_logs), ("chores", self._chores),
        ]  # fmt: skip

    # ---- the loop -------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.waker = waker = signals.Waker(self.engine)
        try:
            while not stop.is_set():
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - a tick without a database does nothing; the next one tries again
                    log.exception("dispatcher tick failed")
                self._between_ticks(stop, waker, time.monotonic() + self.settings.dispatcher_tick_seconds)
        finally:
            waker.close()
            self._pool.shutdown(wait=True)

    def _between_ticks(self, stop: threading.Event, waker: signals.Waker, until: float) -> None:
        """Wait for the next tick; a signal meanwhile (a job posted, an attempt ended, a cancel) gets a pass at once."""
        while not stop.is_set() and (left := until - time.monotonic()) > 0:
            if waker.wait(min(left, 0.5)):
                try:
                    self.wake(waker.take())
                except Exception:  # noqa: BLE001 - as for a tick: the next one tries again
                    log.exception("dispatcher wake-up pass failed")
                stop.wait(self.settings.dispatcher_wake_spacing_seconds)

    def wake(self, job_ids: set[str]) -> None:
        """Between ticks: reconcile the held jobs a signal named, then one admission pass. (The cluster is read
        first, as in a tick: an end is judged against a view of the nodes at least as new as it.)"""
        cluster = self.read_cluster(store=False)
        if job_ids:
            with Session(self.engine, expire_on_commit=False) as session:
                named = session.exec(select(Job).where(col(Job.id).in_(sorted(job_ids)[:500]),
                                                       Job.lease_owner == self.owner)).all()  # fmt: skip
            list(self._pool.map(self._reconcile_safely, named))
        if cluster is not None:
            self.admit(cluster)

    def tick(self) -> None:
        started = time.monotonic()
        state = TickState(now=utcnow())
        for _, step in self.steps:
            step(state)
        self.last_tick_seconds = time.monotonic() - started
        DISPATCHER_TICK_SECONDS.observe(self.last_tick_seconds)

    def _leases(self, state: TickState) -> None:
        if self._next_lease_pass is None or state.now >= self._next_lease_pass:
            # Five times a lease, not every tick (a write transaction each: most of an idle service's CPU at 0.25 s),
            # by the clock leases expire by (a simulation's virtual one jumps).
            self._next_lease_pass = state.now + timedelta(seconds=self.settings.lease_seconds / LEASE_PASSES)
            with session_scope(self.engine) as session:
                leases.heartbeat(session, owner=self.owner, now=state.now, seconds=self.settings.lease_seconds)
                if leases.take_over(session, owner=self.owner, now=state.now, seconds=self.settings.lease_seconds,
                                    include_own=not self._started):  # fmt: skip
                    self._may_hold = True
        if not self._started:
            self.late.pick_up(state.now)
        self._started = True

    def _read(self, state: TickState) -> None:
        state.cluster = self.read_cluster()  # None when Ray cannot be read: what we hold is reconciled all the same

    def _reconcile_held_jobs(self, state: TickState) -> None:
        mine: list[tuple[Job, Attempt | None]] = []
        if self._may_hold:  # a job is gained only by admitting or adopting it: holding none, no read is needed
            with Session(self.engine, expire_on_commit=False) as session:
                mine = leases.owned_with_attempts(session, owner=self.owner)
            self._may_hold = bool(mine)
        # Reconciling is mostly waiting (Ray's HTTP API, the database): overlap it across the jobs held. The attempts
        # Ray says ended are written together after (service.dispatch.finishing).
        ends = self._pool.map(lambda held: self.faults.safely(held[0], self._reconcile_held, *held), mine)
        self.finishing.finish_many([e for e in ends if e is not None])

    def _admission(self, state: TickState) -> None:
        if state.cluster is not None:
            self.admit(state.cluster)

    def _late_logs(self, state: TickState) -> None:
        self.late.step(self._pool.map)  # logs of attempts ended on their driver's word, once Ray's job has exited

    def _chores(self, state: TickState) -> None:
        if state.cluster is not None:
            self.chores.sweep_placement_groups()
        self.chores.expire_code_archives()
        if not self._warm:
            # The Ray Jobs client is made after the first tick, not inside the first submission (importing it and
            # Ray's version check take a few hundred ms); on this thread, as the tick's own imports of Ray are: a
            # module of Ray imported from two threads at once can be left half made.
            self._warm = True
            warm = getattr(self.ray, "warm", None)
            if warm is not None:
                warm()

    # ---- facts about one job --------------------------------------------------------------------------------
    def spec_of(self, job: Job) -> tuple[JobSpec | None, str | None]:
        """The job's stored spec, or why it no longer validates. Specs never change, so each is parsed once (kept
        within a byte bound: `service.store.spec_cache`)."""
        kept, known = self._specs.get(job.id)
        if kept and known is not None:
            return known
        try:
            parsed: tuple[JobSpec | None, str | None] = (JobSpec.model_validate(job.spec), None)
        except Exception as exc:  # noqa: BLE001 - a row of any shape must end only its own job
            parsed = (None, f"spec: the stored job spec does not validate: {str(exc)[:1500]}")
        self._specs.put(job.id, parsed, stored_size(job.spec))
        return parsed

    def resources_of(self, job: Job) -> dict[str, float]:
        """What an admitted job holds: its group at the size it was admitted at."""
        spec, _ = self.spec_of(job)
        return spec.resources.total(job.world_size) if spec is not None else {}

    # ---- cluster view ---------------------------------------------------------------------------------------
    def read_cluster(self, *, store: bool = True) -> ClusterView | None:
        """Ray's per-node resources, checked and stored for the API (`service.dispatch.cluster_reads`)."""
        return self.cluster_reads.read(store=store)

    # ---- admission ------------------------------------------------------------------------------------------
    def admit(self, cluster: ClusterView) -> list[str]:
        """One admission pass (`admission`); then the preemption notices and the new attempts' submissions."""
        attempts: dict[str, Attempt] = {}
        started, victims = self._admit(
            self.engine, self.settings, cluster, owner=self.owner, spec_of=self.spec_of, resources_of=self.resources_of,
            attempts=attempts, scaling=self.scaling,
        )  # fmt: skip
        self._may_hold = self._may_hold or bool(started)
        self.scaling.send(started)  # the autoscaler's request, when it changed (outside the pass's transaction)
        for victim in victims:
            self.host.run(victim, "preemption notice", self.host.write_notice, victim)
        # Submit at once rather than on the next tick, overlapped; the accepted submissions recorded in one go.
        news = [(job, attempts[job.id]) for job in started]
        adopted = self._pool.map(lambda new: self.faults.safely(new[0], self._submission, *new), news)
        self.finishing.mark_submitted_many([(j, a, was) for (j, a), was in zip(news, adopted, strict=True)
                                            if was is not None])  # fmt: skip
        return [job.id for job in started]

    # ---- reconciliation -------------------------------------------------------------------------------------
    def _reconcile_safely(self, job: Job) -> None:
        self.faults.safely(job, self.reconcile, job)

    def reconcile(self, job: Job) -> None:
        """Bring one held job in line with its Ray Job: gather the facts, decide, act."""
        with Session(self.engine, expire_on_commit=False) as session:
            fresh = session.get(Job, job.id)
            if fresh is None or fresh.lease_owner != self.owner:
                return
            attempt = session.exec(
                select(Attempt).where(Attempt.job_id == job.id, Attempt.number == fresh.attempt)
            ).first()
        ending = self._reconcile_held(fresh, attempt)
        if ending is not None:
            self.finishing.write_ending(ending)

    def _reconcile_held(self, fresh: Job, attempt: Attempt | None) -> Ending | None:
        """`reconcile` of a job read with its attempt just now; an attempt to end alone is returned, not written."""
        if attempt is None:
            self.faults.abandon(fresh, f"attempt {fresh.attempt} has no record")
            return None
        checkpointed = False
        if fresh.preempt_requested_at is not None:
            with Session(self.engine) as session:
                checkpointed = session.exec(
                    select(Checkpoint.id).where(Checkpoint.job_id == fresh.id, Checkpoint.complete,
                                                col(Checkpoint.created_at) > fresh.preempt_requested_at)
                ).first() is not None  # fmt: skip
        spec, spec_error = self.spec_of(fresh)
        facts = JobFacts(
            state=JobState(fresh.state), step=fresh.step, preempt_requested_at=fresh.preempt_requested_at,
            timeout_seconds=spec.timeout_seconds if spec else None, checkpointed_since_preempt=checkpointed,
            spec_error=spec_error, script=bool(spec and spec.entrypoint.script),
            num_workers=spec.resources.workers(fresh.world_size) if spec else 1,
            stall=self.stalls.facts(fresh, attempt, spec),
        )  # fmt: skip
        attempt_facts = AttemptFacts(attempt.submitted, attempt.started_at, attempt.end_reason,
                                     driver_ended=attempt.driver_ended_at is not None)  # fmt: skip
        info = self.ray.info(attempt.submission_id)
        actions = decide(
            facts, attempt_facts, info, now=utcnow(), patience=self.patience, dead_nodes=self.cluster_reads.dead_nodes
        )
        alone = batched_finish(actions)
        if alone is not None:
            return self.finishing.prepare(fresh, attempt, alone)
        for action in actions:
            self.execute(fresh, attempt, action)
        return None

    def execute(self, job: Job, attempt: Attempt, action: Action) -> None:
        if isinstance(action, Submit):
            self._submit(job, attempt)
        elif isinstance(action, MarkSubmitted):
            self.finishing.mark_submitted(job, attempt, adopted=action.adopted)
        elif isinstance(action, MarkRunning):
            with session_scope(self.engine) as session:
                transition(session, job, to=JobState.RUNNING, reason="first_report", lease_token=job.lease_token,
                           actor=self.owner, message=action.message)  # fmt: skip
        elif isinstance(action, Stop):
            if action.record is not None:
                self.finishing.mark_attempt(attempt, action.record, action.message)
            self._send_stop(attempt.submission_id)
        elif isinstance(action, Finish):
            self.finishing.finish(job, attempt, action)
        elif isinstance(action, DumpStacks):
            self.stalls.dump(job, attempt, action)

    def _submit(self, job: Job, attempt: Attempt) -> None:
        adopted = self._submission(job, attempt)
        if adopted is not None:
            self.finishing.mark_submitted(job, attempt, adopted=adopted)

    def _submission(self, job: Job, attempt: Attempt) -> bool | None:
        """Submit the attempt to Ray: whether an existing one was adopted, or None when Ray did not take it (tried
        again next tick) or the job's own input could not be submitted (then it has ended, a user error)."""
        spec, error = self.spec_of(job)
        try:
            if spec is None:
                raise InvalidSpec(error or "spec: does not validate", field="spec")
            with Session(self.engine) as session:
                sub = submission.build(session, job, spec, self.settings, attempt=attempt)
        except (InvalidSpec, ValueError, TypeError, KeyError) as exc:  # the job's own input: end it, say which field
            detail = exc.detail if isinstance(exc, InvalidSpec) else f"{type(exc).__name__}: {exc}"
            from service.tenancy.code_proof import ArchiveTampered

            tampered = isinstance(exc, ArchiveTampered)  # a stored archive not its upload's bytes: never run
            self.finishing.finish(job, attempt, Finish(EndReason.STORAGE_TAMPERED if tampered else EndReason.USER_ERROR,
                                                       detail))  # fmt: skip
            return None
        try:
            submitted_now = self.ray.submit(
                submission_id=attempt.submission_id, entrypoint=sub.entrypoint, runtime_env=sub.runtime_env,
                metadata=sub.metadata,
            )  # fmt: skip
        except InfraError as exc:
            # Often passing ("No available agent to submit job" just after a head starts): tried again next tick;
            # `decide` ends the attempt once the submission patience has run out.
            log.warning("job %s: submission not accepted yet: %s", job.id, exc.detail)
            return None
        return not submitted_now

    def _send_stop(self, sub_id: str) -> None:
        last = self._stop_sent.get(sub_id, 0.0)
        if time.monotonic() - last >= STOP_RESEND_SECONDS:
            self.ray.stop(sub_id)
            self._stop_sent[sub_id] = time.monotonic()
