"""Hang detection's part of the dispatcher: the facts `service.policy.reconcile.decide` needs of a running attempt
(`StallFacts`, by `service.policy.stall`'s policy) and the `DumpStacks` action carried out.

Cheap on a pass over many jobs: a job whose attempt has reported within `stall_min_seconds` needs no query (no derived
timeout is shorter), and the derived timeout is computed once per report (cached on the report's time). The report
times it is derived from are the attempt's metric points (at most `WINDOW` + 1 per metric name, by the
`(job_id, name, step)` index) and the report times this dispatcher saw (`Job.progress_at` on each pass, so a loop
that reports no metric but its step is timed too).
"""

from __future__ import annotations

import logging
from collections import deque
from datetime import datetime

from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.config import policies
from service.config.settings import Settings
from service.core.backend import Backend, log_tail
from service.core.errors import InfraError
from service.lifecycle.state import record_event
from service.policy.reconcile import DumpStacks
from service.policy.stall import DUMP_SAID, WINDOW, StallFacts, stacks_submission_id, stall_timeout
from service.spec.job import JobSpec
from service.store.db import session_scope
from service.store.models import Attempt, EventKind, Job, JobEvent, JobState, Metric, utcnow

log = logging.getLogger(__name__)
MAX_NAMES = 5  # metric names asked for the report times: enough to see every report of a loop with a few metrics
MAX_KNOWN = 50_000  # jobs remembered per dispatcher before the memory is dropped (it is only a cache)
DUMP_LOG_TAIL_BYTES = 256 * 1024  # of the stack dump job's log, read for its summary line (its last)


