"""Where a queued job stands: its position in admission order and an estimated start, as Slurm's `squeue --start`.

Position is the job's place in the order admission would use now (`service.policy.fairshare.fair_order` over every
queued job, with the usage admission reads), in its queue and overall, counted from 1.

The estimate is a forward replay of admission (`service.policy.forecast`): the service's own fair order, limits, quotas,
cohorts, backfill and preemption, run from now on over what this module reads:

- each running job frees what it holds at its expected end: the earliest of its timeout (attempt start +
  `timeout_seconds`) and, where its loop reports `total_steps`, its last progress time plus the steps left at the
  rate it has gone so far; a job asked to yield stops when its grace runs out and queues again for the rest;
- each waiting job runs, once started, for its `timeout_seconds` times its owner's run ratio: how long that owner's
  jobs that succeeded lately ran against their timeouts (the median of the last `RATIO_SAMPLES`; everyone's when the
  owner has fewer than `MIN_RATIO_SAMPLES`; 1 with no history). A job without a timeout holds its resources with no
  end known, so jobs behind it that need them get no estimate: None, never a made-up time;
- on a cluster that may grow, a job whose room was asked of the autoscaler (its `scale_requested` event) starts
  by the time new nodes took to come lately (`scale_up_seconds`: the median, over the last `SCALE_SAMPLES` jobs,
  from `scale_requested` to `capacity_arrived`) after it was asked, or earlier where the replay frees room sooner;
  with no such history, by the replay alone;
- each owner who submitted in the last `ARRIVAL_WINDOW_SECONDS` goes on submitting at that rate, jobs like its
  latest ones: with fair share a job submitted later by an owner who used less goes ahead of one waiting now, and a
  replay of the queue alone would be early whenever owners keep submitting (measured: most of its misses were).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import func
from sqlmodel import Session, col, select

from service.config import policies
from service.config.settings import Settings
from service.dispatch.admission import candidate
from service.lifecycle import queues
from service.policy import fairshare, forecast
from service.spec.job import JobSpec
from service.store import standing
from service.store.db import base_engine
from service.store.models import ACTIVE_STATES, Attempt, ClusterSnapshot, EndReason, Job, JobEvent, JobState, utcnow
from service.store.spec_cache import SpecCache, stored_size

log = logging.getLogger(__name__)

# Waiting jobs replayed for an estimate, in admission order; the ones behind get position only (Slurm's backfill
# looks as deep by default: bf_max_job_test=500). A replay of 500 on 4 nodes takes about 0.3 s.
MAX_REPLAYED = 500
TOTAL_STEPS = "total_steps"  # the metric a loop reports its planned number of steps under
ARRIVAL_WINDOW_SECONDS = 3600.0  # an owner's submission rate is read over this window
ARRIVAL_TEMPLATES = 8  # an owner's projected jobs are like its latest this many
RATIO_SAMPLES = 50  # succeeded attempts an owner's run ratio is read from
MIN_RATIO_SAMPLES = 3
RATIO_HISTORY_SECONDS = 7 * 24 * 3600.0
SCALE_SAMPLES = 20  # jobs whose room came lately: how long new nodes take is read from them


@dataclass(frozen=True)
class Standing:
    queue_position: int
    position: int
    start: datetime | None


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


@dataclass
class _Cached:
    at: float  # time.monotonic() when computed
    cost: float  # seconds it took
    result: dict[str, Standing]


_cache: dict[str, _Cached] = {}
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
CACHE_SECONDS = 2.0  # an answer is reused for at least this long
COST_FACTOR = 10.0  # and for this many times what it cost: estimates never take over a tenth of a process's time


def estimates(
    session: Session, settings: Settings, *, now: datetime | None = None, cached: bool = True, job_id: str | None = None
) -> dict[str, Standing]:
    """Every queued job's position and estimated start. Per process, an answer is reused for CACHE_SECONDS, or
    COST_FACTOR times what it took if longer; a job queued since is answered by a new one at once while answers
    cost under INLINE_SECONDS, else only once that much of its cost has passed too (before, it has no standing yet);
    one thread computes while the others reuse the last answer. `now` (a simulated clock) always computes afresh."""
    if now is not None or not cached:
        return _compute(session, settings, now or utcnow())
    key = str(settings.database_url)
    with _locks_guard:
        lock = _locks.setdefault(key, threading.Lock())
    hit = _cache.get(key)
    asked = time.monotonic()
    if hit is not None:
        age = asked - hit.at
        if age < max(CACHE_SECONDS, COST_FACTOR * hit.cost) and (job_id is None or job_id in hit.result):
            return hit.result
        # A job queued since the answer (one just submitted, read back at once) waits for a new answer when answers
        # are cheap; of a deep queue's costly answer it gets none until that much of its cost has passed.
        # Cheap by its cost, or by its size: a short queue's answer is cheap whatever the clock said it took (a
        # loaded machine made a two-job answer take over INLINE_SECONDS, and a job just submitted showed no place).
        cheap = job_id is not None and (hit.cost < INLINE_SECONDS or len(hit.result) <= INLINE_SHORT_QUEUE)
        if (age < COST_FACTOR * hit.cost and not cheap) or not lock.acquire(blocking=cheap):
            return hit.result  # too soon for its cost, or being computed right now
    else:
        lock.acquire()
    try:
        hit = _cache.get(key)
        if hit is not None and (
            hit.at >= asked or (time.monotonic() - hit.at < CACHE_SECONDS and (job_id is None or job_id in hit.result))
        ):
            # Another thread computed it while this one waited: one answer serves every read that waited for it,
            # so many reads of a job that is in no answer (one waiting on dependencies) cost one compute, not many.
            return hit.result
        started = time.monotonic()
        result = _compute(session, settings, utcnow())
        _cache[key] = _Cached(time.monotonic(), time.monotonic() - started, result)
        return result
    finally:
        lock.release()


INLINE_SECONDS = 0.25  # a listing computes the estimate itself only when it last took less than this
INLINE_SHORT_QUEUE = 100  # ... or, for one job's read, when the last answer held at most this many queued jobs
INLINE_QUEUED = 1000  # ... or, before any estimate, when at most this many jobs are queued


def estimates_nowait(session: Session, settings: Settings) -> dict[str, Standing]:
    """`estimates` for a listing, which must not pay for the whole queue's forecast (seconds at a depth of tens of
    thousands): computed here only while that is cheap (it last took under INLINE_SECONDS, or nothing was computed
    yet and the queue is short); otherwise the last answer, whatever its age, while a thread of its own (one at a
    time per database) computes the next one. Before the first answer of a deep queue, nobody has a place."""
    key = str(settings.database_url)
    hit = _cache.get(key)
    if hit is not None and hit.cost < INLINE_SECONDS:
        return estimates(session, settings)
    if hit is None:
        queued = session.exec(select(func.count()).select_from(Job).where(Job.state == JobState.QUEUED)).one()
        if queued <= INLINE_QUEUED:
            return estimates(session, settings)
    stale = hit is None or time.monotonic() - hit.at >= max(CACHE_SECONDS, COST_FACTOR * hit.cost)
    with _locks_guard:
        busy = _locks.setdefault(key, threading.Lock()).locked()
    if stale and not busy:
        engine = base_engine(session.get_bind())  # (a request's write bind would make its reads write transactions)
        threading.Thread(target=_refresh, args=(engine, settings), name="estimates", daemon=True).start()
    return hit.result if hit is not None else {}


def _refresh(engine: Any, settings: Settings) -> None:
    try:
        with Session(engine) as session:
            estimates(session, settings)
    except Exception:  # noqa: BLE001 - the next listing tries again; a listing never fails for an estimate
        log.exception("estimating the queue failed")


_specs: SpecCache[JobSpec | None] = SpecCache()


def _spec(job: Job) -> JobSpec | None:
    """The job's stored spec (None if it no longer validates). A spec never changes: each is parsed once per process,
    by its id and hash (a row without a hash is parsed each time)."""
    key = (job.id, job.spec_hash) if job.spec_hash else None
    if key is not None:
        kept, known = _specs.get(key)
        if kept:
            return known
    try:
        spec: JobSpec | None = JobSpec.model_validate(job.spec)
    except ValueError:
        spec = None
    if key is not None:
        _specs.put(key, spec, stored_size(job.spec))
    return spec


def _compute(session: Session, settings: Settings, now: datetime) -> dict[str, Standing]:
    fair = policies.fair_share(settings)
    # A job waiting on its dependencies (service.workflows.dependencies) has no place in admission order yet.
    queued = session.exec(select(Job).where(Job.state == JobState.QUEUED, Job.waiting_on == 0)).all()
    specs = {job.id: _spec(job) for job in queued}
    candidates = [candidate(j, s) for j in queued if (s := specs[j.id]) is not None]
    ratio = run_ratios(session, now)
    running = _running(session, now, settings.preemption_grace_seconds, ratio)
    holding = [fairshare.Holding(r.owner, r.team, r.total, r.cand.run_seconds if r.cand else None) for r in running]
    usage = standing.fair_usage(session, fair, now)
    order = fairshare.fair_order(candidates, usage, fair, holding)
    by_id = {job.id: job for job in queued}
    waiters = []
    for cand in order[:MAX_REPLAYED]:
        job, spec = by_id[cand.job_id], specs[cand.job_id]
        not_before = job.not_before.timestamp() if job.not_before else 0.0
        waiters.append(forecast.Waiter(cand, _duration(spec, ratio(job.owner)), not_before))
    limits, rules = queues.limits(session, settings), policies.quota_rules(settings)
    policy = forecast.Policy(
        fair=fair, limits=limits, rules=rules, gpu_hours=standing.gpu_hours(session, rules, limits, now),
        reserve_after_seconds=settings.reserve_after_seconds, grace_seconds=settings.preemption_grace_seconds,
        admit_batch=settings.admit_batch, grow=settings.elastic_grow,
        grow_after_seconds=settings.elastic_grow_after_seconds, grow_min_gain=settings.elastic_grow_min_gain,
    )  # fmt: skip
    starts = forecast.forecast(waiters, running, _nodes(session), now.timestamp(), usage=usage, policy=policy,
                               arrivals=arrivals(session, now, ratio))  # fmt: skip
    asked, took = scale_up_seconds(session, [c.job_id for c in order]) if settings.cluster_may_grow else ({}, None)
    out: dict[str, Standing] = {}
    in_queue: dict[str, int] = {}
    for place, cand in enumerate(order, start=1):
        in_queue[cand.queue] = in_queue.get(cand.queue, 0) + 1
        start = starts.get(cand.job_id)
        if took is not None and cand.job_id in asked:  # new nodes, unless the replay frees room sooner
            grown = max(now.timestamp(), asked[cand.job_id].timestamp() + took)
            start = grown if start is None else min(start, grown)
        when = datetime.fromtimestamp(start, tz=timezone.utc) if start is not None else None
        out[cand.job_id] = Standing(in_queue[cand.queue], place, when)
    return out


def scale_up_seconds(session: Session, queued: list[str]) -> tuple[dict[str, datetime], float | None]:
    """When each of `queued` had its room asked of the autoscaler, and how long new nodes took lately (the median
    of the last SCALE_SAMPLES `scale_requested` -> `capacity_arrived`; None with no such history)."""
    arrived = session.exec(
        select(JobEvent.job_id, JobEvent.at).where(JobEvent.reason == "capacity_arrived")
        .order_by(col(JobEvent.id).desc()).limit(SCALE_SAMPLES)
    ).all()  # fmt: skip
    first = _asked_at(session, [job_id for job_id, _ in arrived])
    took = [(at - first[job_id]).total_seconds() for job_id, at in arrived if job_id in first]
    return _asked_at(session, queued), (statistics.median(took) if took else None)


def _asked_at(session: Session, job_ids: list[str]) -> dict[str, datetime]:
    """Each job's latest `scale_requested` event time, for those of `job_ids` that have one."""
    out: dict[str, datetime] = {}
    for chunk in range(0, len(job_ids), 1000):
        rows = session.exec(
            select(JobEvent.job_id, func.max(JobEvent.at))
            .where(col(JobEvent.job_id).in_(job_ids[chunk : chunk + 1000]), JobEvent.reason == "scale_requested")
            .group_by(col(JobEvent.job_id))
        ).all()
        out.update({job_id: at for job_id, at in rows})
    return out


