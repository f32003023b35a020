"""What admission reads besides the queue: what each scope holds now, decayed usage for fair share, GPU-hours used in
quota windows. One module, so the admission pass and the position/estimate answers (`service.estimate`) see the
same numbers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

from sqlmodel import Session, col, or_, select

from service import quotas
from service.fairshare import FairShare, Usage, Use, usage_of
from service.models import Attempt, Job
from service.quotas import Held, QueueLimit, Quotas, Scope


def _horizon(config: FairShare, now: datetime) -> datetime:
    """The oldest end time fair share still reads (usage older than the horizon weighs under 0.1%)."""
    return now - timedelta(seconds=config.half_life_seconds * config.horizon_half_lives)


def held(active: Iterable[Job], resources_of: Callable[[Job], dict[str, float]]) -> dict[Scope, Held]:
    """What admitted jobs hold, by every scope they count in (queue, owner, team, owner/team within a queue)."""
    out: dict[Scope, Held] = {}
    for job in active:
        quotas.count(out, resources_of(job), job.queue, job.owner, job.team)
    return out


def _uses(session: Session, since: datetime) -> list[tuple[Attempt, str, str | None, str]]:
    """Attempts running now or ended after `since`, with their job's owner, team and queue."""
    query = (
        select(Attempt, Job.owner, Job.team, Job.queue)
        .join(Job, col(Job.id) == col(Attempt.job_id))
        .where(or_(col(Attempt.ended_at).is_(None), col(Attempt.ended_at) > since))
    )
    return [tuple(row) for row in session.exec(query).all()]  # type: ignore[misc]


_usage_cache: dict[tuple[str, str], tuple[datetime, Usage]] = {}
_usage_lock = threading.Lock()


def fair_usage(session: Session, config: FairShare, now: datetime, *, cached: bool = True) -> Usage:
    """Decayed usage per team and owner (running attempts up to now); nothing older than the horizon is read.

    It reads every attempt of the horizon, so each process keeps the answer for `config.refresh_seconds` of the
    service's clock: usage decays over hours, and within a pass each placed job's projection keeps the order fair.
    """
    if not config.enabled:
        return Usage()
    key = (str(session.get_bind().url), repr(config))
    with _usage_lock:
        hit = _usage_cache.get(key)
    if cached and hit is not None and timedelta(0) <= now - hit[0] < timedelta(seconds=config.refresh_seconds):
        return Usage(dict(hit[1].teams), dict(hit[1].owners))
    usage = _read_usage(session, config, now)
    with _usage_lock:
        _usage_cache[key] = (now, usage)
    return Usage(dict(usage.teams), dict(usage.owners))


def _read_usage(session: Session, config: FairShare, now: datetime) -> Usage:
    since = _horizon(config, now)
    uses = (
        Use(owner, team, {"CPU": a.cpus, "GPU": a.gpus}, a.started_at.timestamp(),
            a.ended_at.timestamp() if a.ended_at else None)
        for a, owner, team, _ in _uses(session, since)
    )  # fmt: skip
    return usage_of(uses, now.timestamp(), config)


def recent_owners(session: Session, config: FairShare, now: datetime) -> dict[tuple[str, str], str | None]:
    """(queue, owner) -> team of every owner with an attempt running or ended within fair share's horizon."""
    since = _horizon(config, now)
    query = (
        select(Job.queue, Job.owner, Job.team)
        .join(Attempt, col(Job.id) == col(Attempt.job_id))
        .where(or_(col(Attempt.ended_at).is_(None), col(Attempt.ended_at) > since))
        .distinct()
    )
    return {(queue, owner): team for queue, owner, team in session.exec(query).all()}


def gpu_hours(session: Session, rules: Quotas, limits: dict[str, QueueLimit], now: datetime) -> dict[Scope, float]:
    """GPU-hours used within each GPU-hour quota's own window, by scope (only the scopes such a quota governs)."""

    def window(scope: Scope) -> float | None:
        kind = scope[0]
        limit = limits.get(scope[1]) if kind.startswith("queue-") else None
        quota = {
            "owner": lambda: rules.of_owner(scope[1]),
            "team": lambda: rules.of_team(scope[1]),
            "queue-owner": lambda: limit.owner_quota if limit else None,
            "queue-team": lambda: limit.team_quota if limit else None,
        }[kind]()
        return quota.window_hours if quota is not None and quota.max_gpu_hours is not None else None

    quotas_all = [*rules.owners.values(), *rules.teams.values()]
    quotas_all += [q for limit in limits.values() for q in (limit.owner_quota, limit.team_quota) if q is not None]
    hours = [q.window_hours for q in quotas_all if q.max_gpu_hours is not None]
    if not hours:
        return {}
    out: dict[Scope, float] = {}
    for attempt, owner, team, queue in _uses(session, now - timedelta(hours=max(hours))):
        if attempt.gpus <= 0:
            continue
        scopes: list[Scope] = [("owner", owner), ("queue-owner", queue, owner)]
        if team is not None:
            scopes += [("team", team), ("queue-team", queue, team)]
        end = attempt.ended_at or now
        for scope in scopes:
            span = window(scope)
            start = max(attempt.started_at, now - timedelta(hours=span)) if span is not None else end
            if end > start:
                out[scope] = out.get(scope, 0.0) + attempt.gpus * (end - start).total_seconds() / 3600.0
    return out
