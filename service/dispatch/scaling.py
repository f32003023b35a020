"""The dispatcher's side of a growing cluster (issue 37): each admission pass works out what the queue waits for
(`service.policy.demand`, in the pass's own order); after the pass, outside its transaction, the request goes to
Ray's autoscaler when it changed, and the jobs it newly asks room for get a `scale_requested` event. A job admitted
after it was asked for gets `capacity_arrived`, with how long the room took.

Only under `SHUNTER_CLUSTER_MAY_GROW`. A request Ray did not take is sent again after the next pass; one this
dispatcher sent is withdrawn (an empty request) once nothing waits for room, so idle nodes can go.

A dispatcher that starts (a restart, a new replica) carries on where the last one left off: when each waiting job's
room was first asked for is read back from its `scale_requested` event, so the scale-up timeout, the preemption grace
and the job's reason count from the first ask and no second event is written; and its first pass sends its request
whatever it is, an empty one included, so a request that an earlier dispatcher left standing in Ray is replaced and
idle nodes are not kept for a queue that has emptied.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime

from sqlalchemy.engine import Engine
from sqlmodel import col, select

from service.config import policies
from service.config.settings import Settings
from service.core.backend import Backend
from service.core.errors import InfraError, StaleWrite
from service.lifecycle import leases
from service.lifecycle.state import record_event, transition
from service.policy.demand import Demand, Running, demand, may_preempt
from service.policy.scheduler import Candidate
from service.store.db import session_scope
from service.store.models import EndReason, EventKind, Job, JobEvent, JobState, utcnow

log = logging.getLogger(__name__)


class Scaling:
    def __init__(self, *, engine: Engine, settings: Settings, ray: Backend, owner: str) -> None:
        self.engine, self.settings, self.ray, self.owner = engine, settings, ray, owner
        self.wanted = Demand()  # what the last admission pass found the queue waiting for
        self.asked: dict[str, datetime] = {}  # job id -> when its room was first asked for (until it starts)
        self.sent: Demand | None = None  # the last request Ray took (None: none sent by this dispatcher)
        self.sent_at: datetime | None = None
        self._resumed = False  # `asked` read back from the database (once, at the first pass)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.settings.cluster_may_grow and callable(getattr(self.ray, "request_resources", None))

    def plan(self, ordered: list[Candidate], waiting: dict[str, str], running: list[Running]) -> None:
        """In the admission pass: what to ask for, from its order and its reasons (see `service.policy.demand`)."""
        if not self._resumed:
            self._resume()
        self.wanted = demand(ordered, waiting, running, max_jobs=self.settings.scale_max_pending_jobs,
                             node_types=policies.node_types(self.settings))  # fmt: skip

    def _resume(self) -> None:
        """The ask times of the queued jobs still waiting for room, from their events: each job's latest
        `scale_requested` not followed by its `capacity_arrived`."""
        query = (
            select(JobEvent.job_id, JobEvent.reason, JobEvent.at)
            .join(Job, col(Job.id) == col(JobEvent.job_id))
            .where(Job.state == JobState.QUEUED, JobEvent.kind == EventKind.SCALE.value)
            .order_by(col(JobEvent.id))
        )
        asked: dict[str, datetime] = {}
        with session_scope(self.engine, write=False) as session:
            for job_id, said, at in session.exec(query).all():
                if said == "scale_requested":
                    asked[job_id] = at  # aware UTC, as every UTCDateTime column reads back
                else:
                    asked.pop(job_id, None)
        with self._lock:
            self.asked = asked | self.asked
            self._resumed = True

    def reason(self, job_id: str, why: str) -> str:
        """A waiting job's `state_reason`, with when the autoscaler was asked for its room."""
        at = self.asked.get(job_id)
        return why if at is None else f"{why}; asked the autoscaler for room at {at:%Y-%m-%d %H:%M:%S} UTC"

    def may_preempt(self, job_id: str, now: datetime) -> bool:
        """Whether admission may preempt for `job_id` now (`service.policy.demand.may_preempt`)."""
        if not self.enabled:
            return True
        return may_preempt(job_id, self.wanted, self.asked, now, self.settings.scale_up_grace_seconds)

    def clear(self) -> None:
        """An admission pass with nothing waiting: nothing to ask for."""
        self.wanted = Demand()

    def send(self, started: list[Job]) -> None:
        """After the pass: the request to Ray when it changed, and the events of the jobs asked for or arrived."""
        if not self.enabled:
            return
        with self._lock:
            wanted, now = self.wanted, utcnow()
            arrived = [(job, self.asked.pop(job.id)) for job in started if job.id in self.asked]
            new = [job_id for job_id in wanted.jobs if job_id not in self.asked]
            # The first pass sends whatever it finds, nothing included: Ray may hold an earlier dispatcher's request.
            changed = self.sent is None or self.sent.key() != wanted.key()
            if changed:
                try:
                    self.ray.request_resources(wanted.bundles)  # type: ignore[attr-defined]  # the Ray backend's; scaling runs only with it
                except InfraError as exc:
                    log.warning("cannot ask Ray's autoscaler for room: %s", exc.detail)
                    new = []  # asked for again after the next pass
                else:
                    self.sent, self.sent_at = wanted, now
                    log.info("asked Ray's autoscaler for %d bundles (%d waiting jobs)", len(wanted.bundles),
                             len(wanted.jobs))  # fmt: skip
            for job_id in new:
                self.asked[job_id] = now
            for gone in [j for j in self.asked if j not in wanted.jobs and j not in new]:
                del self.asked[gone]  # no longer waiting for room (cancelled, or held by a quota now)
        self._record(new, arrived, wanted, now)
        self._give_up(now)

    def _give_up(self, now: datetime) -> None:
        """Without node types nothing says whether a node could ever hold a job: one whose room has not come within
        `scale_up_timeout_seconds` of the first ask fails as a user error, with the reason it waited."""
        limit = self.settings.scale_up_timeout_seconds
        if self.settings.node_types or not limit:
            return
        with self._lock:
            late = [job_id for job_id, at in self.asked.items() if (now - at).total_seconds() > limit]
        for job_id in late:
            with session_scope(self.engine) as session:
                job = session.get(Job, job_id)
                if job is None or job.state != JobState.QUEUED:
                    continue
                said = (f"the cluster did not grow to hold it within {limit:g} s of asking its autoscaler "
                        f"(SHUNTER_SCALE_UP_TIMEOUT_SECONDS): {job.state_reason}")  # fmt: skip
                values = {"end_reason": EndReason.USER_ERROR, "last_error": said}
                try:
                    transition(session, job, to=JobState.FAILED, reason=EndReason.USER_ERROR.value, message=said,
                               actor=self.owner, values=values)  # fmt: skip
                except StaleWrite:
                    continue  # admitted or cancelled meanwhile
            with self._lock:
                self.asked.pop(job_id, None)

    def _record(self, new: list[str], arrived: list[tuple[Job, datetime]], wanted: Demand, now: datetime) -> None:
        if not new and not arrived:
            return
        with session_scope(self.engine) as session:
            for job_id in new:
                job = session.get(Job, job_id)
                if job is not None and job.state_reason:  # said now, not one pass later (the pass says the same)
                    leases.set_reason(session, job_id, self.reason(job_id, job.state_reason))
                record_event(session, job_id, kind=EventKind.SCALE, reason="scale_requested", attempt=None,
                             actor=self.owner, at=now,
                             message=f"asked Ray's autoscaler for room ({len(wanted.bundles)} bundles in all, for "
                                     f"{len(wanted.jobs)} waiting jobs and the running ones)")  # fmt: skip
            for job, asked_at in arrived:
                waited = (now - asked_at).total_seconds()
                record_event(session, job.id, kind=EventKind.SCALE, reason="capacity_arrived", actor=self.owner,
                             at=now, attempt=job.attempt,
                             message=f"room arrived {waited:.0f} s after the autoscaler was asked")  # fmt: skip

    def view(self) -> dict[str, object] | None:
        """The pending request, for `GET /v1/cluster` (stored with the cluster snapshot)."""
        if self.sent is None or not self.sent.bundles:
            return None
        at = self.sent_at.isoformat() if self.sent_at is not None else None
        return {"bundles": self.sent.bundles, "jobs": len(self.sent.jobs), "asked_at": at}
