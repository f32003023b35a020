"""Where a queued job stands: its position in admission order and an estimated start, as Slurm's `squeue --start`.

Position is the job's place in the order admission would use now (`service.fairshare.fair_order` over every queued
job, with the usage admission reads), in its queue and overall, counted from 1.

The estimate replays that order against the cluster's capacity. Each running job frees what it holds at its expected
end: the earliest of its timeout (attempt start + `timeout_seconds`) and, where its loop reports `total_steps`, its
last progress time plus the steps left at the rate it has gone so far. Each waiting job, in order, starts at the
first time the capacity left by everything placed before it holds its whole group for its expected run (its
`timeout_seconds`; jobs without one hold their resources with no end known, so jobs behind them that need those
resources get no estimate: None, never a made-up time). Later jobs may start earlier in room earlier ones cannot use,
as backfill does. Quotas and per-node placement are not replayed: the estimate is the cluster-wide bound.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlmodel import Session, col, select

from service import fairshare, resources, standing
from service.models import ACTIVE_STATES, Attempt, ClusterSnapshot, Job, JobState, utcnow
from service.scheduler import Candidate
from service.settings import Settings
from service.spec import JobSpec

MAX_REPLAYED = 2000  # waiting jobs replayed for an estimate; the ones behind get position only
TOTAL_STEPS = "total_steps"  # the metric a loop reports its planned number of steps under


@dataclass(frozen=True)
class Standing:
    queue_position: int
    position: int
    start: datetime | None


@dataclass(frozen=True)
class Held:
    """A running job's resources and when it is expected to free them (None: unknown)."""

    total: dict[str, float]
    end: float | None


@dataclass(frozen=True)
class Pending:
    job_id: str
    total: dict[str, float]
    duration: float | None
    not_before: float


def expected_end(
    started: float, timeout: float | None, step: int | None, total_steps: float | None, progress_at: float | None
) -> float | None:
    """When a running attempt is expected to end: the earlier of its timeout and its step-rate projection."""
    ends = []
    if timeout is not None:
        ends.append(started + timeout)
    if total_steps and step and progress_at and progress_at > started and step <= total_steps:
        rate = step / (progress_at - started)
        ends.append(progress_at + (total_steps - step) / rate)
    return min(ends) if ends else None


def replay(
    order: Sequence[Pending], running: Iterable[Held], capacity: dict[str, float], now: float
) -> dict[str, float | None]:
    """Each pending job's estimated start (seconds), placing them in order on a free-capacity profile: segment k is
    free capacity `free[k]` from `times[k]` until `times[k + 1]` (the last one forever)."""
    base = dict(capacity)
    ends: list[tuple[float, dict[str, float]]] = []
    for held in running:
        resources.take(base, held.total)
        if held.end is not None:
            ends.append((max(held.end, now), held.total))
    times, free = [now], [dict(base)]
    for when, total in sorted(ends, key=lambda e: e[0]):
        k = _split(times, free, when)
        for m in range(k, len(free)):
            _apply(free[m], total)
    out: dict[str, float | None] = {}
    for job in order:
        start = _earliest(job, times, free)
        out[job.job_id] = start
        if start is None:
            continue
        first = _split(times, free, start)
        last = len(free) if job.duration is None else _split(times, free, start + job.duration)
        for m in range(first, last):
            _apply(free[m], {k: -v for k, v in job.total.items()})
    return out


def _split(times: list[float], free: list[dict[str, float]], when: float) -> int:
    """The index of the segment that starts at `when`, splitting the one that holds it if needed."""
    k = bisect.bisect_right(times, when) - 1
    if k >= 0 and times[k] == when:
        return k
    k = max(k, 0)
    times.insert(k + 1, when)
    free.insert(k + 1, dict(free[k]))
    return k + 1


def _earliest(job: Pending, times: list[float], free: list[dict[str, float]]) -> float | None:
    """The first time from which every segment it would span holds `job.total` (for `job.duration`, else forever).
    A segment that cannot hold it rules out every start before it whose window reaches it: the scan jumps past it."""
    k = max(0, bisect.bisect_right(times, job.not_before) - 1)
    while k < len(times):
        start = max(times[k], job.not_before)
        end = math.inf if job.duration is None else start + job.duration
        m = k
        while m < len(times) and (m == k or times[m] < end) and resources.fits(free[m], job.total):
            m += 1
        if m == len(times) or (m > k and times[m] >= end):
            return start
        k = m + 1
    return None


