"""Shunter's own effects on its host for one job (its kept log, its preemption notice): a failure is recorded as an
event on the job and got past, never the job's end. A mixin of `service.dispatch.dispatcher.Dispatcher`."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from service.core.errors import InfraError
from service.dispatch import submission
from service.dispatch.host_files import HostFault
from service.lifecycle.state import record_event
from service.store.db import session_scope
from service.store.models import Attempt, EventKind, Job
from service.tenancy.secret_store import masker_for

log = logging.getLogger(__name__)


class HostEffects:
    engine: Any
    files: Any
    ray: Any
    settings: Any
    owner: str

    def spec_of(self, job: Job) -> Any:  # the Dispatcher's
        raise NotImplementedError

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

    def _write_notice(self, job: Job) -> None:
        self.files.write_preemption_notice(self._storage_of(job), job.id, attempt=job.attempt)

    def _clear_notice(self, job: Job) -> None:
        self.files.clear_preemption_notice(self._storage_of(job), job.id)