def _duration(spec: JobSpec | None, ratio: float) -> float | None:
    return None if spec is None or spec.timeout_seconds is None else spec.timeout_seconds * ratio


class Ratios:
    """Each owner's run ratio (see the module docstring): `ratios(owner)`."""

    def __init__(self, by_owner: dict[str, list[float]]) -> None:
        everyone = sorted(r for rs in by_owner.values() for r in rs)
        self._default = statistics.median(everyone) if len(everyone) >= MIN_RATIO_SAMPLES else 1.0
        self._owners = {o: statistics.median(rs) for o, rs in by_owner.items() if len(rs) >= MIN_RATIO_SAMPLES}

    def __call__(self, owner: str) -> float:
        return self._owners.get(owner, self._default)


_ratios: dict[str, tuple[datetime, Ratios]] = {}
RATIO_REFRESH_SECONDS = 60.0  # of the service's clock: ratios move with whole jobs, not seconds


def run_ratios(session: Session, now: datetime, *, cached: bool = True) -> Ratios:
    """How long each owner's recently succeeded attempts ran against their timeouts (clamped to (0, 1]); read again
    after RATIO_REFRESH_SECONDS of the service's clock."""
    key = str(session.get_bind().engine.url)
    hit = _ratios.get(key)
    if cached and hit is not None and timedelta(0) <= now - hit[0] < timedelta(seconds=RATIO_REFRESH_SECONDS):
        return hit[1]
    ratios = _read_ratios(session, now)
    _ratios[key] = (now, ratios)
    return ratios


