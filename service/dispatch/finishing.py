"""The writes that follow Ray's word on an attempt: its submission recorded, its end recorded and the job ended or
requeued. A part of `service.dispatch.dispatcher.Dispatcher`, given what it uses; the retry policy is injected
(`retry_policy`, `service.policy.retry.decide` by default), so a test can swap it, as Ray Train's `FailurePolicy` is.

Many jobs end in one tick and many are submitted after one admission pass: those writes go in batches, one
transaction for all (`finish_many`, `mark_submitted_many`), a few statements each. One job's fault stays its own: a
batch that fails is written again job by job, each in its own transaction and with its own fault handling
(`Dispatcher._safely`); a job that moved on meanwhile (a cancel, a lease taken over) loses alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, func, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import col

from service.config.settings import Settings
from service.dispatch.host_effects import HostEffects, SpecOf
from service.dispatch.late_logs import LateLogs
from service.dispatch.nodes import NodeHistory
from service.lifecycle import reports
from service.lifecycle.state import Move, end_reason_state, record_event, record_events, transition, transition_many
from service.policy import end_reasons, retry
from service.policy.reconcile import Action, Finish
from service.spec.job import Retries
from service.store.db import session_scope
from service.store.models import Attempt, EndReason, EventKind, Job, JobState, utcnow

log = logging.getLogger(__name__)
Safely = Callable[..., Any]  # the Dispatcher's fault handling: `safely(job, fn, *args)` -> fn's result, or None


@dataclass
class Ending:
    """One attempt's end, decided and ready to write (its log already kept)."""

    job: Job
    attempt: Attempt
    action: Finish
    message: str
    log_uri: str | None
    decision: retry.RetryDecision
    asked: bool  # a preemption was asked for: its notice is cleared once the end is written
    now: datetime


def batched_finish(actions: list[Action]) -> Finish | None:
    """The Finish of a job whose only action this tick is to end its attempt (the common case: Ray says it ended):
    such ends are written together. Anything else (a submission to record first, a stop) runs job by job."""
    if len(actions) == 1 and isinstance(actions[0], Finish):
        return actions[0]
    return None


def submitted_event(attempt: Attempt, *, adopted: bool, actor: str) -> dict[str, Any]:
    reason = "ray_job_adopted" if adopted else "ray_job_submitted"
    return {"job_id": attempt.job_id, "kind": EventKind.RAY, "reason": reason, "message": attempt.submission_id,
            "attempt": attempt.number, "actor": actor}  # fmt: skip


def _attempt_end(table: Any) -> Any:
    """UPDATE attempts for an end: message kept if the attempt has one (the driver's own account)."""
    return (
        update(table)
        .where(table.c.id == bindparam("a_id"))
        .values(ended_at=bindparam("a_ended"), end_reason=bindparam("a_reason"), ray_status=bindparam("a_status"),
                message=func.coalesce(table.c.message, bindparam("a_message")), log_uri=bindparam("a_log"))
    )  # fmt: skip


