"""Named queues: their limits (settings, overridden over the API) and what each runs now."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import func
from sqlmodel import Session, col, select

from service.config import policies
from service.config.settings import Settings
from service.core.errors import InvalidSpec
from service.policy import fairshare
from service.policy.quotas import QueueLimit, QueueUsage, Quota, parse_queue_limit
from service.spec.job import JobSpec
from service.store.kept import KeptPerEngine
from service.store.models import ACTIVE_STATES, Job, JobState, QueueConfig, utcnow

DEFAULT_QUEUE = "default"


def limits(session: Session, settings: Settings) -> dict[str, QueueLimit]:
    """Every known queue's limits: `default` always exists; API-set rows override `SHUNTER_QUEUES`."""
    out: dict[str, QueueLimit] = {DEFAULT_QUEUE: QueueLimit()}
    for name, conf in settings.queues.items():
        out[name] = parse_queue_limit(conf, f"SHUNTER_QUEUES.{name}")
    for row in session.exec(select(QueueConfig)).all():
        out[row.name] = QueueLimit(
            max_running=row.max_running, max_cpus=row.max_cpus, max_gpus=row.max_gpus, preemption=row.preemption,
            owner_quota=Quota.parse(row.owner_quota, "owner_quota") if row.owner_quota else None,
            team_quota=Quota.parse(row.team_quota, "team_quota") if row.team_quota else None,
            cohort=row.cohort, borrowing_limit=dict(row.borrowing_limit or {}),
            accelerator_types=list(row.accelerator_types) if row.accelerator_types else None,
        )  # fmt: skip
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
        return JobSpec.model_validate(job.spec).resources.total(job.world_size)  # as admitted
    except ValueError:  # a stored spec that no longer validates holds nothing; the dispatcher ends that job
        return {}


def check_known(session: Session, settings: Settings, name: str, accelerator_type: str | None = None) -> None:
    """The queue exists (422 naming `queue`), and runs the spec's accelerator type if it is limited to some (422
    naming `resources.accelerator_type`). The API-set queues are read at most once a second per process (`_api_set`):
    not on each submission."""
    api_set = _api_set.get(session)
    if name not in api_set and name != DEFAULT_QUEUE and name not in settings.queues:
        api_set = _api_set.get(session, fresh=True)  # a queue set over the API just now is known at once
    if name in api_set:
        kinds = api_set[name]
    elif name == DEFAULT_QUEUE or name in settings.queues:
        kinds = settings.queues.get(name, {}).get("accelerator_types")
    else:
        known = ", ".join(sorted(limits(session, settings)))
        raise InvalidSpec(f"queue: no queue named {name!r}; known: {known}", field="queue")
    if kinds and accelerator_type not in kinds:
        asked = f"asks for {accelerator_type!r}" if accelerator_type else "names no accelerator type"
        raise InvalidSpec(f"resources.accelerator_type: queue {name!r} runs only {', '.join(kinds)}; this job {asked}",
                          field="resources.accelerator_type")  # fmt: skip


def _read_api_set(session: Session) -> dict[str, list[str] | None]:
    rows = session.exec(select(QueueConfig.name, QueueConfig.accelerator_types)).all()
    return {name: (list(kinds) if kinds else None) for name, kinds in rows}


# The queues set over the API (queues are never deleted), with their accelerator types, read again once a second
# (a queue's new accelerator types apply to submissions a second later at most, as a dispatcher's view of the
# cluster does), or at once for a name not known yet.
API_SET_REUSE_SECONDS = 1.0
_api_set = KeptPerEngine(API_SET_REUSE_SECONDS, _read_api_set)


@dataclass
class QueueView:
    name: str
    limits: dict[str, Any]
    running: int
    queued: int
    cpus_in_use: float
    gpus_in_use: float
    owners: list[dict[str, Any]] = field(default_factory=list)


def overview(session: Session, settings: Settings) -> list[QueueView]:
    """Every queue with its limits and use, and per owner in it: running, queued, held, and fair-share usage."""
    from service.store import standing  # standing reads attempts; queues stays importable by it

    active = session.exec(select(Job).where(col(Job.state).in_(ACTIVE_STATES))).all()
    held = standing.held(active, _total)
    queued: dict[tuple[str, str, str | None], int] = {}
    rows = session.exec(
        select(Job.queue, Job.owner, Job.team, func.count()).where(Job.state == JobState.QUEUED)
        .group_by(col(Job.queue), col(Job.owner), col(Job.team))
    ).all()  # fmt: skip
    for queue, owner, team, n in rows:
        queued[(queue, owner, team)] = n
    fair = policies.fair_share(settings)
    # Owners who ran in a queue within fair share's horizon are listed with it too (their usage still counts).
    teams = standing.recent_owners(session, fair, utcnow())
    teams |= {(j.queue, j.owner): j.team for j in active} | {(q, o): t for q, o, t in queued}
    shares = fairshare.shares(standing.fair_usage(session, fair, utcnow()), fair)
    views = []
    for name, limit in sorted(limits(session, settings).items()):
        u = held.get(("queue", name), QueueUsage())
        owners = []
        for (queue, owner), team in sorted(teams.items()):
            if queue != name:
                continue
            mine = held.get(("queue-owner", name, owner), QueueUsage())
            share = shares.get(owner, {"usage": 0.0, "share": 0.0, "weight": fair.owner_weight(owner)})
            waits = queued.get((name, owner, team), 0)
            owners.append({"owner": owner, "team": team, "running": mine.running, "cpus_in_use": mine.cpus,
                           "gpus_in_use": mine.gpus, "queued": waits, **share})  # fmt: skip
        waiting = sum(n for (q, _, _), n in queued.items() if q == name)
        views.append(QueueView(name, _limits_dict(limit), u.running, waiting, u.cpus, u.gpus, owners))
    return views


def _limits_dict(limit: QueueLimit) -> dict[str, Any]:
    out = asdict(limit)
    out["borrowing_limit"] = out["borrowing_limit"] or None
    return out


def put(session: Session, name: str, limit: QueueLimit) -> QueueConfig:
    row = session.get(QueueConfig, name) or QueueConfig(name=name)
    row.max_running, row.max_cpus, row.max_gpus = limit.max_running, limit.max_cpus, limit.max_gpus
    row.preemption, row.updated_at = limit.preemption, utcnow()
    row.owner_quota = limit.owner_quota.as_dict() if limit.owner_quota else None
    row.team_quota = limit.team_quota.as_dict() if limit.team_quota else None
    row.cohort, row.borrowing_limit = limit.cohort, dict(limit.borrowing_limit) or None
    row.accelerator_types = list(limit.accelerator_types) if limit.accelerator_types else None
    session.add(row)
    return row
