"""The dispatcher loop: the only code that acts on Ray.

Each tick: renew leases (and adopt jobs whose dispatcher died), record the cluster's resources, reconcile every job
it holds with its Ray Job (submit, watch, stop, finish), then admit queued jobs whose whole worker group fits.
Database writes are short transactions; Ray calls happen between them, never inside one.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service import leases, queues, retry, scheduler
from service.db import session_scope
from service.errors import InfraError, InvalidSpec, StaleWrite
from service.metrics import DISPATCHER_TICK_SECONDS
from service.models import Attempt, Checkpoint, ClusterSnapshot, EndReason, EventKind, Job, JobState, utcnow
from service.ray_jobs import ClusterView, RayJobInfo, RayJobs
from service.settings import Settings
from service.spec import JobSpec
from service.state import end_reason_state, record_event, transition
from service.storage import filesystem_for

log = logging.getLogger(__name__)
STOP_RESEND_SECONDS = 5.0
SUBMIT_PATIENCE_SECONDS = 120.0
PREEMPT_MARKER = "shunter-preempt"  # workers.preemption.MARKER


def submission_id(job_id: str, attempt: int) -> str:
    return f"shunter-{job_id}-{attempt}"


class Dispatcher:
    def __init__(self, *, engine: Engine, settings: Settings, ray: RayJobs, owner: str) -> None:
        self.engine = engine
        self.settings = settings
        self.ray = ray
        self.owner = owner
        self._started = False
        self._stop_sent: dict[str, float] = {}
        self._totals: dict[str, dict[str, float]] = {}
        self._pool = ThreadPoolExecutor(max_workers=settings.dispatcher_threads, thread_name_prefix="reconcile")
        self.last_tick_seconds = 0.0

    # ---- the loop -------------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - one bad tick (a DB or Ray hiccup) must not end the loop
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
        cluster = self._snapshot_cluster()
        with Session(self.engine, expire_on_commit=False) as session:
            mine = leases.owned(session, owner=self.owner)
        # Reconciling is mostly waiting (Ray's HTTP API, the database): overlap it across the jobs held.
        list(self._pool.map(self._reconcile_safely, mine))
        if cluster is not None:
            self.admit(cluster)
        self.last_tick_seconds = time.monotonic() - started
        DISPATCHER_TICK_SECONDS.observe(self.last_tick_seconds)

    def _reconcile_safely(self, job: Job) -> None:
        try:
            self.reconcile(job)
        except StaleWrite as exc:
            log.info("job %s moved on under us: %s", job.id, exc)
        except InfraError as exc:
            log.warning("job %s: Ray unavailable this tick: %s", job.id, exc)
        except Exception:  # noqa: BLE001 - one job's surprise must not stop the others
            log.exception("job %s: reconcile failed", job.id)

    def _resources(self, job: Job) -> dict[str, float]:
        """The job's total resources; specs never change, so parse each once."""
        total = self._totals.get(job.id)
        if total is None:
            total = self._totals[job.id] = JobSpec.model_validate(job.spec).resources.total()
        return total

    # ---- cluster view ---------------------------------------------------------------------------------------
    def _snapshot_cluster(self) -> ClusterView | None:
        try:
            cluster = self.ray.cluster()
        except InfraError as exc:
            log.warning("cannot read Ray cluster resources: %s", exc)
            return None
        nodes = [
            {"node_id": n.node_id, "address": n.address, "alive": n.alive, "total": n.total, "available": n.available}
            for n in cluster.nodes
        ]
        with session_scope(self.engine) as session:
            snap = session.get(ClusterSnapshot, 1) or ClusterSnapshot(id=1)
            snap.dashboard_url = self.ray.dashboard_url
            snap.nodes = nodes
            snap.total = cluster.total
            snap.available = cluster.available
            snap.taken_at = utcnow()
            session.add(snap)
        return cluster

    # ---- admission ------------------------------------------------------------------------------------------
    def admit(self, cluster: ClusterView) -> list[str]:
        """Start every queued job whose whole worker group fits, in priority/FIFO order, within queue limits.

        The whole decision is one write transaction under an admission lock, so several dispatchers never hand out
        the same free room twice. Ray submissions happen after the commit.
        """
        now = utcnow()
        started: list[Job] = []
        with session_scope(self.engine) as session:
            leases.lock_admission(session)
            waiting = leases.queued(session, now=now, limit=self.settings.admit_batch)
            if not waiting:
                return []
            nodes = [scheduler.NodeFree(n.node_id, dict(n.available)) for n in cluster.nodes if n.alive]
            # Jobs admitted but not yet placed by Ray still count against the free room Ray reports.
            for job in session.exec(select(Job).where(Job.state == JobState.STARTING)).all():
                _reserve(nodes, self._resources(job))
            decision = scheduler.plan(
                [_candidate(job) for job in waiting],
                nodes,
                limits=queues.limits(session, self.settings),
                usage=queues.usage(session, self._resources),
                now=now.timestamp(),
                reserve_after_seconds=self.settings.reserve_after_seconds,
            )
            by_id = {job.id: job for job in waiting}
            for job_id in decision.admit:
                job = by_id[job_id]
                number = job.attempt + 1
                values: dict[str, Any] = {"attempt": number, "step": None, "latest_metrics": None, "progress_at": None}
                values.update(leases.lease_values(self.owner, now, self.settings.lease_seconds))
                transition(
                    session, job, to=JobState.STARTING, reason="admitted", actor=self.owner, values=values, now=now
                )
                sub_id = submission_id(job.id, number)
                session.add(Attempt(job_id=job.id, number=number, submission_id=sub_id, started_at=now))
                started.append(job)
            for job_id, why in decision.waiting.items():
                if by_id[job_id].state_reason != why:
                    leases.set_reason(session, job_id, why)
            self._maybe_preempt(session, waiting, decision, cluster, now=now)
        for job in started:
            self.reconcile(job)  # submit at once rather than on the next tick
        return [job.id for job in started]

    # ---- preemption -----------------------------------------------------------------------------------------
    def _maybe_preempt(
        self, session: Session, waiting: list[Job], decision: scheduler.Plan, cluster: ClusterView, *, now: datetime
    ) -> None:
        """Ask lower-priority running jobs to yield to the first queued job that waits for room, if its queue allows.

        Victims are chosen lowest priority first, newest first, until the freed room could hold the waiting job; one
        preemption at a time (nothing new is asked while an earlier one is in flight).
        """
        limits = queues.limits(session, self.settings)
        blocked = next(
            (j for j in sorted(waiting, key=lambda j: (-j.priority, j.created_at))
             if j.id in decision.waiting and decision.waiting[j.id].startswith("waiting for room")),
            None,
        )  # fmt: skip
        if blocked is None or not limits.get(blocked.queue, scheduler.QueueLimit()).preemption:
            return
        active = session.exec(select(Job).where(col(Job.state).in_([JobState.RUNNING, JobState.STARTING]))).all()
        if any(j.preempt_requested_at is not None for j in active):
            return
        need = JobSpec.model_validate(blocked.spec).resources.total()
        free = dict(cluster.available)
        victims = []
        for job in sorted(
            (j for j in active if j.priority < blocked.priority), key=lambda j: (j.priority, -j.created_at.timestamp())
        ):
            if all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items()):
                break
            victims.append(job)
            for k, v in JobSpec.model_validate(job.spec).resources.total().items():
                free[k] = free.get(k, 0.0) + v
        if not victims or not all(free.get(k, 0.0) + 1e-9 >= v for k, v in need.items()):
            return
        for victim in victims:
            session.execute(update(Job).where(Job.id == victim.id).values(preempt_requested_at=now))
            record_event(session, victim.id, kind=EventKind.PREEMPTION, reason="preemption_requested", actor=self.owner, attempt=victim.attempt,
                         message=f"making room for {blocked.id} (priority {blocked.priority})")  # fmt: skip
            self._write_preempt_marker(victim)

    def _preemption_due(self, job: Job) -> bool:
        """Stop a preempted job once it has checkpointed since the request, or after the grace period."""
        asked = job.preempt_requested_at
        assert asked is not None
        if (utcnow() - asked).total_seconds() >= self.settings.preemption_grace_seconds:
            return True
        with Session(self.engine) as session:
            newer = session.exec(
                select(Checkpoint).where(
                    Checkpoint.job_id == job.id, Checkpoint.complete, Checkpoint.created_at > asked
                )
            ).first()
        return newer is not None

    def _marker(self, job: Job) -> tuple[str, Any]:
        """Where the job's workers look for a preemption notice (see workers.preemption): beside its checkpoints."""
        spec = JobSpec.model_validate(job.spec)
        root, fs = filesystem_for(spec.checkpoint.storage or self.settings.absolute_storage_uri())
        return f"{root.rstrip('/')}/{job.id}/{PREEMPT_MARKER}", fs

    def _write_preempt_marker(self, job: Job) -> None:
        path, fs = self._marker(job)
        try:
            if fs is None:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).write_text(utcnow().isoformat())
            else:
                with fs.open_output_stream(path) as out:
                    out.write(utcnow().isoformat().encode())
        except OSError as exc:  # without the notice the job is stopped after the grace period instead
            log.warning("job %s: could not write the preemption notice: %s", job.id, exc)

    def _clear_preempt_marker(self, job: Job) -> None:
        path, fs = self._marker(job)
        try:
            if fs is None:
                Path(path).unlink(missing_ok=True)
            else:
                fs.delete_file(path)
        except OSError:
            pass

    # ---- reconciliation -------------------------------------------------------------------------------------
    def reconcile(self, job: Job) -> None:
        """Bring one held job in line with its Ray Job."""
        with Session(self.engine, expire_on_commit=False) as session:
            fresh = session.get(Job, job.id)
            attempt = session.exec(
                select(Attempt).where(Attempt.job_id == job.id, Attempt.number == job.attempt)
            ).first()
        if fresh is None or fresh.lease_owner != self.owner or attempt is None:
            return
        job = fresh
        state = JobState(job.state)
        info = self.ray.info(attempt.submission_id)

        if info is None:
            if state is JobState.CANCELLING:
                self._finish(job, attempt, EndReason.CANCELLED, "cancelled before Ray started it", None)
            elif not attempt.submitted:
                self._submit(job, attempt)
            else:
                self._finish(job, attempt, EndReason.INFRA, "Ray no longer knows this job (cluster restarted?)", None)
            return
        if not attempt.submitted:
            self._mark_submitted(job, attempt, adopted=True)
        if info.is_terminal:
            self._finish(job, attempt, self._classify(job, attempt, info), info.message or info.status, info)
            return
        if state is JobState.CANCELLING:
            self._send_stop(attempt.submission_id)
            return
        if job.preempt_requested_at is not None and self._preemption_due(job):
            self._mark_attempt(attempt, EndReason.PREEMPTED, "stopped to make room for a higher-priority job")
            self._send_stop(attempt.submission_id)
            return
        if self._timed_out(job, attempt):
            self._mark_attempt(
                attempt, EndReason.TIMEOUT, f"ran past timeout_seconds={job.spec.get('timeout_seconds')}"
            )
            self._send_stop(attempt.submission_id)
            return
        if state is JobState.STARTING and job.step is not None:
            with session_scope(self.engine) as session:
                transition(session, job, to=JobState.RUNNING, reason="first_report", lease_token=job.lease_token,
                           actor=self.owner, message=f"workers placed; first report at step {job.step}")  # fmt: skip

    def _submit(self, job: Job, attempt: Attempt) -> None:
        try:
            entrypoint, runtime_env, metadata = self.build_submission(job)
        except InvalidSpec as exc:
            self._finish(job, attempt, EndReason.USER_ERROR, exc.detail, None)
            return
        try:
            submitted_now = self.ray.submit(
                submission_id=attempt.submission_id, entrypoint=entrypoint, runtime_env=runtime_env, metadata=metadata
            )
        except InfraError as exc:
            # Often passing ("No available agent to submit job" just after a head starts): try again next tick,
            # and give up on this attempt only after SUBMIT_PATIENCE_SECONDS.
            waited = (utcnow() - attempt.started_at).total_seconds()
            if waited < SUBMIT_PATIENCE_SECONDS:
                log.warning("job %s: submission not accepted yet (%.0fs): %s", job.id, waited, exc.detail)
                return
            self._finish(job, attempt, EndReason.INFRA, f"Ray refused the submission: {exc.detail}", None)
            return
        self._mark_submitted(job, attempt, adopted=not submitted_now)

    def _mark_submitted(self, job: Job, attempt: Attempt, *, adopted: bool) -> None:
        with session_scope(self.engine) as session:
            row = session.get(Attempt, attempt.id)
            if row is None or row.submitted:
                return
            row.submitted = True
            session.add(row)
            record_event(
                session,
                job.id,
                attempt=job.attempt,
                kind=EventKind.RAY,
                reason="ray_job_adopted" if adopted else "ray_job_submitted",
                message=attempt.submission_id,
                actor=self.owner,
            )
        attempt.submitted = True

    def build_submission(self, job: Job) -> tuple[str, dict[str, Any], dict[str, str]]:
        """The Ray Job for one attempt: `python -m workers.driver`, the spec and where to report in its env."""
        spec = JobSpec.model_validate(job.spec)
        runtime_env = json.loads(json.dumps(spec.runtime_env))
        env_vars: dict[str, str] = dict(runtime_env.get("env_vars", {}))
        for name, value in self.settings.job_env.items():
            env_vars.setdefault(name, str(value))
        cpus = spec.resources.per_worker().get("CPU", 1.0)
        # torchrun sets OMP_NUM_THREADS; Ray workers do not, and oversubscribed OpenMP threads slow steps a lot.
        env_vars.setdefault("OMP_NUM_THREADS", str(max(1, int(cpus))))
        env_vars.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(self.settings.train_poll_seconds))
        # Object-store settings the service was given reach the job too (the spec's env_vars win).
        for name, value in forwarded_environment().items():
            env_vars.setdefault(name, value)
        env_vars.update(
            {
                "SHUNTER_JOB_SPEC": spec.model_dump_json(),
                "SHUNTER_JOB_ID": job.id,
                "SHUNTER_ATTEMPT": str(job.attempt),
                "SHUNTER_PROGRESS_DATABASE_URL": self.settings.absolute_database_url(),
                "SHUNTER_JOB_STORAGE": spec.checkpoint.storage or self.settings.absolute_storage_uri(),
            }
        )
        resume = self._resume_uri(job, spec)
        if resume:
            env_vars["SHUNTER_RESUME_FROM"] = resume
        runtime_env["env_vars"] = env_vars
        metadata = {"shunter_job_id": job.id, "shunter_attempt": str(job.attempt), "name": job.name}
        return "python -m workers.driver", runtime_env, metadata

    def _resume_uri(self, job: Job, spec: JobSpec) -> str | None:
        """An explicit `checkpoint.resume_from: <id>` names one of the job's complete checkpoints."""
        wanted = spec.checkpoint.resume_from
        if not wanted.isdigit():
            return None
        with Session(self.engine) as session:
            row = session.get(Checkpoint, int(wanted))
        if row is None or row.job_id != job.id or not row.complete:
            raise InvalidSpec(f"checkpoint.resume_from: job {job.id} has no complete checkpoint {wanted}")
        return row.uri

    def _send_stop(self, sub_id: str) -> None:
        last = self._stop_sent.get(sub_id, 0.0)
        if time.monotonic() - last >= STOP_RESEND_SECONDS:
            self.ray.stop(sub_id)
            self._stop_sent[sub_id] = time.monotonic()

    def _timed_out(self, job: Job, attempt: Attempt) -> bool:
        """`timeout_seconds` bounds each attempt's run, counted from its admission."""
        limit = job.spec.get("timeout_seconds")
        return bool(limit and utcnow() - attempt.started_at > timedelta(seconds=float(limit)))

    def _classify(self, job: Job, attempt: Attempt, info: RayJobInfo) -> EndReason:
        """Why the attempt ended: the driver's own record first, then what Ray says."""
        with Session(self.engine) as session:
            row = session.get(Attempt, attempt.id)
            recorded = row.end_reason if row is not None else None
        if info.status == "SUCCEEDED":
            return EndReason.SUCCEEDED
        if recorded is not None:
            return EndReason(recorded)
        if info.status == "STOPPED":
            return EndReason.CANCELLED if JobState(job.state) is JobState.CANCELLING else EndReason.INFRA
        if info.error_type and "RUNTIME_ENV" in info.error_type.upper():
            return EndReason.USER_ERROR  # a runtime_env the user asked for (pip, working_dir) could not be built
        return EndReason.INFRA  # the driver died without saying why: its node or process was lost

    def _mark_attempt(self, attempt: Attempt, reason: EndReason, message: str) -> None:
        with session_scope(self.engine) as session:
            row = session.get(Attempt, attempt.id)
            if row is not None and row.end_reason is None:
                row.end_reason = reason
                row.message = message
                session.add(row)

    def _finish(self, job: Job, attempt: Attempt, reason: EndReason, message: str, info: RayJobInfo | None) -> None:
        """Close the attempt; then end the job, or queue the next attempt if the retry policy says so."""
        log_uri = self._keep_logs(job, attempt) if info is not None else None
        spec = JobSpec.model_validate(job.spec)
        state = JobState(job.state)
        if state is JobState.CANCELLING and reason is not EndReason.SUCCEEDED:
            reason = EndReason.CANCELLED
        decision = retry.decide(
            reason=reason,
            attempt=job.attempt,
            max_attempts=spec.retries.max_attempts,
            backoff_seconds=spec.retries.backoff_seconds,
            max_backoff_seconds=spec.retries.max_backoff_seconds,
            retry_on_timeout=spec.retries.retry_on_timeout,
            preemptions=job.preemptions,
        )
        now = utcnow()
        with session_scope(self.engine) as session:
            row = session.get(Attempt, attempt.id)
            if row is not None:
                row.ended_at = now
                row.end_reason = reason
                row.ray_status = info.status if info else None
                row.message = row.message or message
                row.log_uri = log_uri
                session.add(row)
            if decision.retry:
                record_event(session, job.id, kind=EventKind.RETRY, reason="retry_decided", message=decision.why, actor=self.owner, attempt=job.attempt)
                retry_at = now + timedelta(seconds=decision.delay_seconds)
                values = {"not_before": retry_at, "last_error": message[-4000:], "preempt_requested_at": None}
                if reason is EndReason.PREEMPTED:
                    values.update(preemptions=job.preemptions + 1, last_error=None)
                    message = "preempted for a higher-priority job"
                transition(session, job, to=JobState.QUEUED, reason=reason.value, lease_token=job.lease_token,
                           actor=self.owner, message=f"{message[-500:]}; retrying in {decision.delay_seconds:.0f}s",
                           values=values)  # fmt: skip
                self._clear_preempt_marker(job)
            else:
                values = {"end_reason": reason}
                if reason is not EndReason.SUCCEEDED:
                    values["last_error"] = message[-4000:]
                transition(session, job, to=end_reason_state(reason), reason=reason.value, lease_token=job.lease_token,
                           actor=self.owner, message=message[-1000:], values=values)  # fmt: skip
        self._stop_sent.pop(attempt.submission_id, None)

    def _keep_logs(self, job: Job, attempt: Attempt) -> str | None:
        """Copy the attempt's driver log out of Ray, so it stays readable after the cluster is gone."""
        try:
            text = self.ray.logs(attempt.submission_id)
        except InfraError:
            return None
        if text is None:
            return None
        path = Path(self.settings.data_dir).resolve() / "logs" / job.id / f"attempt-{attempt.number}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return str(path)


