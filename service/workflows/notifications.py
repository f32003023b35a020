"""Notifications, the database side: the outbox rows written with each state change, and the secrets they sign with.

`enqueue` is called by the two writers of state events (`service.lifecycle.state.transition`, and
`service.lifecycle.jobs.submit` for the first QUEUED) inside their transaction, so an event and its notifications are
committed together or not at all. A row is written for each of the job's `notify` entries whose `events` hold the new
state, and for each cluster target (`SHUNTER_WEBHOOKS`, registered per engine by `configure`) that does.
`service.workflows.webhooks` sends them.
"""

from __future__ import annotations

import ipaddress
import logging
import uuid
import weakref
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pydantic import ValidationError
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, col, select

from service.core.errors import InvalidSpec
from service.policy.webhook_rules import address_problem, event_document, render
from service.spec.notify import ClusterWebhook, Delivery
from service.store.db import base_engine
from service.store.models import Job, JobState
from service.store.notify_tables import Notification, NotifySecret

if TYPE_CHECKING:
    from service.config.settings import Settings
    from service.spec.job import JobSpec

log = logging.getLogger(__name__)
# Cluster targets by engine: every process that writes events (API, dispatcher) opens its engine through
# `service.runtime.Runtime.open`, which registers them; an engine nobody configured has none.
_CLUSTER: weakref.WeakKeyDictionary[Engine, tuple[ClusterWebhook, ...]] = weakref.WeakKeyDictionary()


def configure(engine: Engine, targets: list[ClusterWebhook] | tuple[ClusterWebhook, ...]) -> None:
    """Register the cluster-wide targets whose rows `enqueue` writes for events written through `engine`."""
    _CLUSTER[engine] = tuple(targets)


def cluster_targets(bind: Engine | Connection) -> tuple[ClusterWebhook, ...]:
    """The targets `configure` registered for the engine `bind` stands for (a session's bind: an engine, a request's
    write bind, a connection)."""
    return _CLUSTER.get(base_engine(bind), ())


def new_event_id() -> str:
    return "evt_" + uuid.uuid4().hex


def job_summary(job: Job) -> dict[str, Any]:
    """The job as an event body describes it (no spec: it may be large, and is the owner's to read over the API)."""
    return {
        "id": job.id, "name": job.name, "owner": job.owner, "queue": job.queue,
        "state": JobState(job.state).value, "attempt": job.attempt, "state_reason": job.state_reason,
        "end_reason": getattr(job.end_reason, "value", job.end_reason), "last_error": job.last_error,
    }  # fmt: skip


def enqueue(
    session: Session, job: Job, *, from_state: JobState | None, to_state: JobState, reason: str,
    message: str | None, at: datetime,
) -> list[Notification]:  # fmt: skip
    """Outbox rows for one state change of `job` (already holding its new values); the caller commits."""
    targets: list[tuple[str, Delivery]] = []
    for i, entry in enumerate((job.spec or {}).get("notify") or []):
        try:
            target = Delivery.model_validate({k: v for k, v in entry.items() if k != "secret"})
        except (ValidationError, AttributeError) as exc:  # a stored row of another shape: its state still changes
            log.warning("job %s: notify[%d] is not a notify entry, skipped: %s", job.id, i, str(exc)[:300])
            continue
        if to_state.value in target.events:
            targets.append((f"job:{i}", target))
    cluster = cluster_targets(session.get_bind())
    targets += [(f"cluster:{i}", t) for i, t in enumerate(cluster) if to_state.value in t.events]
    if not targets:
        return []
    event_id = new_event_id()
    document = event_document(
        event_id=event_id, job=job_summary(job), from_state=from_state.value if from_state else None,
        to_state=to_state.value, reason=reason, message=message, at=at,
    )  # fmt: skip
    rows = [
        Notification(event_id=event_id, job_id=job.id, target=name, url=target.url, format=target.format.value,
                     to_state=to_state.value, body=render(document, target.format.value), next_at=at, created_at=at)
        for name, target in targets
    ]  # fmt: skip
    session.add_all(rows)
    return rows


def check_spec(spec: JobSpec, settings: Settings | None) -> None:
    """Refuse at submission what could never be delivered: an entry with nothing to sign with, or a URL that names
    a loopback or private address outright (names are checked on what they resolve to, at each delivery)."""
    if settings is None:  # no service settings to check against (library use, tests of other parts)
        return
    for i, entry in enumerate(spec.notify):
        if entry.secret is None and not settings.webhook_secret:
            raise InvalidSpec(
                f"notify.{i}.secret: required: this service has no SHUNTER_WEBHOOK_SECRET to sign deliveries with",
                field="notify.secret",
            )
        if settings.webhook_allow_private:
            continue
        host = urlsplit(entry.url).hostname or ""
        problem = _literal_host_problem(host)
        if problem:
            raise InvalidSpec(f"notify.{i}.url: {problem}; webhooks go to public addresses only",
                              field="notify.url")  # fmt: skip


def _literal_host_problem(host: str) -> str | None:
    if host.rstrip(".").lower() == "localhost" or host.lower().endswith(".localhost"):
        return "localhost is a loopback address"
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None  # a name: judged on what it resolves to
    return address_problem(host)


def store_secrets(session: Session, job: Job, spec: JobSpec) -> None:
    """Keep each entry's secret beside the job (the stored spec has none: the secret field is never dumped)."""
    for i, entry in enumerate(spec.notify):
        if entry.secret is not None:
            session.add(NotifySecret(job_id=job.id, target=i, secret=entry.secret))


def secret_for(session: Session, row: Notification, settings: Settings) -> str | None:
    """What signs `row`: its job entry's own secret, or its cluster target's, else the cluster's secret."""
    kind, _, index = row.target.partition(":")
    own: str | None = None
    if kind == "job":
        stored = session.get(NotifySecret, (row.job_id, int(index)))
        own = stored.secret if stored is not None else None
    elif kind == "cluster" and int(index) < len(settings.webhooks):
        own = settings.webhooks[int(index)].secret
    return own or settings.webhook_secret


def of_job(session: Session, job: Job) -> list[Notification]:
    """The job's deliveries, oldest first."""
    return list(session.exec(select(Notification).where(Notification.job_id == job.id).order_by(col(Notification.id))))