class Finishing:
    def __init__(
        self, *, engine: Engine, settings: Settings, owner: str, nodes: NodeHistory, late: LateLogs,
        host: HostEffects, spec_of: SpecOf, safely: Safely, stop_sent: dict[str, float],
        retry_policy: Callable[..., retry.RetryDecision] = retry.decide,
    ) -> None:  # fmt: skip
        self.engine, self.settings, self.owner, self.nodes, self.late = engine, settings, owner, nodes, late
        self.host, self.spec_of, self._safely, self._stop_sent = host, spec_of, safely, stop_sent
        self.retry_policy = retry_policy

    # ---- submissions ----------------------------------------------------------------------------------------------
    def mark_submitted(self, job: Job, attempt: Attempt, *, adopted: bool) -> None:
        table = Attempt.__table__  # type: ignore[attr-defined]  # SQLModel sets __table__ when it makes the class
        with session_scope(self.engine) as session:
            changed = session.execute(
                update(table).where(table.c.id == attempt.id, table.c.submitted.is_(False)).values(submitted=True)
            ).rowcount  # type: ignore[attr-defined]  # an UPDATE's result is a CursorResult; Session.execute says Result
            if changed == 1:
                record_events(session, [submitted_event(attempt, adopted=adopted, actor=self.owner)])
        attempt.submitted = True

    def mark_submitted_many(self, accepted: list[tuple[Job, Attempt, bool]]) -> None:
        """Record many submissions Ray accepted (job, attempt, adopted) in one transaction: one UPDATE, one INSERT."""
        if not accepted:
            return
        table = Attempt.__table__  # type: ignore[attr-defined]  # SQLModel sets __table__ when it makes the class
        try:
            with session_scope(self.engine) as session:
                ids = [a.id for _, a, _ in accepted]
                marked = set(session.execute(
                    update(table).where(table.c.id.in_(ids), table.c.submitted.is_(False)).values(submitted=True)
                    .returning(table.c.id)
                ).scalars())  # fmt: skip
                record_events(session, [submitted_event(a, adopted=adopted, actor=self.owner)
                                        for _, a, adopted in accepted if a.id in marked])  # fmt: skip
        except SQLAlchemyError as exc:
            log.warning("recording %d submissions at once failed (%s): one by one", len(accepted), exc)
            for job, attempt, adopted in accepted:
                self._safely(job, self.mark_submitted, job, attempt, adopted=adopted)
            return
        for _, attempt, _ in accepted:
            attempt.submitted = True

    # ---- ends -----------------------------------------------------------------------------------------------------
    def finish(self, job: Job, attempt: Attempt, action: Finish) -> None:
        """Close the attempt; then end the job, or queue the next attempt if the retry policy says so."""
        self.write_ending(self.prepare(job, attempt, action))

    def prepare(self, job: Job, attempt: Attempt, action: Finish) -> Ending:
        """Everything an end needs before its transaction: the kept log, the retry decision."""
        reason, message = action.reason, action.message
        if attempt.message and (action.log_later or reason in end_reasons.DRIVER_ACCOUNT):
            message = attempt.message  # the driver's own account (a stall's: the dispatcher's, not Ray's "stopped")
        log_uri = self.host.run(job, "log", self.host.keep_log, job, attempt) if action.keep_logs else None
        spec, _ = self.spec_of(job)
        retries = spec.retries if spec is not None else Retries()
        decision = self.retry_policy(
            reason=reason, attempt=job.attempt, max_attempts=retries.max_attempts,
            backoff_seconds=retries.backoff_seconds, max_backoff_seconds=retries.max_backoff_seconds,
            retry_on_timeout=retries.retry_on_timeout, preemptions=job.preemptions,
            cluster_restarts=job.cluster_restarts, count_cluster_restarts=self.settings.count_cluster_restarts,
            drain_confirmed=self.nodes.confirms(attempt.started_at, message),
            elastic=spec is not None and spec.resources.elastic,
            node_losses=reports.node_losses(self.engine, job.id, attempt.id, reason),
            max_free_node_losses=self.settings.max_free_node_losses, max_free_retries=self.settings.max_free_retries,
        )  # fmt: skip
        return Ending(job, attempt, action, message, log_uri, decision, job.preempt_requested_at is not None, utcnow())

    def _attempt_row(self, e: Ending) -> dict[str, Any]:
        return {"a_id": e.attempt.id, "a_ended": e.now, "a_reason": e.action.reason, "a_status": e.action.ray_status,
                "a_message": e.message, "a_log": e.log_uri}  # fmt: skip

    def write_ending(self, e: Ending) -> None:
        """One end in its own transaction (raises StaleWrite if the job moved on)."""
        job, reason, decision, message, now = e.job, e.action.reason, e.decision, e.message, e.now
        with session_scope(self.engine) as session:
            session.execute(_attempt_end(Attempt.__table__), [self._attempt_row(e)])  # type: ignore[attr-defined]  # SQLModel sets __table__ when it makes the class
            if decision.retry:
                resumes, meaning = reports.steps_lost(session, job.id), end_reasons.of(reason)
                if meaning.retry_event is not None:
                    kind, said = meaning.retry_event
                    record_event(session, job.id, kind=kind, reason=said, attempt=job.attempt,
                                 message=f"{message[-1500:]}; {resumes}", actor=self.owner)  # fmt: skip
                record_event(session, job.id, kind=EventKind.RETRY, reason="retry_decided",
                             message=f"{decision.why}; {resumes}", attempt=job.attempt, actor=self.owner)  # fmt: skip
                values = {"not_before": now + timedelta(seconds=decision.delay_seconds), "last_error": message[-4000:],
                          "preempt_requested_at": None}  # fmt: skip
                if decision.uncounted:  # not failures: preempted, drained, an elastic job shrinking
                    values.update(preemptions=job.preemptions + 1, last_error=None)
                if meaning.counter is not None:
                    values[meaning.counter] = getattr(job, meaning.counter) + 1
                message = meaning.retry_says or message
                transition(session, job, to=JobState.QUEUED, reason=reason.value, lease_token=job.lease_token,
                           actor=self.owner, message=f"{message[-500:]}; retrying in {decision.delay_seconds:.0f}s",
                           values=values)  # fmt: skip
            else:
                transition(session, job, **self._end_move(e))
        self._after_ending(e)

    def _end_move(self, e: Ending) -> dict[str, Any]:
        """`transition`'s arguments for an end that is not retried."""
        reason = e.action.reason
        values: dict[str, Any] = {"end_reason": reason}
        if reason is not EndReason.SUCCEEDED:
            values["last_error"] = e.message[-4000:]
        return {"to": end_reason_state(reason), "reason": reason.value, "lease_token": e.job.lease_token,
                "actor": self.owner, "message": e.message[-1000:], "values": values}  # fmt: skip

    def _after_ending(self, e: Ending) -> None:
        self._stop_sent.pop(e.attempt.submission_id, None)
        if e.action.log_later:
            self.late.add(e.attempt, e.now)
        if e.asked:  # read before the transition, which clears the job's preempt_requested_at
            self.host.run(e.job, "preemption notice", self.host.clear_notice, e.job)

    def finish_many(self, endings: list[Ending]) -> None:
        """Write many ends: those not retried in one transaction (one UPDATE of jobs per kind of end, one of attempts,
        one INSERT of events); retries, and every end of a batch that failed, job by job."""
        ended = [e for e in endings if not e.decision.retry]
        one_by_one = [e for e in endings if e.decision.retry]
        if len(ended) == 1:
            one_by_one += ended
        elif ended:
            try:
                with session_scope(self.engine) as session:
                    moves = [Move(e.job, **{k: v for k, v in self._end_move(e).items() if k != "actor"}) for e in ended]
                    lost = {id(m.job) for m in transition_many(session, moves, actor=self.owner, now=ended[0].now)}
                    won = [e for e in ended if id(e.job) not in lost]
                    if won:
                        session.execute(_attempt_end(Attempt.__table__), [self._attempt_row(e) for e in won])  # type: ignore[attr-defined]  # SQLModel sets __table__ when it makes the class
            except Exception as exc:  # noqa: BLE001 - one bad end must not keep the others unwritten
                log.warning("writing %d ends at once failed (%s): one by one", len(ended), exc)
                one_by_one += ended
            else:
                for e in ended:
                    if id(e.job) in lost:
                        log.info("job %s moved on under us: not ended here", e.job.id)
                    else:
                        self._after_ending(e)
        for e in one_by_one:
            self._safely(e.job, self.write_ending, e)

    # ---- attempts --------------------------------------------------------------------------------------------------
    def mark_attempt(self, attempt: Attempt, reason: EndReason, message: str) -> None:
        with session_scope(self.engine) as session:
            session.execute(
                update(Attempt).where(col(Attempt.id) == attempt.id, col(Attempt.end_reason).is_(None))
                .values(end_reason=reason, message=message)
            )  # fmt: skip