class StallWatch:
    def __init__(self, *, engine: Engine, settings: Settings, ray: Backend, owner: str) -> None:
        self.engine, self.settings, self.ray, self.owner = engine, settings, ray, owner
        self._seen: dict[tuple[str, int], deque[datetime]] = {}  # (job, attempt) -> report times seen, newest last
        self._timeouts: dict[tuple[str, int, datetime], tuple[float, str] | None] = {}
        self._dumps: dict[str, tuple[datetime, str | None]] = {}  # dump job id -> (first seen ended, what it said)

    def facts(self, job: Job, attempt: Attempt, spec: JobSpec | None) -> StallFacts | None:
        """A RUNNING attempt's stall facts once it has reported for real (`latest_metrics` is set by reports only, not
        by "every rank started"); None when it is not watched now."""
        if JobState(job.state) is not JobState.RUNNING or spec is None:
            return None
        if job.latest_metrics is None or job.progress_at is None:
            return None
        self._remember(job, job.progress_at)
        timeout = self._timeout(job, spec, job.progress_at)
        if timeout is None:
            return None
        stalled_at, ended, said, ran = job.stalled_at, None, None, True
        if stalled_at is not None and stalled_at >= job.progress_at:
            ended, said, ran = self._dump_state(stacks_submission_id(attempt.submission_id, stalled_at), stalled_at)
        return StallFacts(progress_at=job.progress_at, stall_after=timeout[0], why=timeout[1], stalled_at=stalled_at,
                          dump_ended_at=ended, dump_said=said, dump_ran=ran)  # fmt: skip

    def dump(self, job: Job, attempt: Attempt, action: DumpStacks) -> None:
        """Note the stall (fenced on the report it was quiet since: a report landing meanwhile cancels it) with a
        STALL event, then ask the backend for every rank's stack. A refusal is an event, not a failure: the attempt
        is stopped as stalled all the same, without its stacks."""
        now = utcnow()
        with session_scope(self.engine) as session:
            changed = session.execute(
                update(Job)
                .where(col(Job.id) == job.id, col(Job.attempt) == job.attempt, col(Job.lease_token) == job.lease_token,
                       col(Job.state) == JobState.RUNNING, col(Job.progress_at) == action.progress_at)
                .values(stalled_at=now)
            ).rowcount  # type: ignore[attr-defined]  # fmt: skip
            if changed != 1:
                return
            record_event(session, job.id, kind=EventKind.STALL, reason="stalled", message=action.message,
                         attempt=job.attempt, actor=self.owner, at=now)  # fmt: skip
        job.stalled_at = now
        try:
            note = self.ray.dump_stacks(attempt.submission_id, dump_id=stacks_submission_id(attempt.submission_id, now))
        except InfraError as exc:
            note = f"could not ask for the stacks: {exc.detail}"
            log.warning("job %s: %s", job.id, note)
        with session_scope(self.engine) as session:
            record_event(session, job.id, kind=EventKind.STALL, reason="stack_dump", message=note[:2000],
                         attempt=job.attempt, actor=self.owner)  # fmt: skip

    # ---- the derived timeout ---------------------------------------------------------------------------------
    def _remember(self, job: Job, at: datetime) -> None:
        if len(self._seen) > MAX_KNOWN:
            self._seen.clear()
            self._timeouts.clear()
            self._dumps.clear()
        seen = self._seen.setdefault((job.id, job.attempt), deque(maxlen=WINDOW + 1))
        if not seen or seen[-1] != at:
            seen.append(at)

    def _timeout(self, job: Job, spec: JobSpec, progress_at: datetime) -> tuple[float, str] | None:
        policy = policies.stall_policy(self.settings)
        if spec.stall_timeout_seconds is not None or not policy.detect:
            return stall_timeout(spec.stall_timeout_seconds, (), policy)
        if (utcnow() - progress_at).total_seconds() < policy.min_seconds:
            return None  # reported lately: no derived timeout is shorter than the minimum, so nothing to ask
        key = (job.id, job.attempt, progress_at)
        if key not in self._timeouts:
            self._timeouts[key] = stall_timeout(None, self._report_times(job, progress_at), policy)
        return self._timeouts[key]

    def _report_times(self, job: Job, progress_at: datetime) -> set[datetime]:
        """The attempt's recent report times; while it has made few reports, its start of training (its RUNNING
        transition) too, so the stretch to its first report counts as one of its intervals."""
        names = sorted(name for name in job.latest_metrics or {} if name != "step")[:MAX_NAMES]
        times = {progress_at, *self._seen.get((job.id, job.attempt), ())}
        with Session(self.engine) as session:
            for name in names:
                times.update(session.exec(
                    select(Metric.at)
                    .where(Metric.job_id == job.id, Metric.name == name, Metric.attempt == job.attempt)
                    .order_by(col(Metric.step).desc())
                    .limit(WINDOW + 1)
                ).all())  # fmt: skip
            recent = set(sorted(times)[-(WINDOW + 1) :])
            if len(times) <= WINDOW:
                started = session.exec(
                    select(JobEvent.at)
                    .where(JobEvent.job_id == job.id, JobEvent.attempt == job.attempt,
                           JobEvent.to_state == JobState.RUNNING)
                    .order_by(col(JobEvent.id).desc())
                    .limit(1)
                ).first()  # fmt: skip
                if started is not None and started <= min(recent):
                    recent.add(started)
        return recent

    # ---- the dump job ----------------------------------------------------------------------------------------
    def _dump_state(self, dump_id: str, stalled_at: datetime) -> tuple[datetime | None, str | None, bool]:
        """(when the dump was first seen ended, or None while it runs; its summary line; whether it ran at all).
        Timed by this dispatcher's clock, not Ray's end time: the two hosts' clocks need not agree."""
        if dump_id in self._dumps:
            ended, said = self._dumps[dump_id]
            return ended, said, True
        info = self.ray.info(dump_id)
        if info is None:
            return stalled_at, None, False  # no dump job (refused, or a backend without processes): nothing to wait on
        if not info.is_terminal:
            return None, None, True
        try:
            # Its summary line is among its last: a tail, whatever the stacks it printed weigh.
            text = (log_tail(self.ray, dump_id, DUMP_LOG_TAIL_BYTES) or b"").decode("utf-8", errors="replace")
        except InfraError:
            text = ""
        lines = [line[len(DUMP_SAID) :].strip() for line in text.splitlines() if line.startswith(DUMP_SAID)]
        said = lines[-1] if lines else f"the stack dump job ended {info.status} without saying what it did"
        self._dumps[dump_id] = (utcnow(), said)
        return self._dumps[dump_id][0], said, True
