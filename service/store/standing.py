"""What admission reads besides the queue: what each scope holds now, decayed usage for fair share, GPU-hours used in
quota windows. One module, so the admission pass and the position/estimate answers (`service.estimate`) see the
same numbers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

from sqlalchemy import select as sa_select
from sqlmodel import Session, col, or_, select

from service.core.resources import ACCELERATOR_PREFIX
from service.policy import quotas
from service.policy.fairshare import FairShare, Usage, Use, usage_of
from service.policy.quotas import Held, QueueLimit, Quotas, Scope
from service.store.models import Attempt, Job


def _horizon(config: FairShare, now: datetime) -> datetime:
    """The oldest end time fair share still reads (usage older than the horizon weighs under 0.1%)."""
    return now - timedelta(seconds=config.half_life_seconds * config.horizon_half_lives)


def held(active: Iterable[Job], resources_of: Callable[[Job], dict[str, float]]) -> dict[Scope, Held]:
    """What admitted jobs hold, by every scope they count in (queue, owner, team, owner/team within a queue)."""
    out: dict[Scope, Held] = {}
    for job in active:
        quotas.count(out, resources_of(job), job.queue, job.owner, job.team)
    return out


def _uses(
    session: Session, since: datetime, until: datetime | None = None
) -> list[tuple[Attempt, str, str | None, str, str | None]]:
    """Attempts ended after `since` and, without `until`, those running now; with `until`, only those ended by then."""
    ended_since = col(Attempt.ended_at) > since
    where = (
        or_(col(Attempt.ended_at).is_(None), ended_since)
        if until is None
        else ended_since & (col(Attempt.ended_at) <= until)
    )
    query = (  # SQLAlchemy's select: SQLModel's is typed for four columns at most
        sa_select(Attempt, col(Job.owner), col(Job.team), col(Job.queue), col(Job.accelerator_type))
        .join(Job, col(Job.id) == col(Attempt.job_id))
        .where(where)
    )
    return [tuple(row) for row in session.execute(query).all()]


# Attempts that ended this long before a read are settled: their usage only decays from then on, so each process
# reads them once per `refresh_seconds`. Anything running or ended since is read again a second later: an attempt
# that ends (or starts) right after a read counts within that second, as it did not when the whole answer was kept
# (a job that ended on its driver's word a few seconds after it started left its owner's usage near zero for up to
# 30 s, and the owner's next job was admitted ahead of an owner who had used nothing). The margin covers an end
# recorded with a timestamp a little before its commit.
SETTLED_MARGIN = timedelta(minutes=5)

# The recent part's answer is kept RECENT_SECONDS of the service's clock, or RECENT_COST_FACTOR times what its read
# took if longer: at hundreds of claims a second every attempt of the bench is recent, and an admission pass must not
# read them all each time. Within that second an end is seen late by at most that second's usage.
RECENT_SECONDS = 1.0
RECENT_COST_FACTOR = 10.0

_usage_cache: dict[tuple[str, str], tuple[datetime, datetime, Usage]] = {}
_recent_cache: dict[tuple[str, str], tuple[datetime, datetime, float, Usage]] = {}  # (read at, cut, cost, usage)
_usage_lock = threading.Lock()


def fair_usage(session: Session, config: FairShare, now: datetime, *, cached: bool = True) -> Usage:
    """Decayed usage per team and owner (running attempts up to now); nothing older than the horizon is read.

    Usage of attempts that ended over `SETTLED_MARGIN` before a read is kept for `config.refresh_seconds` of the
    service's clock and decayed to `now` (it only decays); attempts running or ended since are read again after
    RECENT_SECONDS (or RECENT_COST_FACTOR times their read's cost).
    """
    if not config.enabled:
        return Usage()
    key = (str(session.get_bind().engine.url), repr(config))
    with _usage_lock:
        hit = _usage_cache.get(key)
    if not (cached and hit is not None and timedelta(0) <= now - hit[0] < timedelta(seconds=config.refresh_seconds)):
        cut = now - SETTLED_MARGIN
        hit = (now, cut, usage_of(_use_rows(_uses(session, _horizon(config, now), until=cut)), cut.timestamp(), config))
        with _usage_lock:
            _usage_cache[key] = hit
    _, cut, settled = hit
    factor = 2.0 ** (-(now - cut).total_seconds() / config.half_life_seconds)
    out = Usage({k: v * factor for k, v in settled.teams.items()}, {k: v * factor for k, v in settled.owners.items()})
    with _usage_lock:
        kept = _recent_cache.get(key)
    if (
        cached
        and kept is not None
        and kept[1] == cut
        and timedelta(0) <= now - kept[0] < timedelta(seconds=max(RECENT_SECONDS, RECENT_COST_FACTOR * kept[2]))
    ):
        recent = kept[3]
    else:
        started = time.monotonic()
        recent = usage_of(_use_rows(_uses(session, cut)), now.timestamp(), config)
        with _usage_lock:
            _recent_cache[key] = (now, cut, time.monotonic() - started, recent)
    for team, amount in recent.teams.items():
        out.teams[team] = out.teams.get(team, 0.0) + amount
    for owner, amount in recent.owners.items():
        out.owners[owner] = out.owners.get(owner, 0.0) + amount
    return out


def _use_rows(rows: Iterable[tuple[Attempt, str, str | None, str, str | None]]) -> Iterable[Use]:
    """Each attempt's use; its accelerator type rides along (weight 0 itself), so a GPU weight by type applies."""
    return (
        Use(owner, team, {"CPU": a.cpus, "GPU": a.gpus, **({ACCELERATOR_PREFIX + kind: 0.0} if kind else {})},
            a.started_at.timestamp(), a.ended_at.timestamp() if a.ended_at else None)
        for a, owner, team, _, kind in rows
    )  # fmt: skip


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
    for attempt, owner, team, queue, _ in _uses(session, now - timedelta(hours=max(hours))):
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
