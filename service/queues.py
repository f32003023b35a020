"""Named queues: their limits (settings, overridden over the API) and what each runs now."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from sqlmodel import Session, col, select

from service.errors import InvalidSpec
from service.models import ACTIVE_STATES, Job, JobState, QueueConfig, utcnow
from service.scheduler import QueueLimit, QueueUsage
from service.settings import Settings
from service.spec import JobSpec

DEFAULT_QUEUE = "default"
_LIMIT_KEYS = {"max_running", "max_cpus", "max_gpus", "preemption"}


def limits(session: Session, settings: Settings) -> dict[str, QueueLimit]:
    """Every known queue's limits: `default` always exists; API-set rows override `SHUNTER_QUEUES`."""
    out: dict[str, QueueLimit] = {DEFAULT_QUEUE: QueueLimit()}
    for name, conf in settings.queues.items():
        unknown = set(conf) - _LIMIT_KEYS
        if unknown:
            raise ValueError(f"SHUNTER_QUEUES.{name}: unknown keys {sorted(unknown)}")
        out[name] = QueueLimit(**conf)
    for row in session.exec(select(QueueConfig)).all():
        out[row.name] = QueueLimit(
            max_running=row.max_running, max_cpus=row.max_cpus, max_gpus=row.max_gpus, preemption=row.preemption
        )
    return out


def usage(session: Session, totals: Callable[[Job], dict[str, float]] | None = None) -> dict[str, QueueUsage]:
    """What each queue's admitted jobs hold now (`totals` may supply cached per-job resources)."""
    return usage_of(session.exec(select(Job).where(col(Job.state).in_(ACTIVE_STATES))).all(), totals)


def usage_of(admitted: Iterable[Job], totals: Callable[[Job], dict[str, float]] | None = None) -> dict[str, QueueUsage]:
    """What each queue's admitted (active) jobs among `admitted` hold."""
    out: dict[str, QueueUsage] = {}
    for job in admitted:
        out.setdefault(job.queue, QueueUsage()).add(totals(job) if totals else _total(job))
    return out


def _total(job: Job) -> dict[str, float]:
    try:
        return JobSpec.model_validate(job.spec).resources.total()
    except ValueError:  # a stored spec that no longer validates holds nothing; the dispatcher ends that job
        return {}


def check_known(session: Session, settings: Settings, name: str) -> None:
    if name not in limits(session, settings):
        known = ", ".join(sorted(limits(session, settings)))
        raise InvalidSpec(f"queue: no queue named {name!r}; known: {known}", field="queue")


@dataclass
class QueueView:
    name: str
    limits: dict[str, Any]
    running: int
    queued: int
    cpus_in_use: float
    gpus_in_use: float


def overview(session: Session, settings: Settings) -> list[QueueView]:
    used = usage(session)
    queued: dict[str, int] = {}
    for name in session.exec(select(Job.queue).where(Job.state == JobState.QUEUED)).all():
        queued[name] = queued.get(name, 0) + 1
    views = []
    for name, limit in sorted(limits(session, settings).items()):
        u = used.get(name, QueueUsage())
        views.append(QueueView(name, asdict(limit), u.running, queued.get(name, 0), u.cpus, u.gpus))
    return views


def put(session: Session, name: str, limit: QueueLimit) -> QueueConfig:
    row = session.get(QueueConfig, name) or QueueConfig(name=name)
    row.max_running, row.max_cpus, row.max_gpus = limit.max_running, limit.max_cpus, limit.max_gpus
    row.preemption, row.updated_at = limit.preemption, utcnow()
    session.add(row)
    return row