def _apply(free: dict[str, float], change: dict[str, float]) -> None:
    for key, value in change.items():
        free[key] = free.get(key, 0.0) + value


_cache: dict[str, tuple[float, dict[str, Standing]]] = {}
CACHE_SECONDS = 2.0


def estimates(
    session: Session, settings: Settings, *, now: datetime | None = None, cached: bool = True, job_id: str | None = None
) -> dict[str, Standing]:
    """Every queued job's position and estimated start (computed at most every CACHE_SECONDS per process, and again
    when `job_id`, queued since, is not in the cached answer)."""
    key = str(settings.database_url)
    hit = _cache.get(key)
    fresh = hit is not None and time.monotonic() - hit[0] < CACHE_SECONDS and (job_id is None or job_id in hit[1])
    if cached and now is None and hit is not None and fresh:
        return hit[1]
    result = _compute(session, settings, now or utcnow())
    if now is None:
        _cache[key] = (time.monotonic(), result)
    return result


def _spec(job: Job) -> JobSpec | None:
    try:
        return JobSpec.model_validate(job.spec)
    except ValueError:
        return None


def _compute(session: Session, settings: Settings, now: datetime) -> dict[str, Standing]:
    fair = settings.fair_share_config()
    queued = session.exec(select(Job).where(Job.state == JobState.QUEUED)).all()
    specs = {job.id: _spec(job) for job in queued}
    candidates = [
        Candidate(job_id=j.id, priority=j.priority, seq=j.created_at.timestamp(), queue=j.queue, owner=j.owner,
                  team=j.team, num_workers=s.resources.num_workers, per_worker=s.resources.per_worker(),
                  placement=s.resources.placement.value)
        for j in queued if (s := specs[j.id]) is not None
    ]  # fmt: skip
    running = _running(session, now)
    holding = [(owner, team, held.total) for owner, team, held in running]
    order = fairshare.fair_order(candidates, standing.fair_usage(session, fair, now), fair, holding)
    by_id = {job.id: job for job in queued}
    starts = replay(
        _pending(order[:MAX_REPLAYED], by_id, specs),
        [held for _, _, held in running],
        _capacity(session),
        now.timestamp(),
    )
    out: dict[str, Standing] = {}
    in_queue: dict[str, int] = {}
    for place, cand in enumerate(order, start=1):
        in_queue[cand.queue] = in_queue.get(cand.queue, 0) + 1
        start = starts.get(cand.job_id)
        when = datetime.fromtimestamp(start, tz=timezone.utc) if start is not None else None
        out[cand.job_id] = Standing(in_queue[cand.queue], place, when)
    return out


def _pending(order: list[Candidate], jobs: dict[str, Job], specs: dict[str, JobSpec | None]) -> list[Pending]:
    out = []
    for cand in order:
        job, spec = jobs[cand.job_id], specs[cand.job_id]
        not_before = job.not_before.timestamp() if job.not_before else 0.0
        out.append(Pending(cand.job_id, cand.total(), spec.timeout_seconds if spec else None, not_before))
    return out


def _running(session: Session, now: datetime) -> list[tuple[str, str | None, Held]]:
    rows = session.exec(
        select(Job, Attempt)
        .join(Attempt, (col(Attempt.job_id) == col(Job.id)) & (col(Attempt.number) == col(Job.attempt)))
        .where(col(Job.state).in_(ACTIVE_STATES))
    ).all()  # fmt: skip
    out = []
    for job, attempt in rows:
        spec = _spec(job)
        total = {"CPU": attempt.cpus, "GPU": attempt.gpus}
        if spec is not None:
            total = spec.resources.total()
        metrics = job.latest_metrics or {}
        end = expected_end(
            attempt.started_at.timestamp(),
            spec.timeout_seconds if spec else None,
            job.step,
            metrics.get(TOTAL_STEPS),
            job.progress_at.timestamp() if job.progress_at else None,
        )
        out.append((job.owner, job.team, Held(total, end)))
    return out


def _capacity(session: Session) -> dict[str, float]:
    snap = session.get(ClusterSnapshot, 1)
    return dict(snap.total) if snap is not None else {}
