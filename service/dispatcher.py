"""The dispatcher loop: the only code that acts on Ray.

Each tick: renew leases (and adopt jobs whose dispatcher died), read the cluster's resources, reconcile every job it
holds, then admit queued jobs whose whole worker group fits. What to do with a job is decided by the pure
`service.reconcile.decide` (and admission by `service.scheduler`); this module gathers the facts and carries out the
actions. Database writes are short transactions; Ray calls happen between them, never inside one.

One job's fault stays that job's: input of its own that cannot be used (a spec that no longer validates, a resume
id that names nothing) ends it as a user error; a fault of shunter's host while handling it (keeping its log,
writing a preemption notice) is recorded as an event and got past; anything else unexpected is retried on later ticks
and, past `job_fault_patience_seconds`, ends that job. None of it stops the pass for the other jobs.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlmodel import Session, col, select

from service import admission, leases, progress, retry, submission
from service.backend import Backend, ClusterView, checked, submission_id
from service.db import JOB_DATA_ERRORS, session_scope
from service.errors import InfraError, InvalidSpec, StaleWrite
from service.host_files import HostFault, HostFiles
from service.metrics import DISPATCHER_TICK_SECONDS
from service.models import Attempt, Checkpoint, ClusterSnapshot, EndReason, EventKind, Job, JobState, utcnow
from service.nodes import NodeHistory
from service.reconcile import (
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
from service.settings import Settings
from service.spec import JobSpec, Retries
from service.stall_watch import StallWatch
from service.state import end_reason_state, record_event, transition

log = logging.getLogger(__name__)
STOP_RESEND_SECONDS = 5.0


class Dispatcher:
    def __init__(
        self, *, engine: Engine, settings: Settings, ray: Backend, owner: str, files: HostFiles | None = None
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.ray = ray
        self.owner = owner
        self.files = files or HostFiles(settings.data_dir)
        self.patience = Patience(submit_seconds=settings.submit_patience_seconds,
                                 preemption_grace_seconds=settings.preemption_grace_seconds)  # fmt: skip
        self.stalls = StallWatch(engine=engine, settings=settings, ray=ray, owner=owner)  # hang detection
        self._started = False
        self._stop_sent: dict[str, float] = {}
        self._specs: dict[str, tuple[JobSpec | None, str | None]] = {}
        self._faults: dict[str, float] = {}  # job id -> when its reconcile first failed unexpectedly (monotonic)
        self._pool = ThreadPoolExecutor(max_workers=settings.dispatcher_threads, thread_name_prefix="reconcile")
        self.last_tick_seconds = 0.0
        self._dead_nodes: dict[str, bool] = {}  # from the last cluster read (service.reconcile.decide)
        self.nodes = NodeHistory()  # which nodes went draining or dead, and when (bears out node_draining ends)

    # ---- the loop -------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - a tick without a database does nothing; the next one tries again
                    log.exception("dispatcher tick failed")
                stop.wait(self.settings.dispatcher_tick_seconds)
        finally:
            self._pool.shutdown(wait=True)

    def tick(self) -> None:
        started = time.monotonic()
        now = utcnow()
        with session_scope(self.engine) as session:
            leases.heartbeat(session, owner=self.owner, now=now, seconds=self.settings.lease_seconds)
            leases.take_over(
                session, owner=self.owner, now=now, seconds=self.settings.lease_seconds, include_own=not self._started
            )
        self._started = True
        cluster = self.read_cluster()  # None when Ray cannot be read: what we hold is reconciled all the same
        with Session(self.engine, expire_on_commit=False) as session:
            mine = leases.owned(session, owner=self.owner)
        # Reconciling is mostly waiting (Ray's HTTP API, the database): overlap it across the jobs held.
        list(self._pool.map(self._reconcile_safely, mine))
        if cluster is not None:
            self.admit(cluster)
        self.last_tick_seconds = time.monotonic() - started
        DISPATCHER_TICK_SECONDS.observe(self.last_tick_seconds)

    # ---- facts about one job --------------------------------------------------------------------------------
    def spec_of(self, job: Job) -> tuple[JobSpec | None, str | None]:
        """The job's stored spec, or why it no longer validates. Specs never change, so each is parsed once."""
        known = self._specs.get(job.id)
        if known is None:
            try:
                known = (JobSpec.model_validate(job.spec), None)
            except Exception as exc:  # noqa: BLE001 - a row of any shape must end only its own job
                known = (None, f"spec: the stored job spec does not validate: {str(exc)[:1500]}")
            if len(self._specs) > 50_000:
                self._specs.clear()
            self._specs[job.id] = known
        return known

    def resources_of(self, job: Job) -> dict[str, float]:
        """What an admitted job holds: its group at the size it was admitted at."""
        spec, _ = self.spec_of(job)
        return spec.resources.total(job.world_size) if spec is not None else {}

    # ---- cluster view ---------------------------------------------------------------------------------------
    def read_cluster(self) -> ClusterView | None:
        """Ray's per-node resources, checked for shape, and stored for the API; None if Ray cannot be read."""
        try:
            cluster = checked(self.ray.cluster())
        except Exception as exc:  # noqa: BLE001 - unreachable, or an answer of the wrong shape: skip admission
            log.warning("cannot read Ray cluster resources: %s", exc)
            return None
        self._dead_nodes = dict(cluster.dead_nodes)
        self.nodes.observe(cluster, utcnow())
        for first in (True, False):
            try:
                self._store_snapshot(cluster)
                break
            except IntegrityError as exc:  # another dispatcher stored the first one meanwhile: now it is an update
                if not first:
                    log.warning("cannot store the cluster snapshot: %s", exc)
            except SQLAlchemyError as exc:
                log.warning("cannot store the cluster snapshot: %s", exc)
                break
        return cluster

    def _store_snapshot(self, cluster: ClusterView) -> None:
        with session_scope(self.engine) as session:
            snap = session.get(ClusterSnapshot, 1) or ClusterSnapshot(id=1)
            snap.dashboard_url = self.ray.dashboard_url
            snap.nodes = [{"node_id": n.node_id, "address": n.address, "alive": n.alive, "total": n.total,
                           "available": n.available} for n in cluster.nodes]  # fmt: skip
            snap.total, snap.available, snap.taken_at = cluster.total, cluster.available, utcnow()
            session.add(snap)

    # ---- admission ------------------------------------------------------------------------------------------
    def admit(self, cluster: ClusterView) -> list[str]:
        """One admission pass (service.admission); then the preemption notices and the new attempts' submissions."""
        started, victims = admission.admit(
            self.engine, self.settings, cluster, owner=self.owner, spec_of=self.spec_of, resources_of=self.resources_of
        )
        for victim in victims:
            self._host_effect(victim, "preemption notice", self._write_notice, victim)
        # Submit at once rather than on the next tick, overlapped like every other reconcile.
        list(self._pool.map(self._reconcile_safely, started))
        return [job.id for job in started]

    # ---- reconciliation -------------------------------------------------------------------------------------
    def _reconcile_safely(self, job: Job) -> None:
        try:
            self.reconcile(job)
            self._faults.pop(job.id, None)
        except StaleWrite as exc:
            log.info("job %s moved on under us: %s", job.id, exc)
        except (InfraError, SQLAlchemyError) as exc:
            if isinstance(exc, JOB_DATA_ERRORS):
                self._job_fault(job, exc)  # the database refuses this job's values, and will on every tick
            else:  # Ray or the database is away, or its schema is another release's: nobody's job is at fault
                log.warning("job %s: not reconciled this tick: %s", job.id, exc)
        except Exception as exc:  # noqa: BLE001 - one job's surprise must not stop the others, nor wedge this one
            self._job_fault(job, exc)

    def _job_fault(self, job: Job, exc: Exception) -> None:
        """A failure of this job's own: retried each tick, and the job given up on once it has lasted
        `job_fault_patience_seconds`."""
        log.exception("job %s: reconcile failed", job.id)
        first = self._faults.setdefault(job.id, time.monotonic())
        if time.monotonic() - first >= self.settings.job_fault_patience_seconds:
            patience = self.settings.job_fault_patience_seconds
            try:
                self._abandon(job, f"shunter could not handle this job for {patience:g}s: {type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001 - giving up failed too: try again next tick, never abort the others
                log.exception("job %s: could not give up on it", job.id)

    def reconcile(self, job: Job) -> None:
        """Bring one held job in line with its Ray Job: gather the facts, decide, act."""
        with Session(self.engine, expire_on_commit=False) as session:
            fresh = session.get(Job, job.id)
            if fresh is None or fresh.lease_owner != self.owner:
                return
            attempt = session.exec(
                select(Attempt).where(Attempt.job_id == job.id, Attempt.number == fresh.attempt)
            ).first()
            checkpointed = fresh.preempt_requested_at is not None and session.exec(
                select(Checkpoint.id).where(Checkpoint.job_id == job.id, Checkpoint.complete,
                                            col(Checkpoint.created_at) > fresh.preempt_requested_at)
            ).first() is not None  # fmt: skip
        if attempt is None:
            self._abandon(fresh, f"attempt {fresh.attempt} has no record")
            return
        spec, spec_error = self.spec_of(fresh)
        facts = JobFacts(
            state=JobState(fresh.state), step=fresh.step, preempt_requested_at=fresh.preempt_requested_at,
            timeout_seconds=spec.timeout_seconds if spec else None, checkpointed_since_preempt=checkpointed,
            spec_error=spec_error, script=bool(spec and spec.entrypoint.script),
            num_workers=spec.resources.workers(job.world_size) if spec else 1,
            stall=self.stalls.facts(fresh, attempt, spec),
        )  # fmt: skip
        attempt_facts = AttemptFacts(attempt.submitted, attempt.started_at, attempt.end_reason)
        info = self.ray.info(attempt.submission_id)
        dead = self._dead_nodes
        for action in decide(facts, attempt_facts, info, now=utcnow(), patience=self.patience, dead_nodes=dead):
            self.execute(fresh, attempt, action)

    def execute(self, job: Job, attempt: Attempt, action: Action) -> None:
        if isinstance(action, Submit):
            self._submit(job, attempt)
        elif isinstance(action, MarkSubmitted):
            self._mark_submitted(job, attempt, adopted=action.adopted)
        elif isinstance(action, MarkRunning):
            with session_scope(self.engine) as session:
                transition(session, job, to=JobState.RUNNING, reason="first_report", lease_token=job.lease_token,
                           actor=self.owner, message=action.message)  # fmt: skip
        elif isinstance(action, Stop):
            if action.record is not None:
                self._mark_attempt(attempt, action.record, action.message)
            self._send_stop(attempt.submission_id)
        elif isinstance(action, Finish):
            self._finish(job, attempt, action)
        elif isinstance(action, DumpStacks):
            self.stalls.dump(job, attempt, action)

    def _submit(self, job: Job, attempt: Attempt) -> None:
        spec, error = self.spec_of(job)
        try:
            if spec is None:
                raise InvalidSpec(error or "spec: does not validate", field="spec")
            with Session(self.engine) as session:
                sub = submission.build(session, job, spec, self.settings)
        except (InvalidSpec, ValueError, TypeError, KeyError) as exc:  # the job's own input: end it, say which field
            detail = exc.detail if isinstance(exc, InvalidSpec) else f"{type(exc).__name__}: {exc}"
            self._finish(job, attempt, Finish(EndReason.USER_ERROR, detail))
            return
        try:
            submitted_now = self.ray.submit(
                submission_id=attempt.submission_id, entrypoint=sub.entrypoint, runtime_env=sub.runtime_env,
                metadata=sub.metadata,
            )  # fmt: skip
        except InfraError as exc:
            # Often passing ("No available agent to submit job" just after a head starts): tried again next tick;
            # `decide` ends the attempt once the submission patience has run out.
            log.warning("job %s: submission not accepted yet: %s", job.id, exc.detail)
            return
        self._mark_submitted(job, attempt, adopted=not submitted_now)

    def _mark_submitted(self, job: Job, attempt: Attempt, *, adopted: bool) -> None:
        with session_scope(self.engine) as session:
            row = session.get(Attempt, attempt.id)
            if row is None or row.submitted:
                return
            row.submitted = True
            session.add(row)
            reason = "ray_job_adopted" if adopted else "ray_job_submitted"
            record_event(session, job.id, kind=EventKind.RAY, reason=reason, message=attempt.submission_id,
                         attempt=attempt.number, actor=self.owner)  # fmt: skip
        attempt.submitted = True

    def _send_stop(self, sub_id: str) -> None:
        last = self._stop_sent.get(sub_id, 0.0)
        if time.monotonic() - last >= STOP_RESEND_SECONDS:
            self.ray.stop(sub_id)
            self._stop_sent[sub_id] = time.monotonic()

    def _mark_attempt(self, attempt: Attempt, reason: EndReason, message: str) -> None:
        with session_scope(self.engine) as session:
            row = session.get(Attempt, attempt.id)
            if row is not None and row.end_reason is None:
                row.end_reason = reason
                row.message = message
                session.add(row)

    def _finish(self, job: Job, attempt: Attempt, action: Finish) -> None:
        """Close the attempt; then end the job, or queue the next attempt if the retry policy says so."""
        reason, message = action.reason, action.message
        if attempt.message and reason in (EndReason.NODE_DRAINING, EndReason.NODE_LOST, EndReason.STALLED):
            message = attempt.message  # the driver's own account (a stall's: the dispatcher's, not Ray's "stopped")
        asked = job.preempt_requested_at is not None
        log_uri = self._host_effect(job, "log", self._keep_log, job, attempt) if action.keep_logs else None
        spec, _ = self.spec_of(job)
        retries = spec.retries if spec is not None else Retries()
        decision = retry.decide(
            reason=reason, attempt=job.attempt, max_attempts=retries.max_attempts,
            backoff_seconds=retries.backoff_seconds, max_backoff_seconds=retries.max_backoff_seconds,
            retry_on_timeout=retries.retry_on_timeout, preemptions=job.preemptions,
            cluster_restarts=job.cluster_restarts, count_cluster_restarts=self.settings.count_cluster_restarts,
            drain_confirmed=self.nodes.confirms(attempt.started_at, message),
            elastic=spec is not None and spec.resources.elastic,
            node_losses=progress.node_losses(self.engine, job.id, attempt.id, reason),
            max_free_node_losses=self.settings.max_free_node_losses,
        )  # fmt: skip
        now = utcnow()
        with session_scope(self.engine) as session:
            row = session.get(Attempt, attempt.id)
            if row is not None:
                row.ended_at, row.end_reason, row.ray_status = now, reason, action.ray_status
                row.message = row.message or message
                row.log_uri = log_uri
                session.add(row)
            if decision.retry:
                resumes = progress.steps_lost(session, job.id)
                if reason is EndReason.NODE_DRAINING:
                    record_event(session, job.id, kind=EventKind.DRAIN, reason="node_draining", attempt=job.attempt,
                                 message=f"{message[-1500:]}; {resumes}", actor=self.owner)  # fmt: skip
                record_event(session, job.id, kind=EventKind.RETRY, reason="retry_decided",
                             message=f"{decision.why}; {resumes}", attempt=job.attempt, actor=self.owner)  # fmt: skip
                values = {"not_before": now + timedelta(seconds=decision.delay_seconds), "last_error": message[-4000:],
                          "preempt_requested_at": None}  # fmt: skip
                if decision.uncounted:  # not failures: preempted, drained, an elastic job shrinking
                    values.update(preemptions=job.preemptions + 1, last_error=None)
                if reason is EndReason.PREEMPTED:
                    message = "yielded as asked (its preemption_requested or grow_requested event says why)"
                elif reason is EndReason.CLUSTER_RESTARTED:
                    values.update(cluster_restarts=job.cluster_restarts + 1)
                transition(session, job, to=JobState.QUEUED, reason=reason.value, lease_token=job.lease_token,
                           actor=self.owner, message=f"{message[-500:]}; retrying in {decision.delay_seconds:.0f}s",
                           values=values)  # fmt: skip
            else:
                values = {"end_reason": reason}
                if reason is not EndReason.SUCCEEDED:
                    values["last_error"] = message[-4000:]
                transition(session, job, to=end_reason_state(reason), reason=reason.value, lease_token=job.lease_token,
                           actor=self.owner, message=message[-1000:], values=values)  # fmt: skip
        self._stop_sent.pop(attempt.submission_id, None)
        if asked:  # read before the transition, which clears the job's preempt_requested_at
            self._host_effect(job, "preemption notice", self._clear_notice, job)

    def _abandon(self, job: Job, message: str) -> None:
        """The last resort for a job shunter cannot handle: stop what Ray runs of it and end it FAILED (infra)."""
        with Session(self.engine) as session:
            fresh = session.get(Job, job.id)
        if fresh is None or fresh.lease_owner != self.owner or JobState(fresh.state).is_terminal:
            return
        try:
            self.ray.stop(submission_id(fresh.id, fresh.attempt))
        except InfraError as exc:
            log.warning("job %s: could not stop its Ray Job while giving up on it: %s", job.id, exc)
        with session_scope(self.engine) as session:
            transition(session, fresh, to=JobState.FAILED, reason=EndReason.INFRA.value, lease_token=fresh.lease_token,
                       actor=self.owner, message=message[-1000:],
                       values={"end_reason": EndReason.INFRA, "last_error": message[-4000:]})  # fmt: skip
        self._faults.pop(job.id, None)

    # ---- shunter's own effects on its host ------------------------------------------------------------------
    def _host_effect(self, job: Job, what: str, effect: Any, *args: Any) -> Any:
        """Run one of shunter's own file effects for `job`; a failure is an event on the job, never its end."""
        try:
            return effect(*args)
        except HostFault as exc:
            log.warning("job %s: %s", job.id, exc)
            try:
                with session_scope(self.engine) as session:
                    record_event(session, job.id, kind=EventKind.HOST, reason=f"{what.replace(' ', '_')}_failed",
                                 message=str(exc)[:2000], attempt=job.attempt, actor=self.owner)  # fmt: skip
            except SQLAlchemyError:
                log.warning("job %s: could not record the host fault either", job.id)
            return None

    def _keep_log(self, job: Job, attempt: Attempt) -> str | None:
        """Copy the attempt's driver log out of Ray, so it stays readable after the cluster is gone."""
        try:
            text = self.ray.logs(attempt.submission_id)
        except InfraError:
            return None
        return None if text is None else self.files.keep_log(job.id, attempt.number, text)

    def _storage_of(self, job: Job) -> str:
        spec, _ = self.spec_of(job)
        if spec is None:
            raise HostFault("the job's spec does not validate: no storage to use")
        return submission.job_storage(spec, self.settings)

    def _write_notice(self, job: Job) -> None:
        self.files.write_preemption_notice(self._storage_of(job), job.id, attempt=job.attempt)

    def _clear_notice(self, job: Job) -> None:
        self.files.clear_preemption_notice(self._storage_of(job), job.id)