# Where the object store is, for jobs of a service that was told. Credentials are not forwarded: a Ray Job's
# runtime_env is shown in the dashboard; give the cluster its own (instance roles, its environment).
FORWARDED_ENV = ("SHUNTER_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION")


def forwarded_environment() -> dict[str, str]:
    return {name: os.environ[name] for name in FORWARDED_ENV if os.environ.get(name)}


def _candidate(job: Job) -> scheduler.Candidate:
    spec = JobSpec.model_validate(job.spec)
    return scheduler.Candidate(
        job_id=job.id,
        priority=job.priority,
        seq=job.created_at.timestamp(),
        num_workers=spec.resources.num_workers,
        per_worker=spec.resources.per_worker(),
        placement=spec.resources.placement.value,
        queue=job.queue,
    )


def _reserve(nodes: list[scheduler.NodeFree], need: dict[str, float]) -> None:
    """Take `need` off the free room, from the roomiest nodes first (we do not know where Ray will place it)."""
    for key, amount in need.items():
        remaining = amount
        for node in sorted(nodes, key=lambda n: -n.free.get(key, 0.0)):
            take = min(remaining, max(node.free.get(key, 0.0), 0.0))
            node.free[key] = node.free.get(key, 0.0) - take
            remaining -= take
            if remaining <= 0:
                break