def _read_ratios(session: Session, now: datetime) -> Ratios:
    query = (
        select(Job.owner, Job.spec, Attempt.started_at, Attempt.ended_at)
        .join(Attempt, col(Attempt.job_id) == col(Job.id))
        .where(col(Attempt.ended_at) > now - timedelta(seconds=RATIO_HISTORY_SECONDS),
               col(Attempt.end_reason) == EndReason.SUCCEEDED, col(Attempt.number) == 1)
        .order_by(col(Attempt.ended_at).desc())
        .limit(20 * RATIO_SAMPLES)
    )  # fmt: skip
    by_owner: dict[str, list[float]] = {}
    for owner, spec, started, ended in session.exec(query).all():
        timeout = spec.get("timeout_seconds") if isinstance(spec, dict) else None
        ratios = by_owner.setdefault(owner, [])
        if not isinstance(timeout, int | float) or timeout <= 0 or len(ratios) >= RATIO_SAMPLES:
            continue
        if started is None or ended is None:
            continue
        ratios.append(min(max((ended - started).total_seconds() / timeout, 1e-3), 1.0))
    return Ratios({o: rs for o, rs in by_owner.items() if rs})


def arrivals(session: Session, now: datetime, ratio: Ratios) -> list[forecast.Arrivals]:
    """Each owner's projected submissions: as many per `ARRIVAL_WINDOW_SECONDS` as it submitted in the last one,
    evenly spaced after its latest, like its latest `ARRIVAL_TEMPLATES` jobs in turn.

    The whole window, not the time since the owner's first submission in it: a batch submitted at once is not a rate
    (measured on the simulation's cohort scenario, projecting a batch of 4 as one every 150 s put 49% of its estimates
    out of bounds; over the whole window, 2%). An owner who has just started submitting is under-projected for its
    first hour instead."""
    since = now - timedelta(seconds=ARRIVAL_WINDOW_SECONDS)
    query = select(Job.owner, func.count(), func.max(Job.created_at)).where(Job.created_at > since).group_by(Job.owner)
    out = []
    for owner, n, last in session.exec(query).all():
        latest = session.exec(
            select(Job).where(Job.owner == owner, Job.created_at > since)
            .order_by(col(Job.created_at).desc(), col(Job.id).desc()).limit(ARRIVAL_TEMPLATES)
        ).all()  # fmt: skip
        templates = tuple(
            forecast.Waiter(candidate(job, spec), _duration(spec, ratio(owner)), projected=True)
            for job in reversed(latest) if (spec := _spec(job)) is not None
        )  # fmt: skip
        every = ARRIVAL_WINDOW_SECONDS / n
        last = last.replace(tzinfo=last.tzinfo or timezone.utc)
        out.append(forecast.Arrivals(owner, last.timestamp() + every, every, templates))
    return out


