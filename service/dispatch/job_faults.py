"""One job's fault stays that job's (see `service.dispatch.dispatcher`): a step for one job runs through `safely`,
which logs what Ray or the database being away costs (nothing: the next tick tries again), ends a job whose own
values the database refuses, and gives up on a job whose handling keeps failing for `job_fault_patience_seconds`
(`abandon`: its Ray Job stopped, the job FAILED as infra). A part of `service.dispatch.dispatcher.Dispatcher`."""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session

from service.config.settings import Settings
from service.core.backend import Backend, submission_id
from service.core.errors import InfraError, StaleWrite
from service.dispatch.finishing import Ending
from service.lifecycle.state import transition
from service.store.db import JOB_DATA_ERRORS, session_scope
from service.store.models import EndReason, Job, JobState

log = logging.getLogger(__name__)


class JobFaults:
    def __init__(self, *, engine: Engine, settings: Settings, ray: Backend, owner: str) -> None:
        self.engine, self.settings, self.ray, self.owner = engine, settings, ray, owner
        self._first: dict[str, float] = {}  # job id -> when its handling first failed unexpectedly (monotonic)

    def safely(self, job: Job, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn(*args)` for `job`, its faults kept its own (this module's docstring); None when it failed."""
        try:
            out = fn(*args, **kwargs)
            if not isinstance(out, Ending):  # an end decided, not yet written: its write may be the job's fault
                self._first.pop(job.id, None)
            return out
        except StaleWrite as exc:
            log.info("job %s moved on under us: %s", job.id, exc)
        except (InfraError, SQLAlchemyError) as exc:
            if isinstance(exc, JOB_DATA_ERRORS):
                self._fault(job, exc)  # the database refuses this job's values, and will on every tick
            else:  # Ray or the database is away, or its schema is another release's: nobody's job is at fault
                log.warning("job %s: not reconciled this tick: %s", job.id, exc)
        except Exception as exc:  # noqa: BLE001 - one job's surprise must not stop the others, nor wedge this one
            self._fault(job, exc)
        return None

    def _fault(self, job: Job, exc: Exception) -> None:
        """A failure of this job's own: retried each tick, and the job given up on once it has lasted
        `job_fault_patience_seconds`."""
        log.exception("job %s: reconcile failed", job.id)
        first = self._first.setdefault(job.id, time.monotonic())
        if time.monotonic() - first >= self.settings.job_fault_patience_seconds:
            patience = self.settings.job_fault_patience_seconds
            try:
                self.abandon(job, f"shunter could not handle this job for {patience:g}s: {type(exc).__name__}: {exc}")
            except Exception:  # noqa: BLE001 - giving up failed too: try again next tick, never abort the others
                log.exception("job %s: could not give up on it", job.id)

    def abandon(self, job: Job, message: str) -> None:
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
        self._first.pop(job.id, None)
