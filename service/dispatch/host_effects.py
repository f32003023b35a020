"""Shunter's own effects on its host for one job (its kept log, its preemption notice): a failure is recorded as an
event on the job and got past, never the job's end. A part of `service.dispatch.dispatcher.Dispatcher`, given what it
uses."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.engine import Engine
from sqlalchemy.exc import SQLAlchemyError

from service.config.settings import Settings
from service.core.backend import Backend
from service.core.errors import InfraError
from service.dispatch import submission
from service.dispatch.host_files import HostFault, HostFiles
from service.lifecycle.state import record_event
from service.spec.job import JobSpec
from service.store.db import session_scope
from service.store.models import Attempt, EventKind, Job
from service.tenancy.secret_store import masker_for

log = logging.getLogger(__name__)
T = TypeVar("T")
SpecOf = Callable[[Job], tuple[JobSpec | None, str | None]]


class HostEffects:
    def __init__(
        self, *, engine: Engine, settings: Settings, ray: Backend, files: HostFiles, owner: str, spec_of: SpecOf
    ) -> None:
        self.engine, self.settings, self.ray, self.files, self.owner = engine, settings, ray, files, owner
        self.spec_of = spec_of

    def run(self, job: Job, what: str, effect: Callable[..., T], *args: Any) -> T | None:
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

    def keep_log(self, job: Job, attempt: Attempt) -> str | None:
        """Copy the attempt's driver log out of Ray, so it stays readable after the cluster is gone."""
        try:
            chunks = self.ray.log_stream(attempt.submission_id, 0, None)  # by range: never the whole log held
            if chunks is None:
                return None
            masked = masker_for(self.engine, self.settings, job.id).stream(chunks)  # its secrets' values starred out
            return self.files.keep_log_chunks(job.id, attempt.number, masked)
        except InfraError:
            return None

    def _storage_of(self, job: Job) -> str:
        spec, _ = self.spec_of(job)
        if spec is None:
            raise HostFault("the job's spec does not validate: no storage to use")
        return submission.job_storage(spec, self.settings)

    def write_notice(self, job: Job) -> None:
        self.files.write_preemption_notice(self._storage_of(job), job.id, attempt=job.attempt)

    def clear_notice(self, job: Job) -> None:
        self.files.clear_preemption_notice(self._storage_of(job), job.id)