def _running(session: Session, now: datetime, grace: float, ratio: Ratios) -> list[forecast.Runner]:
    rows = session.exec(
        select(Job, Attempt)
        .join(Attempt, (col(Attempt.job_id) == col(Job.id)) & (col(Attempt.number) == col(Job.attempt)))
        .where(col(Job.state).in_(ACTIVE_STATES))
    ).all()  # fmt: skip
    out = []
    for job, attempt in rows:
        spec = _spec(job)
        total = {"CPU": attempt.cpus, "GPU": attempt.gpus}
        cand = None
        if spec is not None:
            total, cand = spec.resources.total(job.world_size), candidate(job, spec)
        started, timeout = attempt.started_at.timestamp(), spec.timeout_seconds if spec else None
        metrics = job.latest_metrics or {}
        progress_at = job.progress_at.timestamp() if job.progress_at else None
        end = expected_end(started, timeout, job.step, metrics.get(TOTAL_STEPS), progress_at)
        if timeout is not None and end == started + timeout and started + timeout * ratio(job.owner) > now.timestamp():
            end = started + timeout * ratio(job.owner)  # no step projection: as long as the owner's jobs run
        runner = forecast.Runner(job.id, job.owner, job.team, job.queue, job.priority, job.created_at.timestamp(),
                                 total, end, cand=cand, size=job.world_size, started=started)  # fmt: skip
        if job.preempt_requested_at is not None:  # asked to yield: gone when its grace runs out, if not before
            asked = job.preempt_requested_at.replace(tzinfo=job.preempt_requested_at.tzinfo or timezone.utc)
            stop = asked.timestamp() + grace
            runner.yielding = True
            if end is None or end > stop:
                left = None if end is None else end - max(stop, now.timestamp())
                if cand is not None:
                    runner.rest = forecast.Waiter(cand, left, not_before=stop, projected=True)
                runner.end = stop
        out.append(runner)
    return out


def _nodes(session: Session) -> dict[str, dict[str, float]]:
    """Each live node's total resources (the cluster's total as one node where the snapshot lists none)."""
    snap = session.get(ClusterSnapshot, 1)
    if snap is None:
        return {}
    nodes = {str(n.get("node_id")): dict(n.get("total") or {}) for n in snap.nodes or [] if n.get("alive", True)}
    nodes = {k: v for k, v in nodes.items() if v}
    return nodes or {"cluster": dict(snap.total)}
